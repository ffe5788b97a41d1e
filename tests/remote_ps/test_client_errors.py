"""The client's errors survive pickling as themselves (an embedding worker's error reaches its trainer so, and recovery
tells a shard's failure from a defect by its type)."""
from __future__ import annotations

import pickle

import grpc

from lightning_persia.remote_ps.client.errors import PSRequestError, ShardRestartedError, ShardUnavailableError


def test_every_client_error_comes_back_from_pickle_with_its_fields():
    for error in (PSRequestError(1, "h:1", grpc.StatusCode.NOT_FOUND, "no table"),
                  ShardRestartedError(0, "h:0", grpc.StatusCode.ABORTED, "new incarnation"),
                  ShardUnavailableError(2, "h:2", 3, 1.5, "Lookup: UNAVAILABLE")):
        back = pickle.loads(pickle.dumps(error))
        assert type(back) is type(error) and str(back) == str(error) and back.__dict__ == error.__dict__
