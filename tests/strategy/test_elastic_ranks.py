"""Shards added and drained while 2 ranks fit (DDP on gloo, each a process of run_toy.py): at staleness 0 the run ends
with exactly the weights of a 2-rank run that never scaled, whether the move runs in the callback, in the background,
or in an operator's `lightning-persia ps scale`, with embedding workers or without."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lightning_persia.remote_ps.launcher import LocalShards
from lightning_persia.remote_ps.protocol import ADDRESSES_ENV

SCRIPT = Path(__file__).with_name("run_toy.py")
COMMON = ("--devices", "2", "--shards", "2", "--steps", "24", "--staleness", "0")
PLAN = ("--scale", "8:3,16:2")  # after steps 8 and 16, scale_shards called on every rank as a callback is


def _run(out: Path, *args: str) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    result = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), *COMMON, *args], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return {rank: torch.load(out / f"rank{rank}.pt") for rank in (0, 1)}


def _assert_moved_2_3_2(ranks: dict) -> None:
    reports = ranks[0]["scale_reports"]
    assert [report[:3] for report in reports] == [(2, 3, 1), (3, 2, 2)]  # (from, to, map version)
    assert all(report[3] > 0 for report in reports), reports  # rows moved
    assert ranks[1]["scale_reports"] == []  # rank 0 ran the moves; the other rank's calls returned None
    for name, value in ranks[0]["dense"].items():
        assert torch.equal(value, ranks[1]["dense"][name]), f"dense weight {name} differs between the ranks"


@pytest.mark.scenario  # 2 processes through two moves: CI's scenario step; tests/embedding/test_rank_merge.py keeps rank 0's push in make test
def test_two_ranks_train_through_a_grow_and_a_drain_without_embedding_workers(tmp_path):
    # Without workers each rank's client numbers its updates per shard: ranks that each pushed the merged update
    # routed it by the map each had heard of, and the shards refused the second copy as a conflicting duplicate.
    ranks = _run(tmp_path, "--no-workers", *PLAN)
    _assert_moved_2_3_2(ranks)
    losses = ranks[0]["losses"]
    assert sum(losses[-8:]) < sum(losses[:8])


@pytest.fixture(scope="module")
def never_scaled(tmp_path_factory) -> dict:
    return _run(tmp_path_factory.mktemp("never-scaled"))


@pytest.mark.scenario  # 2 processes for each of two runs: CI's scenario step (`make scenarios`), not `make test`
@pytest.mark.parametrize("background", [False, True], ids=["in-the-callback", "in-the-background"])
@pytest.mark.parametrize("workers", [True, False], ids=["workers", "no-workers"])
def test_two_ranks_scaling_2_3_2_at_staleness_zero_end_with_the_weights_of_a_run_that_never_scaled(tmp_path, never_scaled,
                                                                                                    background, workers):
    plan = ("--scale", "6:3,14:2", "--scale-in-background") if background else PLAN
    scaled = _run(tmp_path, *plan, *(() if workers else ("--no-workers",)))
    _assert_moved_2_3_2(scaled)
    for table, rows in never_scaled[0]["tables"].items():
        assert torch.equal(scaled[0]["tables"][table], rows), table
    for rank in (0, 1):
        for name, value in never_scaled[rank]["dense"].items():
            assert torch.equal(scaled[rank]["dense"][name], value), (rank, name)
        assert scaled[rank]["losses"] == never_scaled[rank]["losses"]


@pytest.mark.scenario
@pytest.mark.parametrize("workers", [True, False], ids=["workers", "no-workers"])
def test_two_ranks_train_on_while_an_operator_grows_and_drains_their_cluster_with_ps_scale(tmp_path, never_scaled, workers):
    from lightning_persia.cli import main

    with LocalShards(2, overrides=["seed=0"]) as shards:  # the seed of the embedded shards of the run that never scaled
        grown = shards.grow(3)  # started before the ranks: a shard takes seconds to start on a loaded machine
        first = ",".join(grown[:2])
        env = {**os.environ, ADDRESSES_ENV: first}
        # --slow-after: each step after the second takes half a second more, which leaves the operator time to act
        ranks = subprocess.Popen([sys.executable, str(SCRIPT), "--out", str(tmp_path), *COMMON, "--slow-after", "2",
                                  *(() if workers else ("--no-workers",))], env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            deadline = time.monotonic() + 240
            while not (tmp_path / "started").exists():
                assert ranks.poll() is None and time.monotonic() < deadline, ranks.communicate(timeout=30)[0][-3000:]
                time.sleep(0.2)
            assert main(["ps", "scale", "--addresses", first, "--to", ",".join(grown)]) == 0
            assert main(["ps", "scale", "--addresses", ",".join(grown), "--to", first]) == 0
            assert ranks.poll() is None, "the ranks ended their training before both moves were done"
            shards.shrink(2)
            output, _ = ranks.communicate(timeout=300)
        finally:
            if ranks.poll() is None:
                ranks.kill()
                ranks.wait()
        assert ranks.returncode == 0, output[-3000:]
    scaled = {rank: torch.load(tmp_path / f"rank{rank}.pt") for rank in (0, 1)}
    for table, rows in never_scaled[0]["tables"].items():
        assert torch.equal(scaled[0]["tables"][table], rows), table
    for rank in (0, 1):
        for name, value in never_scaled[rank]["dense"].items():
            assert torch.equal(scaled[rank]["dense"][name], value), (rank, name)
