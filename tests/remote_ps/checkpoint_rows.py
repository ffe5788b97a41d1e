"""Every row a checkpoint holds, memory and disk parts alike, read back for a test to compare stores with."""
from __future__ import annotations

import os

import torch

from lightning_persia.ops.shard_map import ShardMap
from lightning_persia.remote_ps.store import checkpoint
from lightning_persia.remote_ps.store.disk import checkpoint as disk_checkpoint
from lightning_persia.remote_ps.store.disk.records import record_specs
from lightning_persia.remote_ps.store.memory_rows import MemoryRows

COMPARED = ("ids", "weights", "state")
"""The fields two stores that served the same requests hold alike (access values count each shard's own lookups)."""


def saved_rows(*directories: str | os.PathLike, fields=COMPARED) -> dict[str, dict[str, torch.Tensor]]:
    """``{table: {field: values}}`` of every row the checkpoints at ``directories`` hold (any shard count), in the
    order of their ids; asserts no id is held twice."""
    one = ShardMap.uniform(1)
    blocks: dict[str, list[dict[str, torch.Tensor]]] = {}
    for directory in directories:
        for source in checkpoint.open_for_shard(directory, 0, one):
            found = blocks.setdefault(source.name, [])
            found += [{name: block[name].clone() for name in fields} for block in source.blocks(0, one)]
            specs = record_specs(MemoryRows(source.config, 0).field_specs)
            for folder, entry in source.disk_parts():
                found += [{name: block[name] for name in fields} for block in disk_checkpoint.rows(folder, entry, specs, 0, one)]
    tables = {}
    for name, found in blocks.items():
        rows = {field: torch.cat([block[field] for block in found]) for field in fields}
        ids, order = torch.sort(rows["ids"])
        assert torch.unique(ids).numel() == ids.numel(), f"table {name!r}: an id is held twice"
        tables[name] = {field: values[order] for field, values in rows.items()}
    return tables
