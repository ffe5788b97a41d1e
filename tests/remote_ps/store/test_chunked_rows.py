"""Tables whose rows span several chunks: lookups, updates, eviction and reuse across chunk boundaries."""
import ctypes
import gc
import mmap
import threading
import time
import weakref

import pytest
import torch

from lightning_persia.ops.hashing import slot_of
from lightning_persia.ops.shard_map import SLOTS
from lightning_persia.remote_ps.store import ShardStore, eviction
from lightning_persia.remote_ps.store import chunked_rows
from lightning_persia.remote_ps.store.chunked_rows import ChunkedRows, FieldSpec
from lightning_persia.remote_ps.store.initializers import initial_rows
from lightning_persia.remote_ps.store.native.rows import Kept, KeptFields
from lightning_persia.remote_ps.table_config import SGD, TableConfig, Uniform


def test_growth_appends_chunks_and_never_moves_a_stored_row(small_chunks, store_kernels):
    rows = ChunkedRows({"ids": FieldSpec(torch.int64), "weights": FieldSpec(torch.float16, 3)})
    rows.reserve(10)
    first = rows.chunks[0]
    rows["weights"].scatter(torch.tensor([0, 1023]), torch.tensor([[1.0, 2, 3], [4, 5, 6]]))
    rows.reserve(5 * small_chunks + 1)
    assert rows.num_chunks == 6 and rows.chunks[0].data_ptr() == first.data_ptr()
    assert rows.record_bytes == 16 and rows["ids"].offset == 0  # id first, then the 3 fp16 weights, padded to 4
    spanning = torch.tensor([1023, 1024, 4095, 5120, 0, -1])
    rows["weights"].scatter(spanning[1:4], torch.arange(9, dtype=torch.float16).view(3, 3))
    out = rows["weights"].gather(spanning, torch.full((6, 3), -7.0, dtype=torch.float16))
    expected = torch.tensor([[4, 5, 6], [0, 1, 2], [3, 4, 5], [6, 7, 8], [1, 2, 3], [-7, -7, -7]], dtype=torch.float16)
    assert torch.equal(out, expected)


def test_ids_spanning_chunks_train_like_one_chunk(small_chunks, store_kernels):
    config = TableConfig("t", 4, optimizer=SGD(lr=1.0), init=Uniform(-1, 1))
    store = ShardStore(0, 1, seed=2)
    store.configure(config)
    ids = torch.arange(5000) * 7919 - 12345
    store.lookup("t", ids, train=True)
    assert store.stats()["t"]["chunks"] == 6  # 5 hold the rows; the next is allocated (and committed) ahead of them
    grads = torch.randn(5000, 4, generator=torch.Generator().manual_seed(0))
    store.update("t", ids, grads)
    expected = initial_rows(config.init, 2, "t", ids, 4) - grads
    torch.testing.assert_close(store.lookup("t", ids.flip(0), train=False), expected.flip(0))


def test_evicted_rows_are_reused_across_chunks(small_chunks, store_kernels):
    store = ShardStore(0, 1)
    store.configure(TableConfig("t", 2, capacity=3000, optimizer=SGD(lr=1.0), init=Uniform(0, 1)))
    hot = torch.arange(100)
    for start in range(100, 30_000, 1000):  # waves of new ids; the hot ones are looked up every time
        store.lookup("t", hot, train=True)
        store.update("t", hot, torch.ones(100, 2))
        store.lookup("t", torch.arange(start, start + 1000), train=True)
    stats = store.stats()["t"]
    assert stats["rows"] <= 3000 and stats["rows_allocated"] <= 3000 and stats["evicted"] >= 20_000
    assert stats["chunks"] == 3  # freed rows of every chunk are reused: the table never grew past its capacity
    expected = initial_rows(Uniform(0, 1), 0, "t", hot, 2) - 30  # one update in each of the 30 waves, never evicted
    torch.testing.assert_close(store.lookup("t", hot, train=False), expected)
    recent = torch.arange(29_100, 30_100)  # the last wave
    torch.testing.assert_close(store.lookup("t", recent, train=False), initial_rows(Uniform(0, 1), 0, "t", recent, 2))


def test_dropped_rows_free_their_chunks_at_once_without_a_gc_pass():
    """A table dropped by a load must hand its (many GB of) chunks back at once, not whenever the cyclic GC runs."""
    gc.disable()
    try:
        rows = ChunkedRows({"ids": FieldSpec(torch.int64), "weights": FieldSpec(torch.float32, 4)})
        rows.reserve(10)
        rows["weights"].scatter(torch.arange(3), torch.ones(3, 4))
        chunk = weakref.ref(rows.chunks[0])
        del rows
        assert chunk() is None
    finally:
        gc.enable()


def _resident_bytes(rows: ChunkedRows, chunk: int) -> int:
    """Bytes of chunk ``chunk`` that are in memory."""
    memory = rows.chunks[chunk]
    return _resident_bytes_at(memory.data_ptr(), memory.numel())


def _resident_bytes_at(address: int, length: int) -> int:
    """Bytes of the pages of ``length`` bytes at ``address`` that are in memory (``mincore``)."""
    first = address - address % mmap.PAGESIZE
    length += address - first
    pages = (length + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    vector = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    assert libc.mincore(ctypes.c_void_p(first), ctypes.c_size_t(length), vector) == 0, ctypes.get_errno()
    return min(sum(v & 1 for v in vector) * mmap.PAGESIZE, length)


def test_a_growing_table_has_the_memory_of_its_next_rows_committed_ahead_without_changing_them(small_chunks):
    rows = ChunkedRows({"ids": FieldSpec(torch.int64), "weights": FieldSpec(torch.float32, 16)})
    rows.reserve(small_chunks, ahead_limit=10 * small_chunks)  # one chunk: a small table commits nothing ahead
    rows.wait_populated(10)
    assert rows.num_chunks == 1
    values = torch.randn(small_chunks + 10, 16)
    rows.reserve(small_chunks + 10, ahead_limit=10 * small_chunks)
    rows["weights"].scatter(torch.arange(small_chunks + 10), values)
    rows.wait_populated(10)
    assert rows.num_chunks == 3  # the chunk of the rows after the first ones written, allocated ahead
    assert _resident_bytes(rows, 2) > 0 and _resident_bytes(rows, 1) == rows.chunks[1].numel()
    assert torch.equal(rows["weights"].gather(torch.arange(small_chunks + 10)), values)
    assert not rows["weights"].gather(torch.arange(small_chunks + 10, 3 * small_chunks)).any()
    rows.reserve(2 * small_chunks + 10, ahead_limit=2 * small_chunks + 10)  # a table at its capacity: nothing more
    rows.wait_populated(10)
    assert rows.num_chunks == 3


def test_committing_memory_ahead_lets_the_other_threads_run():
    # A shard's request threads go on while the populator commits memory: a commit that held the GIL would stop
    # them all for its whole duration (about 0.3 s for the 256 MB here).
    size = 256 << 20
    memory = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    address = torch.frombuffer(memory, dtype=torch.uint8).data_ptr()
    started, done = threading.Event(), threading.Event()

    def commit() -> None:
        started.set()
        chunked_rows._populate([(memory, address, address + size)])
        done.set()

    thread = threading.Thread(target=commit)
    thread.start()
    started.wait(10)
    ticks = 0
    while not done.is_set():
        time.sleep(0.001)
        ticks += 1
    thread.join()
    assert _resident_bytes_at(address, size) == size
    assert ticks >= 5, f"the main thread ran {ticks} times while {size >> 20} MB were committed"


def _records_to_select(seed: int) -> tuple[ChunkedRows, dict[str, torch.Tensor]]:
    """Two chunks of 1,024 records with random ids, versions and access marks (a tenth of them free)."""
    generator = torch.Generator().manual_seed(seed)
    rows = ChunkedRows({"ids": FieldSpec(torch.int64), "weights": FieldSpec(torch.float16, 3), "access": FieldSpec(torch.int32),
                        "version": FieldSpec(torch.int32)})
    rows.reserve(2048)
    fields = {"ids": torch.randint(-2**62, 2**62, (2048,), generator=generator),
              "version": torch.randint(0, 50, (2048,), generator=generator, dtype=torch.int32),
              "access": torch.randint(0, 20, (2048,), generator=generator, dtype=torch.int32)}
    fields["access"][torch.rand(2048, generator=generator) < 0.1] = eviction.FREE
    rows.scatter_fields(torch.arange(2048), fields)
    return rows, fields


@pytest.mark.parametrize("seed", range(3))
def test_a_snapshots_selection_of_a_chunk_is_its_rows_of_the_point_in_the_slots_asked(small_chunks, store_kernels, seed):
    rows, fields = _records_to_select(seed)
    generator = torch.Generator().manual_seed(100 + seed)
    slot_mask = torch.rand(SLOTS, generator=generator) < 0.3
    for point, since, mask in [(30, 0, None), (30, 10, None), (49, 0, slot_mask), (25, 5, slot_mask), (0, 0, None)]:
        kept = Kept(point, since, eviction.FREE, mask)
        for chunk in (0, 1):
            got = rows.select_kept(chunk, 1000, kept)
            span = torch.arange(chunk * 1024, chunk * 1024 + 1000)
            version, access = fields["version"][span], fields["access"][span]
            want = (version <= point) & (access != eviction.FREE) & ((version > since) if since else True)
            if mask is not None:
                want &= mask[slot_of(fields["ids"][span], SLOTS)]
            assert torch.equal(got, span[want]), f"seed {seed}: point {point}, since {since}, chunk {chunk}"


def test_a_selection_outside_one_chunk_or_with_a_bad_slot_mask_is_refused(small_chunks, native_kernels):
    rows, _ = _records_to_select(0)
    with pytest.raises(ValueError, match="not within one chunk"):
        rows.layout.select_kept(1000, 100, KeptFields(0, 0, 0), Kept(1, 0, eviction.FREE))
    with pytest.raises(ValueError, match="power-of-two"):
        rows.select_kept(0, 10, Kept(1, 0, eviction.FREE, torch.ones(100, dtype=torch.bool)))
    with pytest.raises(ValueError, match="slot_mask"):
        rows.select_kept(0, 10, Kept(1, 0, eviction.FREE, torch.ones(SLOTS, dtype=torch.uint8)))
