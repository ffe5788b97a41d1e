"""benchmarks/wal/wal_bench.py: the lag figures read from a trainer's histograms, the AUC comparison of runs with kills
against uninterrupted ones, and the summary of several pairs of runs (the --json last line keeps every key)."""
from __future__ import annotations

import argparse
import json

import pytest
from prometheus_client import generate_latest

from benchmarks.wal import wal_bench
from benchmarks.wal.compare import auc_figures
from benchmarks.wal.lag import lag_figures, mean_lag
from lightning_persia.strategy.metrics import TrainerMetrics


def test_the_lag_figures_are_the_means_and_counts_of_the_trainers_histograms():
    metrics = TrainerMetrics("127.0.0.1", 0, lambda: {}, {"global_rank": "0"})
    try:
        for issued, answered in ((4, 4), (4, 2), (3, 3), (0, 0), (9, 5)):
            metrics.observe_step({"staleness": issued, "staleness_at_answer": answered})
        figures = lag_figures(generate_latest(metrics.registry).decode())
    finally:
        metrics.stop()
    assert figures["at_issue"] == {"mean": 4.0, "steps": 5, "counts": {"0": 1, "3": 1, "4": 2, "12": 1}}  # 9 in (8, 12]
    assert figures["at_answer"] == {"mean": 2.8, "steps": 5, "counts": {"0": 1, "2": 1, "3": 1, "4": 1, "6": 1}}


def test_lag_figures_of_metrics_without_the_histograms_say_what_is_missing():
    with pytest.raises(ValueError, match="no histogram 'persia_trainer_embedding_lag_steps'.*MetricsEndpoint"):
        lag_figures("# HELP up Up.\n# TYPE up gauge\nup 1.0\n")


def test_the_mean_lag_of_several_runs_weighs_each_by_its_steps():
    runs = [{"at_issue": {"mean": 2.0, "steps": 100}}, {"at_issue": {"mean": 4.0, "steps": 300}}]
    assert mean_lag(runs, "at_issue") == 3.5
    assert mean_lag([], "at_issue") == 0.0


def test_auc_figures_compare_the_means_and_give_each_sides_spread():
    figures = auc_figures([0.7170, 0.7160], [0.7150, 0.7142, 0.7146])
    assert figures["test_auc"] == 0.7165 and figures["reference_test_auc"] == 0.7146
    assert figures["auc_gap"] == 0.0019 and figures["auc_diff"] == 0.0019
    assert figures["auc_spread"] == 0.001 and figures["reference_auc_spread"] == 0.0008
    assert figures["auc_gap_se"] == pytest.approx((0.0010 ** 2 / 2 / 2 + 0.0004 ** 2 / 3) ** 0.5, abs=1e-6)  # variances 5e-7, 1.6e-7
    assert auc_figures([0.70], [0.71, 0.72])["auc_gap_se"] is None
    assert auc_figures([0.70], [0.71])["auc_gap"] == -0.01 and auc_figures([0.70], [0.71])["auc_diff"] == 0.01
    with pytest.raises(ValueError, match="both sides"):
        auc_figures([], [0.71])


def _pair(auc: float, reference_auc: float, kills: list, lag: float, reference_lag: float) -> dict:
    def result(test_auc: float, mean: float) -> dict:
        figures = {"mean": mean, "steps": 400, "counts": {}}
        return {"test_auc": test_auc, "rollbacks": 0, "global_step": 400, "lag": {"at_issue": figures, "at_answer": figures}}

    return {"finished": True, "found": [], "kills": kills, "replays": [0.5, 1.25], "duplicates": 2,
            "result": result(auc, lag), "reference": result(reference_auc, reference_lag), "seconds": 120.0, "reference_seconds": 40.0}


def test_the_summary_of_pairs_keeps_the_issues_keys_and_adds_the_aucs_and_lags():
    args = argparse.Namespace(staleness=4, durability="log")
    pairs = [_pair(0.7163, 0.7160, [("save", 0, "save"), ("train", 1, "forward 12")], 3.3, 3.1),
             _pair(0.7159, 0.7162, [("replay", 1, "replay")], 3.2, 3.1)]
    summary = wal_bench._summary(pairs, args, (4.0, 5.0))
    assert summary["kills"] == 3 and summary["rollbacks"] == 0 and summary["replays"] == 4 and summary["max_replay_s"] == 1.25
    assert summary["weights_equal"] is None and summary["between_write_and_ack"] == 4
    assert summary["landed"] == {"save": 1, "forward": 1, "replay": 1}
    assert summary["test_aucs"] == [0.7163, 0.7159] and summary["auc_gap"] == 0.0 and summary["auc_diff"] == 0.0
    assert summary["lag"] == {"kills": {"at_issue": 3.25, "at_answer": 3.25}, "reference": {"at_issue": 3.1, "at_answer": 3.1}}
    json.dumps(summary)  # the last line of --json


def test_the_summary_of_an_unfinished_pair_has_no_auc_to_compare():
    pair = dict(_pair(0.7, 0.7, [], 3.0, 3.0), finished=False, found=["a run did not finish"])
    summary = wal_bench._summary([pair], argparse.Namespace(staleness=0, durability="log"), (1.0, 1.0))
    assert summary["rollbacks"] is None and summary["auc_diff"] is None and summary["weights_equal"] is False
    assert "lag" not in summary
