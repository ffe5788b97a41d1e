"""A fast subset of the RPC fuzzing of ``tools/fuzz_ps.py``: random bytes, mutated and malformed
protobufs, huge counts, odd sizes and unknown tables, sent raw to a real shard. Every answer is a clear
status with a message, nothing hangs, the shard keeps serving and the sentinel table is unchanged."""
from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile

import pytest
from hypothesis import HealthCheck, given, settings

from lightning_persia.testing.fuzz import FuzzTarget, fuzz_cases

SCRATCH = tempfile.mkdtemp(prefix="persia-fuzz-")
EXAMPLES = 300


@pytest.fixture(scope="module")
def target(ps_cluster1):
    fuzz = FuzzTarget(ps_cluster1.addresses[0])  # max_ids_per_request 4096: "huge counts" are cheap here
    fuzz.prepare()
    yield fuzz
    fuzz.close()
    shutil.rmtree(SCRATCH, ignore_errors=True)


def test_fuzzed_requests_get_clear_statuses_and_change_nothing(target):
    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(case=fuzz_cases(SCRATCH))
    def one(case):
        target.send(*case)

    one()
    print(target.summary())
    assert target.cases >= EXAMPLES
    assert not target.findings, "\n".join(target.findings[:20])
    target.check_intact()


def test_the_fuzzer_imports_without_hypothesis_and_names_the_extra_when_asked_for_cases():
    script = ("import sys; sys.modules['hypothesis'] = None\n"
              "from lightning_persia.testing.fuzz import FuzzTarget, fuzz_cases\n"
              "try:\n    fuzz_cases('/tmp')\nexcept ImportError as err:\n    print(err)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "fuzz_cases needs hypothesis, which the test extra installs: pip install 'lightning-persia[test]'" in done.stdout
