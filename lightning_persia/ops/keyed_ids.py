"""Several tables' ids (and rows) in one tensor: the shape every step's ids take from the trainer to the shards.

A step reads many tables. Handled one table at a time, every stage (dedup, bucketing by shard, encoding,
decoding, gradients) costs a few Python calls per table; kept in one tensor, each stage is a handful of
vectorised ops whatever the number of tables. :class:`KeyedIds` holds ``counts[t]`` ids of ``tables[t]``, one
table after another; the rows of those ids are one flat float tensor in the same order, a row of table ``t``
taking ``dims[t]`` values. :class:`RowLayout` cuts it into blocks of consecutive tables of one width, each a
``[rows, dim]`` view (one block when every table has the same width).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import torch


@dataclass(frozen=True)
class KeyedIds:
    """``counts[t]`` int64 ids of table ``tables[t]``, one table after another, in ``ids``.

    Example::

        keyed = KeyedIds.from_dict({"user": torch.tensor([3, 7]), "item": torch.tensor([5])})
        keyed.tables, keyed.counts, keyed.ids   # ('user', 'item'), (2, 1), tensor([3, 7, 5])
    """

    tables: tuple[str, ...]
    counts: tuple[int, ...]
    ids: torch.Tensor

    def __post_init__(self) -> None:
        if len(self.tables) != len(self.counts):
            raise ValueError(f"KeyedIds: {len(self.tables)} tables but {len(self.counts)} counts")
        if len(set(self.tables)) != len(self.tables):
            raise ValueError(f"KeyedIds: a table appears more than once in {list(self.tables)}")
        if not isinstance(self.ids, torch.Tensor) or self.ids.dim() != 1 or self.ids.dtype != torch.int64:
            got = f"{self.ids.dtype} {tuple(self.ids.shape)}" if isinstance(self.ids, torch.Tensor) else type(self.ids).__name__
            raise ValueError(f"KeyedIds: ids must be a 1-d int64 tensor, got {got}")
        if sum(self.counts) != self.ids.numel() or min(self.counts, default=0) < 0:
            raise ValueError(f"KeyedIds: counts {list(self.counts)} do not add up to the {self.ids.numel()} ids")

    @classmethod
    def from_dict(cls, ids: Mapping[str, torch.Tensor]) -> "KeyedIds":
        """One tensor of ``{table: 1-d int64 (or int32) ids}`` (on the CPU), tables in the mapping's order."""
        for name, table_ids in ids.items():
            if not isinstance(table_ids, torch.Tensor) or table_ids.dim() != 1 or table_ids.dtype not in (torch.int64, torch.int32):
                got = f"{table_ids.dtype} {tuple(table_ids.shape)}" if isinstance(table_ids, torch.Tensor) else type(table_ids).__name__
                raise ValueError(f"table {name!r}: ids must be a 1-d int64 tensor, got {got}")
        parts = [t.to(device="cpu", dtype=torch.int64) for t in ids.values()]
        flat = torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)
        return cls(tuple(ids), tuple(p.numel() for p in parts), flat)

    @classmethod
    def concat(cls, parts: Sequence["KeyedIds"]) -> "KeyedIds":
        """The tables of ``parts`` one after another (each table in one part only)."""
        if len(parts) == 1:
            return parts[0]
        ids = torch.cat([p.ids for p in parts]) if parts else torch.empty(0, dtype=torch.int64)
        return cls(tuple(t for p in parts for t in p.tables), tuple(c for p in parts for c in p.counts), ids)

    @property
    def table_of_ids(self) -> torch.Tensor:
        """Index of each id's table (int64 ``[n]``)."""
        return torch.repeat_interleave(torch.arange(len(self.tables)), torch.tensor(self.counts, dtype=torch.int64), output_size=self.ids.numel())


@dataclass(frozen=True)
class Block:
    """Consecutive tables ``[first_table, end_table)`` of width ``dim``: rows ``[first_row, end_row)``, values from ``offset``."""

    first_table: int
    end_table: int
    dim: int
    first_row: int
    end_row: int
    offset: int

    @property
    def rows(self) -> int:
        return self.end_row - self.first_row

    def of(self, flat: torch.Tensor) -> torch.Tensor:
        """This block of ``flat`` as ``[rows, dim]`` (a view)."""
        return flat[self.offset : self.offset + self.rows * self.dim].view(self.rows, self.dim)


class RowLayout:
    """Where the rows of ``counts[t]`` ids of tables of width ``dims[t]`` sit in one flat tensor, table after table.

    Example::

        layout = RowLayout(counts=[2, 1, 4], dims=[16, 16, 8])
        layout.numel, [(b.dim, b.rows) for b in layout.blocks]   # 80, [(16, 3), (8, 4)]
    """

    def __init__(self, counts: Sequence[int], dims: Sequence[int]) -> None:
        if len(counts) != len(dims):
            raise ValueError(f"RowLayout: {len(counts)} counts but {len(dims)} dims")
        self.counts = tuple(int(c) for c in counts)
        self.dims = tuple(int(d) for d in dims)
        blocks: list[Block] = []
        row = offset = 0
        for table, (count, dim) in enumerate(zip(self.counts, self.dims)):
            if blocks and blocks[-1].dim == dim:
                last = blocks[-1]
                blocks[-1] = Block(last.first_table, table + 1, dim, last.first_row, row + count, last.offset)
            else:
                blocks.append(Block(table, table + 1, dim, row, row + count, offset))
            row += count
            offset += count * dim
        self.blocks = tuple(blocks)
        self.rows = row
        self.numel = offset

    def table_offsets(self) -> list[int]:
        """Offset in the flat tensor where each table's rows start (and the total at the end)."""
        out = [0]
        for count, dim in zip(self.counts, self.dims):
            out.append(out[-1] + count * dim)
        return out

    def block_counts(self, counts: Sequence[int]) -> list[int]:
        """``counts`` (one per table) summed per block."""
        return [sum(counts[b.first_table : b.end_table]) for b in self.blocks]
