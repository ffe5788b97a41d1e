"""Smoke tests of benchmarks/ps/malloc_bench.py: a tiny run of two real shards prints both rates, the second over the
first, and its JSON; bad allocator lists are named."""
from __future__ import annotations

import json
import pytest

from benchmarks.ps import malloc_bench


def test_tiny_run_prints_each_shards_rate_and_the_ratio(capsys):
    assert malloc_bench.main(["--rows", "2e4", "--allocators", "system,auto", "--warmup", "25", "--repeats", "50",
                              "--request-ids", "4096", "--json"]) == 0
    out = capsys.readouterr().out
    figures = json.loads(out.strip().splitlines()[-1])
    assert figures["rows"] == 20000 and figures["allocators"] == ["system", "auto"]
    system, auto = figures["shards"]["system"], figures["shards"]["auto"]
    assert system["zipf_rows_per_s"] > 0 and auto["zipf_rows_per_s"] > 0 and "over_first" not in system
    assert auto["over_first"] == pytest.approx(auto["zipf_rows_per_s"] / system["zipf_rows_per_s"])
    assert len(auto["turns_over_first"]) == 2  # 50 timed requests: two turns of 25 a shard
    assert "system: Zipf lookups" in out and "x system's rate (turn by turn: median" in out


@pytest.mark.parametrize("allocators", ["system", "system,system", "system,tcmalloc"])
def test_an_allocator_list_it_cannot_compare_is_refused(capsys, allocators):
    with pytest.raises(SystemExit):
        malloc_bench.main(["--allocators", allocators])
    assert f"--allocators needs two or more distinct of auto, jemalloc, system; got {allocators!r}" in capsys.readouterr().err
