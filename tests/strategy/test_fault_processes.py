"""Faults of trainer processes (each run a subprocess of run_faults.py; the DDP launcher re-runs it):
rank 0 SIGKILLed in the middle of a checkpoint save. The job fails cleanly (every rank and shard gone, no
hang), the previous checkpoint pair is intact, the half-written one never replaces it, and the run resumes.
The other scenarios (rank 1 killed, a shard killed under 2-rank DDP) run in ``tools/fault_scenarios.py``."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lightning_persia.remote_ps.protocol import COMMIT_MARKER
from lightning_persia.remote_ps.store import ShardStore
from lightning_persia.remote_ps.store.checkpoint import candidate_checkpoints

SCRIPT = Path(__file__).with_name("run_faults.py")


def _live(pgid: int) -> list[str]:
    listing = subprocess.run(["ps", "-o", "stat=,cmd=", "-g", str(pgid)], capture_output=True, text=True).stdout
    return [line for line in listing.splitlines() if line.strip() and not line.strip().startswith("Z")]


@pytest.mark.scenario  # minutes of processes: CI's scenario step (`make scenarios`), not `make test`
def test_rank_killed_in_the_middle_of_a_save_fails_cleanly_and_the_run_resumes(tmp_path):
    log = tmp_path / "log.txt"
    with open(log, "w") as out:
        process = subprocess.Popen(
            [sys.executable, str(SCRIPT), "--out", str(tmp_path), "--devices", "2", "--shards", "1", "--steps", "12",
             "--checkpoint-every", "4", "--kill-in-save", "2", "--save-delay", "0.3"],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        assert process.wait(timeout=240) == -9, log.read_text()[-3000:]
        killed = time.monotonic()
        while _live(process.pid) and time.monotonic() - killed < 60:
            time.sleep(0.2)
        assert _live(process.pid) == [], "a rank or a shard of the killed run is still alive (hang)"
    finally:
        if process.poll() is None:
            process.kill()
    gone_after = time.monotonic() - killed
    text = log.read_text()
    assert "KILL rank 0" in text and "Connection closed by peer" in text  # rank 1 failed, did not wait

    ckpt = tmp_path / "ckpt"
    assert sorted(p.name for p in ckpt.glob("*.ckpt")) == ["epoch=0-step=4.ckpt"]  # step 8's never written
    entry = torch.load(ckpt / "epoch=0-step=4.ckpt", weights_only=True)["persia"]
    good = ckpt / entry["ps_dir"]
    assert (good / COMMIT_MARKER).is_file()
    store = ShardStore(0, 1)
    store.load(str(good))  # complete, checksums verified
    assert sorted(store.tables()) == ["ebc.t0", "ebc.t1"]
    assert candidate_checkpoints(ckpt) == [good]  # a shard told --restore-from ckpt/ would load this one

    result = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path), "--devices", "1", "--shards", "1",
                             "--steps", "12", "--checkpoint-every", "4", "--resume", "latest"],
                            capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"RESUME {ckpt / 'epoch=0-step=4.ckpt'}" in result.stdout
    state = torch.load(tmp_path / "rank0.pt", weights_only=False)
    assert state["global_step"] == 12 and len(state["losses"]) == 8 and state["rollbacks"] == []
    print(json.dumps({"processes_gone_after_s": round(gone_after, 1)}))
