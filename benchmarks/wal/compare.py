"""What ``wal_bench.py`` compares between runs with kills and uninterrupted ones: the dense weights and every table
row (values and optimizer state), read back from each run's final PS checkpoint (τ = 0), and the test AUCs (τ > 0)."""
from __future__ import annotations

import math
import statistics
from pathlib import Path

import torch

from lightning_persia.ops.shard_map import ShardMap
from lightning_persia.remote_ps.store import checkpoint

COMPARED_FIELDS = ("ids", "weights", "state")
"""Per row. The access values (LRU step / LFU count) are left out: a lookup retried on a restarted shard counts twice,
which moves the lookup step, not a value (they only order evictions, and these tables never reach capacity)."""


def table_rows(folder: Path) -> dict[str, dict[str, torch.Tensor]]:
    """Every table of the checkpoint at ``folder`` (all shards together), its rows sorted by id."""
    out = {}
    for source in checkpoint.open_for_shard(str(folder), 0, ShardMap.uniform(1)):
        blocks = [{name: block[name].clone() for name in COMPARED_FIELDS} for block in source.blocks(0, ShardMap.uniform(1))]
        rows = {name: torch.cat([b[name] for b in blocks]) for name in COMPARED_FIELDS} if blocks else {}
        order = torch.argsort(rows["ids"]) if rows else None
        out[source.name] = {name: values[order] for name, values in rows.items()}
    return out


def differences(run: Path, reference: Path) -> list[str]:
    """What differs between two runs' results (empty: bit for bit the same weights and rows)."""
    found = []
    dense, expected = torch.load(run / "dense.pt"), torch.load(reference / "dense.pt")
    for name, value in expected.items():
        if name not in dense or not torch.equal(dense[name], value):
            found.append(f"dense {name}: max |diff| {(dense[name] - value).abs().max().item() if name in dense else 'missing'}")
    tables, expected_tables = table_rows(run / "tables"), table_rows(reference / "tables")
    if tables.keys() != expected_tables.keys():
        found.append(f"tables {sorted(tables)} vs {sorted(expected_tables)}")
    for name in expected_tables:
        mine, theirs = tables.get(name, {}), expected_tables[name]
        if mine.get("ids") is None or not torch.equal(mine["ids"], theirs["ids"]):
            found.append(f"table {name}: other ids ({mine['ids'].numel() if 'ids' in mine else 0} vs {theirs['ids'].numel()} rows)")
            continue
        for field in COMPARED_FIELDS[1:]:
            if not torch.equal(mine[field], theirs[field]):
                found.append(f"table {name} {field}: {int((mine[field] != theirs[field]).any(dim=1).sum())} rows differ")
    return found


def auc_figures(with_kills: list[float], uninterrupted: list[float]) -> dict:
    """The test AUCs of runs with kills against uninterrupted runs: each side's mean and spread (max - min), and
    the gap of the means (``auc_gap``, signed: with kills minus uninterrupted; ``auc_diff``, its size) with its
    standard error (``auc_gap_se``, from the two sides' sample variances; None with fewer than 2 runs a side)."""
    if not with_kills or not uninterrupted:
        raise ValueError(f"AUCs of both sides are needed, got {len(with_kills)} with kills and {len(uninterrupted)} uninterrupted")
    mean, reference = statistics.fmean(with_kills), statistics.fmean(uninterrupted)
    se = None
    if len(with_kills) > 1 and len(uninterrupted) > 1:
        se = round(math.sqrt(statistics.variance(with_kills) / len(with_kills) + statistics.variance(uninterrupted) / len(uninterrupted)), 6)
    return {
        "test_auc": round(mean, 6), "reference_test_auc": round(reference, 6),
        "auc_gap": round(mean - reference, 6), "auc_diff": round(abs(mean - reference), 6), "auc_gap_se": se,
        "test_aucs": [round(a, 6) for a in with_kills], "reference_test_aucs": [round(a, 6) for a in uninterrupted],
        "auc_spread": round(max(with_kills) - min(with_kills), 6),
        "reference_auc_spread": round(max(uninterrupted) - min(uninterrupted), 6),
    }
