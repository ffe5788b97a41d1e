"""What the tests of a shard's log share: training a store, and its rows read back from a checkpoint."""
import torch

from lightning_persia.ops.shard_map import ShardMap
from lightning_persia.remote_ps.store import checkpoint


def train(store, steps, *, client="c", first_seq=1, tables=("a", "b"), seed=0):
    """τ=0 steps: a training lookup of random ids in every table, then one update of them all."""
    generator = torch.Generator().manual_seed(seed)
    for step in range(steps):
        ids = {name: torch.randint(0, 400, (64,), generator=generator).unique() for name in tables}
        store.lookup_many(list(ids.items()), train=True)
        grads = [(name, table_ids, torch.randn(table_ids.numel(), store.describe(name).dim, generator=generator))
                 for name, table_ids in ids.items()]
        store.update_many(grads, client=client, seq=first_seq + step)


def contents(store, folder) -> dict:
    """Every table's rows sorted by id, read back from a checkpoint of the store."""
    store.save(str(folder))
    out = {}
    for source in checkpoint.open_for_shard(str(folder), 0, ShardMap.uniform(1)):
        blocks = [{k: v.clone() for k, v in block.items()} for block in source.blocks(0, ShardMap.uniform(1))]
        rows = {k: torch.cat([b[k] for b in blocks]) for k in blocks[0]}
        order = torch.argsort(rows["ids"])
        out[source.name] = ({k: v[order] for k, v in rows.items()}, source.step)
    return out


def assert_same(left: dict, right: dict) -> None:
    assert left.keys() == right.keys()
    for name in left:
        (rows, step), (other, other_step) = left[name], right[name]
        assert step == other_step, name
        assert rows.keys() == other.keys()
        for field in rows:
            assert torch.equal(rows[field], other[field]), (name, field)
