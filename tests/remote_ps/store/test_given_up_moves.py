"""A taker's refusal of a move given up (``ABORT`` with the move's map) is in its write-ahead log: restarted, from
the log's own record or from a later segment's ``OPEN`` after a save, it still never adopts that map nor takes rows
for it, until a new coordinator starts over."""
import pytest

from lightning_persia.ops.shard_map import ShardMap
from lightning_persia.remote_ps.store import ShardStore
from lightning_persia.remote_ps.store.errors import InvalidRequestError
from lightning_persia.remote_ps.store.wal import open_shard_log
from lightning_persia.remote_ps.table_config import TableConfig

CONFIG = TableConfig("t", 4)


@pytest.mark.parametrize("save_between", [False, True], ids=["replayed", "saved-then-replayed"])
def test_a_taker_restarted_from_its_log_still_refuses_a_move_it_gave_up(tmp_path, save_between):
    def start(incarnation: str) -> ShardStore:
        store = ShardStore(0, 3, seed=7)
        store.log = open_shard_log(store, str(tmp_path / "wal"), "log", incarnation, None, window=64)
        return store

    taker = start("a")
    taker.configure(CONFIG)
    two = ShardMap.uniform(3).resized(2)  # shard 0 takes some of shard 2's slots
    assert taker.abort_handover(two) == 0
    if save_between:
        taker.save(str(tmp_path / "ckpt"))  # a new segment: its OPEN carries the refusal
    taker.log.close()

    restarted = start("b")
    assert restarted.given_up_version == two.version
    with pytest.raises(InvalidRequestError, match="rolled back on this shard"):
        restarted.adopt_map(two)
    with pytest.raises(InvalidRequestError, match="rolled back on this shard"):
        restarted.take_changes([CONFIG], [], two)
    restarted.forget_given_up()  # a new coordinator: the forgetting is in the log too
    restarted.log.close()

    again = start("c")
    assert again.given_up_version == 0
    again.adopt_map(two)
    assert again.shard_map == two
    again.log.close()
