"""A disk table's operation never demotes the rows it is itself working on: a replayed upsert, an update that brings
some of its rows back from disk, and a lookup that admits and promotes, each keep every row they name."""
import pytest
import torch

from lightning_persia.remote_ps.store.table import Table
from lightning_persia.remote_ps.store.wal.changes import TableChange
from lightning_persia.remote_ps.table_config import SGD, Adagrad, Constant, TableConfig

pytestmark = pytest.mark.usefixtures("disk_tier_kernels")

DIM = 4


def _table(tmp_path, capacity=8, optimizer=None, name="t"):
    config = TableConfig(name, DIM, optimizer=optimizer or SGD(lr=1.0), capacity=capacity, storage="disk",
                         init=Constant(0.0))
    return Table(config, seed=0, disk_dir=str(tmp_path / name))


def _rows(ids, values):
    n = ids.numel()
    return {"ids": ids, "weights": values.reshape(n, 1).expand(n, DIM).to(torch.float32).contiguous(),
            "access": torch.arange(n, dtype=torch.int32)}  # the first ids the coldest


def test_a_replayed_upsert_that_needs_room_keeps_the_rows_it_replaces(tmp_path):
    table = _table(tmp_path)
    with table.lock:
        table.upsert_locked(_rows(torch.arange(8), torch.arange(8.0)))
        # ids 0 and 1 are present and the coldest: the room for 200 and 201 must come from the others
        table.upsert_locked(_rows(torch.tensor([0, 1, 200, 201]), torch.tensor([100.0, 101.0, 200.0, 201.0])))
    got = table.lookup(torch.tensor([0, 1, 200, 201, 2, 3, 4, 5, 6, 7]), train=False)[:, 0]
    assert got.tolist() == [100.0, 101.0, 200.0, 201.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]
    stats = table.stats()
    assert stats["rows"] + stats["disk_rows"] == 10 and stats["rows"] <= 8


@pytest.mark.parametrize("native_rule", [True, False], ids=["native-rule", "tensor-rule"])
def test_an_update_whose_rows_on_disk_need_room_applies_every_gradient(tmp_path, native_rule):
    optimizer = SGD(lr=1.0) if native_rule else Adagrad(lr=1.0, rowwise=False)
    table = _table(tmp_path, optimizer=optimizer)
    table.lookup(torch.arange(8), train=True)
    table.lookup(torch.arange(8, 16), train=True)  # 0..7 demoted, 8..15 in memory
    table.lookup(torch.tensor([8, 9, 10, 11, 14, 15]), train=True)  # 12 and 13 the coldest in memory
    assert table.stats()["disk_rows"] == 8
    before = table.lookup(torch.tensor([0, 1, 12, 13]), train=False)
    ids = torch.tensor([0, 1, 12, 13])  # two on disk, two in memory that are among the coldest there
    assert table.update(ids, torch.ones(4, DIM)) == 4
    after = table.lookup(ids, train=False)
    assert not torch.isclose(after, before).any(), (before, after)
    assert table.stats()["dropped_update_rows"] == 0


def test_a_journaled_update_of_several_tables_applies_every_gradient(tmp_path):
    tables = [_table(tmp_path, name=name) for name in ("a", "b")]
    for table in tables:
        table.lookup(torch.arange(8), train=True)
        table.lookup(torch.arange(8, 16), train=True)
        table.lookup(torch.tensor([8, 9, 10, 11, 14, 15]), train=True)
    ids = torch.tensor([0, 1, 12, 13])
    heard = []
    applied = Table.update_together([(t, ids, torch.ones(4, DIM)) for t in tables], journal=heard.append)
    assert applied == 8 and all(t.stats()["dropped_update_rows"] == 0 for t in tables)
    for table in tables:
        assert (table.lookup(ids, train=False) == -1.0).all()
    assert [sorted(c.rows["ids"].tolist()) for c in heard[0]] == [[0, 1, 12, 13]] * 2


def test_a_log_replayed_into_a_second_disk_table_gives_the_same_rows(tmp_path):
    """A table trained with its changes journaled, and a second one that replays them, hold the same values."""
    table = _table(tmp_path, capacity=64, optimizer=Adagrad(lr=0.5, rowwise=True), name="trained")
    changes: list[TableChange] = []
    generator = torch.Generator().manual_seed(7)
    for _ in range(40):
        ids = torch.unique(torch.randint(0, 300, (48,), generator=generator))
        table.lookup(ids, train=True, journal=changes.extend)
        table.update(ids, torch.randn(ids.numel(), DIM, generator=generator), journal=changes.extend)
    replica = _table(tmp_path, capacity=64, optimizer=Adagrad(lr=0.5, rowwise=True), name="replayed")
    for change in changes:
        with replica.lock:
            replica.replay_locked(change)
    everything = torch.arange(300)
    assert torch.equal(table.lookup(everything, train=False), replica.lookup(everything, train=False))
