"""Where an id lives: a fixed hash picks one of :data:`SLOTS` slots, and a versioned map assigns slots to shards.

With ``hash % num_shards`` a shard added to ``n`` moves about ``n / (n + 1)`` of all rows; with slots it moves the
slots it takes over, about ``1 / (n + 1)`` of them (:meth:`ShardMap.resized`). Every process that routes ids (the
trainer's bucketing, a shard's ownership check, a checkpoint's re-sharding) routes through the same map, and the
version says which map a request or a checkpoint was made under.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

import torch

from lightning_persia.ops import native
from lightning_persia.ops.hashing import slot_of
from lightning_persia.ops.native import ids as native_ids

SLOTS = 4096
"""Slots ids hash into (a power of two: the C kernels mask instead of dividing). Thousands, so that a shard count
up to a few hundred gets an even share, and few enough that a map travels in one small message."""


@dataclass(frozen=True)
class ShardMap:
    """Owner shard of each of the :data:`SLOTS` slots, and the map's version (higher is newer).

    ``ShardMap.uniform(n)`` is the map a cluster of ``n`` shards starts with (slot ``s`` on shard ``s % n``);
    :meth:`resized` derives the map of another shard count that moves the fewest slots.

    Example::

        before = ShardMap.uniform(2)
        after = before.resized(3)          # version 1; a third of the slots move to shard 2
        owners = after.shard_of(torch.tensor([3, 7, 11]))
    """

    owners: tuple[int, ...]
    version: int = 0
    _table: torch.Tensor = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if len(self.owners) != SLOTS:
            raise ValueError(f"a shard map names the owner of each of {SLOTS} slots, got {len(self.owners)}")
        if self.version < 0:
            raise ValueError(f"a shard map's version must be >= 0, got {self.version}")
        if min(self.owners) < 0:
            raise ValueError(f"a shard map's owners must be shard indices >= 0, got {min(self.owners)}")
        missing = sorted(set(range(max(self.owners) + 1)) - set(self.owners))
        if missing:
            raise ValueError(f"a shard map must give every shard up to its highest a slot; shards {missing} own none")
        object.__setattr__(self, "_table", torch.tensor(self.owners, dtype=torch.int64))

    @classmethod
    def uniform(cls, num_shards: int, version: int = 0) -> "ShardMap":
        """The map of a cluster started with ``num_shards`` shards: slot ``s`` on shard ``s % num_shards``."""
        return _uniform(num_shards, version)

    @property
    def num_shards(self) -> int:
        return max(self.owners) + 1

    @property
    def table(self) -> torch.Tensor:
        """The owners as an int64 tensor of :data:`SLOTS` (what the kernels index)."""
        return self._table

    def shard_of(self, ids: torch.Tensor) -> torch.Tensor:
        """Owner shard of each id (int64, same shape)."""
        return self._table[slot_of(ids, SLOTS)]

    def first_foreign(self, ids: torch.Tensor, shard: int) -> int:
        """Position of the first of ``ids`` that ``shard`` does not own, or -1 when it owns them all."""
        if native.available() and ids.device.type == "cpu":
            return native_ids.first_foreign(ids, self._table, shard)
        foreign = torch.nonzero(self.shard_of(ids) != shard)
        return int(foreign[0, 0]) if foreign.numel() else -1

    def slots_of(self, shard: int) -> list[int]:
        return [s for s, owner in enumerate(self.owners) if owner == shard]

    def moves(self, other: "ShardMap") -> dict[int, tuple[int, int]]:
        """``{slot: (owner here, owner in other)}`` of every slot whose owner differs."""
        return {s: (a, b) for s, (a, b) in enumerate(zip(self.owners, other.owners)) if a != b}

    def resized(self, num_shards: int) -> "ShardMap":
        """The next version's map for ``num_shards`` shards that moves the fewest slots from this one.

        Growing, each new shard takes slots from the shards that own the most; shrinking, the shards above
        ``num_shards`` hand theirs to the shards that own the fewest. Either way every shard ends with
        ``SLOTS // num_shards`` or one more slot, so about ``|n - m| / max(n, m)`` of the rows move.
        """
        if num_shards < 1:
            raise ValueError(f"num_shards must be >= 1, got {num_shards}")
        if num_shards > SLOTS:
            raise ValueError(f"at most {SLOTS} shards (one slot each), got {num_shards}")
        owners = list(self.owners)
        held: dict[int, list[int]] = {shard: [] for shard in range(num_shards)}
        homeless: list[int] = []
        for slot, owner in enumerate(owners):
            (held[owner] if owner < num_shards else homeless).append(slot)
        low, extra = divmod(SLOTS, num_shards)
        # the shards that keep one slot more than the others are the ones holding most now: fewer moves
        ranked = sorted(held, key=lambda shard: (-len(held[shard]), shard))
        quota = {shard: low + (1 if rank < extra else 0) for rank, shard in enumerate(ranked)}
        for shard in ranked:
            while len(held[shard]) > quota[shard]:
                homeless.append(held[shard].pop())
        homeless.sort()
        for shard in sorted(held):
            while len(held[shard]) < quota[shard]:
                slot = homeless.pop()
                owners[slot] = shard
                held[shard].append(slot)
        return ShardMap(tuple(owners), self.version + 1)

    def waves(self, num_shards: int, wave_slots: int) -> list["ShardMap"]:
        """The maps a move to :meth:`resized` ``(num_shards)`` passes through when each step moves at most
        ``wave_slots`` slots: consecutive versions after this one, the last with ``resized``'s owners (empty when
        nothing moves). Together they move exactly ``resized``'s slots, each once.

        Each map is a complete move of its own, so a step's fenced cut-over carries only its slots' changes. The
        steps take one source's slots at a time (a source reads its rows once per step it gives slots in). A new
        shard gets its first slot in the first step, and a drained shard keeps one until the last: every map but the
        last spans the larger of the two shard counts. ``wave_slots`` below the number of shards added or drained
        makes the first or last steps span fewer.
        """
        if wave_slots < 1:
            raise ValueError(f"wave_slots must be >= 1, got {wave_slots}")
        final = self.resized(num_shards)
        moving = self.moves(final)
        by_source = lambda slot: (moving[slot][0], slot)  # noqa: E731
        first = [min((s for s, (_, now) in moving.items() if now == shard), key=by_source)
                 for shard in range(self.num_shards, num_shards)]
        last = [max(s for s, (was, _) in moving.items() if was == shard) for shard in reversed(range(num_shards, self.num_shards))]
        rest = sorted(set(moving) - set(first) - set(last), key=by_source)
        order = first + rest + last
        owners = list(self.owners)
        maps = []
        for start in range(0, len(order), wave_slots):
            for slot in order[start:start + wave_slots]:
                owners[slot] = final.owners[slot]
            maps.append(ShardMap(tuple(owners), self.version + len(maps) + 1))
        return maps

    def to_dict(self) -> dict:
        """A plain form for checkpoints' manifests and the wire (see :meth:`from_dict`)."""
        return {"version": self.version, "owners": list(self.owners)}

    @classmethod
    def from_dict(cls, value: dict) -> "ShardMap":
        try:
            return cls(tuple(int(o) for o in value["owners"]), int(value["version"]))
        except (KeyError, TypeError) as error:
            raise ValueError(f"not a shard map: {error!r} in {sorted(value) if isinstance(value, dict) else type(value).__name__}") from None


@lru_cache(maxsize=64)
def _uniform(num_shards: int, version: int) -> ShardMap:
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    if num_shards > SLOTS:
        raise ValueError(f"at most {SLOTS} shards (one slot each), got {num_shards}")
    return ShardMap(tuple(s % num_shards for s in range(SLOTS)), version)


def shard_of(ids: torch.Tensor, num_shards: int) -> torch.Tensor:
    """Shard of each id in a cluster of ``num_shards`` shards that never changed its map (:meth:`ShardMap.uniform`)."""
    return _uniform(num_shards, 0).shard_of(ids)
