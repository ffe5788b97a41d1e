"""Multi-process runs (each a subprocess of run_toy.py): 2-rank DDP, resume after a restart, Ctrl-C, no orphans."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from toy import INIT, NUM_IDS

from lightning_persia.remote_ps.store.initializers import initial_rows

SCRIPT = Path(__file__).with_name("run_toy.py")
RESUME_STEPS = int(os.environ.get("PERSIA_RESUME_STEPS", "40"))


def _run(out: Path, *args: str, timeout: float = 240 + 0.5 * RESUME_STEPS) -> subprocess.CompletedProcess:
    out.mkdir(parents=True, exist_ok=True)
    result = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), *args], capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def _children_of(pid: int) -> list[str]:
    """Command lines of live processes started for ``pid`` (shards name their parent with --parent-pid)."""
    found = subprocess.run(["pgrep", "-af", "--", f"--parent-pid {pid}( |$)"], capture_output=True, text=True).stdout
    return [line for line in found.splitlines() if "pgrep" not in line]


def _group(pgid: int) -> list[str]:
    """Live (not zombie) processes of a process group."""
    listing = subprocess.run(["ps", "-o", "stat=,cmd=", "-g", str(pgid)], capture_output=True, text=True).stdout
    return [line for line in listing.splitlines() if line.strip() and not line.strip().startswith("Z")]


KEEP_T0 = ("--data-parallel-max-rows", "40", "--t1-rows", "80")  # t0 (40 rows) on the trainers, t1 (80) remote


@pytest.mark.parametrize("kept", [(), pytest.param(KEEP_T0, marks=pytest.mark.scenario), pytest.param((*KEEP_T0, "--accumulate", "2"), marks=pytest.mark.scenario)],
                         ids=["all-remote", "t0-kept", "t0-kept-accumulating"])  # the second and third: CI's scenario step
def test_two_ranks_two_shards_identical_dense_weights_and_falling_loss(tmp_path, kept):
    _run(tmp_path, "--devices", "2", "--shards", "2", "--steps", "40", "--epoch-batches", "8", "--staleness", "2", "--lightning-sampler", *kept)
    rank0 = torch.load(tmp_path / "rank0.pt")
    rank1 = torch.load(tmp_path / "rank1.pt")
    # With several processes Lightning's distributed sampler deals every epoch's 8 batches out, 4 to each rank.
    for epoch in range(0, 40, 4):
        shares = rank0["batches"][epoch:epoch + 4], rank1["batches"][epoch:epoch + 4]
        assert sorted(shares[0] + shares[1]) == list(range(8)), f"epoch {epoch // 4}: the ranks trained {shares}"
    for name, value in rank0["dense"].items():  # with t0 kept: its weight and optimizer state too
        assert torch.equal(value, rank1["dense"][name]), f"dense weight {name} differs between ranks"
    losses = rank0["losses"]
    assert sum(losses[-8:]) < sum(losses[:8])
    assert rank0["tables"]["ebc.t1"].abs().sum() > 0
    if kept:
        assert set(rank0["tables"]) == {"ebc.t1"}
        initial = initial_rows(INIT, 0, "ebc.t0", torch.arange(NUM_IDS), 4).flatten()
        assert not torch.allclose(rank0["dense"]["ebc.data_parallel.weight"], initial), "the kept table must train"


@pytest.mark.scenario  # over a minute of processes: CI's scenario step; make test keeps the 2-rank run above
@pytest.mark.parametrize("merge", [True, False], ids=["merged", "per-rank"])
def test_two_ranks_train_the_tables_as_one_rank_when_their_gradients_are_merged(tmp_path, merge):
    # Both ranks train on the same batches here (no distributed sampler), so with merged gradients 2 ranks
    # take exactly the steps of 1 rank. Per rank, row-wise Adagrad takes two half steps where 1 rank takes
    # one, and lands elsewhere.
    common = ("--shards", "2", "--steps", "12", "--staleness", "0", "--adagrad")
    _run(tmp_path / "one", "--devices", "1", *common)
    _run(tmp_path / "two", "--devices", "2", *common, *(() if merge else ("--no-merge",)))
    one = torch.load(tmp_path / "one" / "rank0.pt")
    two = torch.load(tmp_path / "two" / "rank0.pt")
    gap = max(float((two["tables"][t] - rows).abs().max()) for t, rows in one["tables"].items())
    if merge:
        assert gap < 1e-5, f"2 merged ranks moved the tables {gap} away from 1 rank"
        for name, value in one["dense"].items():
            torch.testing.assert_close(two["dense"][name], value, rtol=0, atol=1e-5)
    else:
        assert gap > 1e-2, "per-rank updates are two Adagrad steps: the tables must differ from 1 rank's"


@pytest.mark.scenario  # minutes of processes: CI's scenario step (`make scenarios`), not `make test`
@pytest.mark.parametrize("kept", [(), KEEP_T0], ids=["all-remote", "t0-kept"])
def test_resume_after_restart_gives_the_same_weights_as_one_run(tmp_path, kept):
    n = RESUME_STEPS
    common = ("--devices", "1", "--staleness", "0", "--epoch-batches", str(n), *kept)
    _run(tmp_path / "straight", *common, "--steps", str(2 * n))
    _run(tmp_path / "first", *common, "--steps", str(n), "--checkpoint-every", str(n))
    (ckpt,) = (tmp_path / "first" / "ckpt").glob("*.ckpt")
    assert ckpt.with_name(ckpt.name + ".ps").is_dir(), "the PS state is saved beside the checkpoint"
    _run(tmp_path / "second", *common, "--steps", str(2 * n), "--resume", str(ckpt), "--shards", "3")  # another shard count
    straight = torch.load(tmp_path / "straight" / "rank0.pt")
    resumed = torch.load(tmp_path / "second" / "rank0.pt")
    for name, value in straight["dense"].items():
        torch.testing.assert_close(resumed["dense"][name], value, rtol=0, atol=1e-5)
    for table, rows in straight["tables"].items():
        torch.testing.assert_close(resumed["tables"][table], rows, rtol=0, atol=1e-5)


@pytest.mark.scenario  # half a minute of processes or more: CI's scenario step (`make scenarios`), not `make test`
def test_model_checkpoint_keeps_ps_files_only_for_kept_checkpoints(tmp_path):
    _run(tmp_path, "--devices", "1", "--steps", "12", "--checkpoint-every", "3")
    kept = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert len([k for k in kept if k.endswith(".ckpt")]) == 1, kept
    assert [k for k in kept if k.endswith(".ps")] == [k + ".ps" for k in kept if k.endswith(".ckpt")], kept


@pytest.mark.scenario  # half a minute of processes or more: CI's scenario step (`make scenarios`), not `make test`
def test_ctrl_c_stops_training_and_leaves_no_process_behind(tmp_path):
    process = subprocess.Popen(
        [sys.executable, str(SCRIPT), "--out", str(tmp_path), "--devices", "2", "--steps", "400", "--epoch-batches", "8", "--slow-after", "3"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 180
        while not (tmp_path / "started").exists():
            assert process.poll() is None, process.stdout.read().decode()[-3000:]
            assert time.monotonic() < deadline, "training never started"
            time.sleep(0.2)
        assert _children_of(process.pid), "the embedded shards should be running"
        os.killpg(process.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
        process.wait(timeout=60)
        deadline = time.monotonic() + 30
        while _group(process.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _group(process.pid) == [], "processes of the run (ranks or shards) still alive after Ctrl-C"
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            pytest.fail("the run did not stop on Ctrl-C")
