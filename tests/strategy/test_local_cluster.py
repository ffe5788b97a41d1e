"""The embedded parameter server: shard processes on the trainer's machine, at a lower priority than the trainer."""
import os

import pytest

from lightning_persia.strategy.local_cluster import EMBEDDED_NICE, LocalCluster


def _nice(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as stat:
        return int(stat.read().rsplit(")", 1)[1].split()[16])  # field 19 of the whole line


def _policies(pid: int) -> set[int]:
    """The scheduling policy of every thread of process ``pid``."""
    return {os.sched_getscheduler(int(tid)) for tid in os.listdir(f"/proc/{pid}/task")}


@pytest.mark.parametrize("configured", [None, "nice: 3", "scheduling: normal"])
def test_embedded_shards_run_at_idle_priority_unless_the_ps_config_says_otherwise(configured, tmp_path):
    config = None
    if configured is not None:
        config = tmp_path / "ps.yaml"
        config.write_text(f"{configured}\n")
    cluster = LocalCluster(1, config_path=None if config is None else str(config))
    try:
        (shard,) = cluster.shards.processes
        expected_nice = {None: EMBEDDED_NICE, "nice: 3": 3, "scheduling: normal": 0}[configured]
        assert _nice(shard.pid) == _nice(os.getpid()) + expected_nice
        # every thread of a serving shard (gRPC's, the handlers', the watchdogs') runs under the policy
        assert _policies(shard.pid) == {os.SCHED_IDLE if configured is None else os.SCHED_OTHER}
    finally:
        cluster.stop()


def test_a_ps_config_that_cannot_be_read_is_refused_naming_the_file(tmp_path):
    from lightning_persia.remote_ps.config import ConfigError

    broken = tmp_path / "ps.yaml"
    broken.write_text("nice: [unclosed\n")
    with pytest.raises(ConfigError, match="ps.yaml"):
        LocalCluster(1, config_path=str(broken))
    with pytest.raises(ConfigError, match="missing.yaml"):
        LocalCluster(1, config_path=str(tmp_path / "missing.yaml"))


def test_one_move_of_the_embedded_shards_at_a_time():
    cluster = LocalCluster(1)
    try:
        with pytest.raises(ValueError, match="at least one"):
            cluster.start_rescale(0)
        moving = cluster.start_rescale(2)
        with pytest.raises(RuntimeError, match="being rescaled already"):
            cluster.rescale(1)
        with pytest.raises(RuntimeError, match="being rescaled already"):
            cluster.start_rescale(1)
        report = moving.result(timeout=120)
        assert (report.from_shards, report.to_shards) == (1, 2) and len(cluster.addresses) == 2
        assert cluster.rescale(1).to_shards == 1  # the next move, once the first ended
    finally:
        cluster.stop()
