"""The embedded parameter server: shard processes on the trainer's machine, at a lower priority than the trainer."""
import os

import pytest

from lightning_persia.strategy.local_cluster import EMBEDDED_NICE, LocalCluster


def _nice(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as stat:
        return int(stat.read().rsplit(")", 1)[1].split()[16])  # field 19 of the whole line


@pytest.mark.parametrize("configured", [None, 3])
def test_embedded_shards_run_niced_unless_the_ps_config_says_otherwise(configured, tmp_path):
    config = None
    if configured is not None:
        config = tmp_path / "ps.yaml"
        config.write_text(f"nice: {configured}\n")
    cluster = LocalCluster(1, config_path=None if config is None else str(config))
    try:
        (shard,) = cluster.shards.processes
        expected = EMBEDDED_NICE if configured is None else configured
        assert _nice(shard.pid) == _nice(os.getpid()) + expected
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
