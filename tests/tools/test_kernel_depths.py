"""The kernel-depth tool: what it counts as a path, and a short run of it."""
import json
from pathlib import Path

import pytest

from lightning_persia.remote_ps.store import native
from tools import kernel_depths


def test_a_file_left_and_entered_again_is_named():
    path = ["servicer.py:Update", "servicer.py:_past_handover", "exactly_once.py:run", "servicer.py:apply",
            "shard_store.py:update_many"]  # the shape Update had when the servicer handed a closure to the deduplicator
    assert kernel_depths.entered_twice(path) == {"servicer.py"}
    assert kernel_depths.entered_twice(path[:3]) == set()


def test_a_call_is_counted_from_its_entry_but_a_finalizers_is_not_a_paths():
    package = Path("/src/lightning_persia/remote_ps")
    update = [(package / "store/native/jobs.py", "update_many"), (package / "store/shard_store.py", "update_many"),
              (package / "servicer.py", "Update"), (package / "servicer.py", "wrapper"), (Path("/usr/lib/threading.py"), "run")]
    assert kernel_depths.attribute(update) == ("PSServicer.Update", ["remote_ps/servicer.py:Update",
                                                                      "remote_ps/store/shard_store.py:update_many",
                                                                      "remote_ps/store/native/jobs.py:update_many"])
    # the collector freed another test's disk map while this Update allocated: not a path of Update's
    collected = [(package / "store/native/disk_map.py", "__del__"), (Path("/usr/lib/weakref.py"), "__call__")] + update
    assert kernel_depths.attribute(collected) == (None, [])
    assert kernel_depths.attribute([(Path("/usr/lib/threading.py"), "run")]) == (None, [])


@pytest.mark.skipif(not native.available(), reason="it counts calls into the store's native kernels, which a checkout without a C compiler does not build (make native)")
def test_a_short_run_counts_each_kernel_from_its_entry(capsys):
    assert kernel_depths.main(["--rounds", "3", "--batch", "256", "--capacity", "512", "--json"]) == 0
    rows = {(row["scenario"], row["kernel"], row["entry"]): row for row in json.loads(capsys.readouterr().out)["kernels"]}
    probe = rows["memory", "lp_find_many", "PSServicer.Lookup"]  # two tables' probes in one native call
    assert probe["path"][0] == "remote_ps/servicer.py:Lookup" and probe["path"][-1] == "remote_ps/store/native/jobs.py:find_many"
    assert probe["deepest"] == len(probe["path"]) >= probe["typical"]
    assert ("memory", "lp_update_many", "PSServicer.Update") in rows
    assert {scenario for scenario, _, _ in rows} == set(kernel_depths.SCENARIOS)
    assert any(entry == "Demoter.run_once" for scenario, _, entry in rows if scenario == "disk")
    assert not any(entry == "Demoter.run_once" for scenario, _, entry in rows if scenario == "disk, no demoter")
    # the table orchestrates its parts: no path goes down into a file, out of it and back (a part calling back into
    # the memory that calls the part again); the deepest, a request's promotion demoting to disk, is 8 calls
    assert [row["path"] for row in rows.values() if row["entered_twice"]] == []
    deepest = max(rows.values(), key=lambda row: row["deepest"])
    assert deepest["deepest"] <= 8, deepest


@pytest.mark.skipif(not native.available(), reason="it counts calls into the store's native kernels, which a checkout without a C compiler does not build (make native)")
def test_a_limit_below_the_deepest_path_fails(capsys):
    assert kernel_depths.main(["--rounds", "1", "--batch", "64", "--capacity", "256", "--limit", "3"]) == 1
