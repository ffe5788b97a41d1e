"""The randomised mode of tools/fault_scenarios.py, made deterministic and small: two runs of the DLRM
example through ``lightning-persia fit`` (real shards, real signals), each with its fault at a fixed phase.

The 50-run campaign is in docs/reliability.md (``fault_scenarios.py --random 50``)."""
from __future__ import annotations

import pytest

from tools.fault_scenarios import Fault, fit_once

pytestmark = pytest.mark.scenario  # minutes of processes: CI's scenario step (`make scenarios`), not `make test`


def test_a_shard_killed_in_a_checkpoint_save_and_another_in_the_rollback_and_the_run_finishes(tmp_path):
    """1 rank: shard 1 SIGKILLed as the checkpoint of step 20 begins (that of step 10 is committed), shard 0 as
    soon as the rollback that follows begins: the run rolls back once per failure it meets, saves, finishes and
    reports its AUC."""
    fault = Fault("kill", shard=1, at_s=0.0, after_mark="save 20", again_in_rollback=0, again_after_s=0.0)
    outcome = fit_once(tmp_path / "kill", ranks=1, train_batches=30, fault=fault, timeout=240)
    assert outcome.status == 0 and outcome.auc is not None and 0.5 < outcome.auc < 1.0, outcome.log[-4000:]
    assert outcome.phase == "save", outcome.phase
    # the second kill lands as soon as the rollback's first line is read: inside it, or just after it ended
    assert outcome.second_phase is not None and not outcome.second_phase.startswith("("), outcome.second_phase
    assert len(outcome.rollbacks) >= 1 and all(r["step"] >= 20 for r in outcome.rollbacks), outcome.rollbacks


def test_a_shard_paused_longer_than_ps_timeout_in_validation_costs_a_pause_not_the_run(tmp_path):
    """2 ranks: shard 0 SIGSTOPped for 2x ps.timeout_s as the validation after step 6 begins, then SIGCONT: the
    calls that timed out are retried until it answers; no rollback, the run finishes."""
    fault = Fault("stop", shard=0, at_s=0.0, stop_s=4.0, after_mark="validation 6")
    outcome = fit_once(tmp_path / "stop", ranks=2, train_batches=24, fault=fault, timeout=240)
    assert outcome.status == 0 and outcome.auc is not None and 0.5 < outcome.auc < 1.0, outcome.log[-4000:]
    assert outcome.phase == "validation" and outcome.rollbacks == [], (outcome.phase, outcome.rollbacks)
