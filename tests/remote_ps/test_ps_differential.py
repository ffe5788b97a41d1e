"""The differential test of shards under kills (``differential.py``): a random stream of lookups, updates, new
tables, saves, loads and re-shards against real shard processes killed at random moments, compared bit for bit
with an in-memory model of what they acknowledged. The fast form runs one seed of disk tables under the log; the
scenario step of CI runs every storage and durability; the long form is ``python -m tests.remote_ps.differential
--minutes 60``."""
import pytest

from differential import Scenario, run_scenario

pytestmark = pytest.mark.usefixtures("disk_tier_kernels")


def _check(scenario: Scenario, tmp_path) -> None:
    report = run_scenario(scenario, tmp_path)
    print(report.line())
    assert report.kills >= 1 and report.restarts >= 1 and report.saves >= 1
    assert report.answers_compared > 0 and report.rows_compared > 0
    assert report.rollbacks == 0 and report.differences == []


def test_disk_tables_under_the_log_match_the_model_through_kills_saves_loads_and_reshards(tmp_path):
    _check(Scenario(seed=4, storage="disk", durability="log", ops=70, kill_every_s=2.0), tmp_path)


@pytest.mark.scenario
@pytest.mark.parametrize("storage,durability", [("disk", "log"), ("disk", "fsync"), ("memory", "log"), ("memory", "fsync")])
def test_every_storage_and_durability_matches_the_model_over_a_longer_stream(tmp_path, storage, durability):
    _check(Scenario(seed=100 + len(storage) + len(durability), storage=storage, durability=durability, ops=200,
                    kill_every_s=3.0), tmp_path)
