"""The evicted ids a serving delta names: logged from a start version, the oldest forgotten past the limit."""
import pytest
import torch

from lightning_persia.remote_ps.store.errors import StoreError
from lightning_persia.remote_ps.store.removal_log import RemovalLog


def _ids(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def test_evictions_after_a_version_are_named():
    log = RemovalLog("t")
    log.add(1, _ids(99))  # before the start: not logged
    log.start(1)
    log.add(2, _ids(1, 2))
    log.add(3, _ids(3))
    assert log.since(1).tolist() == [1, 2, 3]
    assert log.since(2).tolist() == [3]
    assert log.since(3).tolist() == []


def test_a_delta_before_the_log_started_is_refused_naming_the_table():
    log = RemovalLog("clicks")
    with pytest.raises(StoreError, match="'clicks'.*since version 1 are not known"):
        log.since(1)
    log.start(5)
    with pytest.raises(StoreError, match="since version 4"):
        log.since(4)


def test_the_oldest_evictions_are_forgotten_past_the_limit():
    log = RemovalLog("t", limit=3)
    log.start(1)
    log.add(2, _ids(1, 2))
    log.add(3, _ids(3, 4))  # 4 ids > 3: version 2's are forgotten
    assert log.since(2).tolist() == [3, 4]
    with pytest.raises(StoreError):
        log.since(1)
