"""``PSSettings`` (``PersiaStrategy(ps=...)``) and ``MetricsEndpoint`` (``PersiaStrategy(metrics=...)``): their checks,
the environment's addresses and token, and the strategy reading them."""
from __future__ import annotations

import pytest

from lightning_persia import MetricsEndpoint, PersiaStrategy, PSSettings
from lightning_persia.remote_ps.protocol import ADDRESSES_ENV, TOKEN_ENV


@pytest.mark.parametrize("kwargs, message", [
    ({"num_local_shards": 0}, r"PSSettings: num_local_shards must be >= 1, got 0"),
    ({"timeout_s": 0.0}, r"PSSettings: timeout_s must be > 0, got 0.0"),
])
def test_bad_settings_are_refused_with_their_name(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PSSettings(**kwargs)


def test_unset_addresses_and_token_come_from_the_environment(monkeypatch):
    monkeypatch.setenv(ADDRESSES_ENV, "ps-0:5000, ps-1:5000,")
    monkeypatch.setenv(TOKEN_ENV, "from-env")
    strategy = PersiaStrategy()
    assert strategy.ps.addresses == ["ps-0:5000", "ps-1:5000"]
    assert (strategy.ps.token, strategy.ps.embedded) == ("from-env", False)
    given = PersiaStrategy(ps=PSSettings(addresses=["a:1"], token="given"))
    assert (given.ps.addresses, given.ps.token) == (["a:1"], "given")


def test_without_addresses_the_shards_are_started_here(monkeypatch):
    monkeypatch.delenv(ADDRESSES_ENV, raising=False)
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    settings = PSSettings(num_local_shards=3).with_environment()
    assert (settings.addresses, settings.token, settings.embedded, settings.num_local_shards) == (None, None, True, 3)


def test_the_metrics_endpoint_serves_rank_r_on_port_plus_r():
    assert [MetricsEndpoint(port=9400).port_of(rank) for rank in (0, 1, 3)] == [9400, 9401, 9403]
    assert MetricsEndpoint(port=0).port_of(2) == 0  # every rank picks a free port
    with pytest.raises(ValueError, match=r"MetricsEndpoint: port must be in \[0, 65535\], got -1"):
        MetricsEndpoint(port=-1)


def test_a_group_of_the_wrong_kind_is_refused_naming_the_class():
    with pytest.raises(TypeError, match=r"PersiaStrategy: ps must be a PSSettings or None, got list"):
        PersiaStrategy(ps=["127.0.0.1:5000"])
    with pytest.raises(TypeError, match=r"PersiaStrategy: metrics must be a MetricsEndpoint or None, got int"):
        PersiaStrategy(metrics=9400)
