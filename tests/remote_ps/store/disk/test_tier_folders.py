"""A shard's disk folder: claimed by one process at a time, and what earlier incarnations left there reclaimed."""
import os
import subprocess
import sys

import pytest
import torch

from lightning_persia.remote_ps.store import ShardStore
from lightning_persia.remote_ps.store.disk import tier_folders
from lightning_persia.remote_ps.table_config import TableConfig

pytestmark = pytest.mark.usefixtures("disk_tier_kernels")


def test_the_tiers_that_killed_incarnations_left_are_reclaimed_and_a_repeated_pid_finds_no_old_folder(tmp_path):
    folder = tier_folders.shard_folder(tmp_path, 0, 1)
    for name in ("t.4242.0", "t.4242.1", f"t.{os.getpid()}.0"):  # the last: a shard that had this pid (PID 1 in a pod)
        (folder / name).mkdir(parents=True)
        (folder / name / "segment-000000.rows").write_bytes(b"\0" * 4096)
    store = ShardStore(0, 1, disk_dir=str(tmp_path), demotion_interval_s=None)
    store.configure(TableConfig("t", 4, storage="disk", capacity=64))
    for start in range(0, 512, 64):  # demotions write segments from the first number on
        store.lookup("t", torch.arange(start, start + 64), train=True)
    assert store.stats()["t"]["disk_rows"] == 448
    (tier,) = [entry for entry in folder.iterdir() if entry.is_dir()]
    assert tier.name.startswith("t.") and tier.name != f"t.{os.getpid()}.0"
    assert (tier / "segment-000000.rows").stat().st_size > 0


def test_a_folder_in_use_by_a_live_shard_process_is_refused_naming_it(tmp_path):
    store = ShardStore(0, 2, disk_dir=str(tmp_path), demotion_interval_s=None)
    store.configure(TableConfig("t", 4, storage="disk", capacity=64))
    claim = ("import sys; from pathlib import Path; from lightning_persia.remote_ps.store.disk import tier_folders\n"
             "try:\n    tier_folders.claim(Path(sys.argv[1]))\nexcept Exception as err:\n    print(err)\n")
    folder = tier_folders.shard_folder(tmp_path, 0, 2)
    done = subprocess.run([sys.executable, "-c", claim, str(folder)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert f"the disk folder {folder} is in use by another shard process" in done.stdout
    assert len([entry for entry in folder.iterdir() if entry.is_dir()]) == 1  # the live shard's tier, untouched
