"""Shard maps as they travel (``persia.proto``'s ShardMapMessage), for the shards and the clients alike."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from lightning_persia.ops.shard_map import ShardMap
from lightning_persia.remote_ps.protocol import persia_pb2


def map_message(shard_map: ShardMap, addresses: Sequence[str] = ()) -> persia_pb2.ShardMapMessage:
    return persia_pb2.ShardMapMessage(version=shard_map.version, owners=np.asarray(shard_map.owners, dtype="<i2").tobytes(),
                                      addresses=list(addresses))


def map_of(message: persia_pb2.ShardMapMessage) -> tuple[ShardMap, list[str]]:
    """``(map, addresses)`` of a message; raises ``ValueError`` naming the problem when it is not a valid map."""
    if len(message.owners) % 2:
        raise ValueError(f"a shard map's owners are int16: {len(message.owners)} bytes is not a whole number of them")
    owners = np.frombuffer(message.owners, dtype="<i2")
    return ShardMap(tuple(int(o) for o in owners), int(message.version)), list(message.addresses)
