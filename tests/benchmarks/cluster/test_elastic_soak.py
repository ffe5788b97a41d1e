"""benchmarks/cluster/elastic_soak.py (``elastic_bench.py --kill-soak``): a short soak keeps every acknowledged update,
ends every move on its new map, and ends with the weights of the unscaled replay."""
from __future__ import annotations

import pytest

from benchmarks.cluster import elastic_soak


def test_the_summary_carries_the_issues_fields_and_each_kill():
    report = elastic_soak.SoakReport(moves=[elastic_soak.Move(3, "taker", "fence", killed=True, ended_on_new_map=True)],
                                     kills=1, weights_equal=True)
    summary = elastic_soak.summary(report)
    assert {key: summary[key] for key in ("kills", "lost_updates", "rollbacks", "weights_equal")} == {
        "kills": 1, "lost_updates": 0, "rollbacks": 0, "weights_equal": True}
    assert summary["kill_points"][0]["victim"] == "taker" and summary["kill_points"][0]["step"] == "fence"


@pytest.mark.parametrize("rerun, given_up", [
    ({"map_version": 9, "waves": 7}, True),   # began from version 2, the map before the killed third wave (3): it moved it again
    ({"map_version": 9, "waves": 6}, False),  # began from version 3: the killed wave had gone through
    ({"map_version": 3, "waves": 0}, False),  # the killed wave was the last, and it had gone through: nothing left
])
def test_a_killed_wave_counts_as_given_up_only_when_the_next_run_began_before_it(rerun, given_up):
    assert elastic_soak.killed_wave_given_up(rerun, version=0, wave=3) is given_up


@pytest.mark.scenario
def test_a_short_kill_soak_loses_nothing_and_ends_every_move_on_its_new_map():
    report = elastic_soak.soak(4, rows=20_000, batch=1024, dim=8, seed=1)
    assert report.kills == 4 and {move.victim for move in report.moves} == set(elastic_soak.VICTIMS)
    assert (report.lost_updates, report.applied_twice, report.rollbacks) == (0, 0, 0)
    assert report.weights_equal and report.steps > 0
