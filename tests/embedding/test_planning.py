"""Planning a collection's lookup: its ids counted per table and deduplicated as TorchRec's KJT and keyed_unique say."""
from __future__ import annotations

import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from lightning_persia.embedding.planning import CollectionPlanner
from lightning_persia.ops.dedup import keyed_unique
from lightning_persia.ops.keyed_ids import KeyedIds


@pytest.mark.parametrize("batch,with_offsets", [(5, False), (5, True), (0, False)])
def test_a_collections_plan_counts_its_ids_per_table_like_torchrec(batch, with_offsets):
    generator = torch.Generator().manual_seed(batch)
    features = ["f0", "f1", "f2"]
    lengths = torch.randint(0, 4, (len(features) * batch,), generator=generator)
    values = torch.randint(0, 20, (int(lengths.sum()),), generator=generator)
    kjt = KeyedJaggedTensor(keys=features, values=values, lengths=lengths)
    if with_offsets:  # a batch made with its offsets, not its lengths
        kjt = KeyedJaggedTensor(keys=features, values=values, offsets=kjt.offsets())
    planner = CollectionPlanner("ebc", ("t0", "t1"), (4, 8), tuple(features), (0, 0, 1))
    plan = planner.plan(kjt)
    per_key = KeyedJaggedTensor(keys=features, values=values, lengths=lengths).length_per_key()  # TorchRec's own count
    counts = (per_key[0] + per_key[1], per_key[2])
    assert plan.id_counts == counts
    unique, inverse = keyed_unique(KeyedIds(("t0", "t1"), counts, values))
    assert plan.unique.counts == unique.counts and torch.equal(plan.unique.ids, unique.ids) and torch.equal(plan.inverse, inverse)
