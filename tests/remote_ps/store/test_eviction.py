"""Which rows leave a full table: the coldest, found by a sweep that reads a bounded part of a large table."""
import pytest
import torch

from lightning_persia.remote_ps.store import native
from lightning_persia.remote_ps.store.native import rows as native_rows
from lightning_persia.remote_ps.store import eviction
from lightning_persia.remote_ps.store.chunked_rows import ChunkedRows, FieldSpec
from lightning_persia.remote_ps.store.eviction import FREE, select_victims


def _access(chunks: int = 4, rows: int = 100_000) -> list[torch.Tensor]:
    """Access values of a large table: a random order of steps, some rows free."""
    values = torch.randperm(chunks * rows, generator=torch.Generator().manual_seed(0)).to(torch.int32) + 1
    values[::97] = FREE
    return list(values.split(rows))


def test_a_large_table_gives_cold_rows_from_where_the_last_eviction_stopped_reading_a_bounded_part():
    access = _access()
    flat = torch.cat(access)
    live = flat[flat != FREE].to(torch.float64)
    start = 150_000
    victims, stop = select_victims(access, 1000, torch.Generator().manual_seed(1), start)
    assert victims.numel() == 1000 and victims.unique().numel() == 1000
    assert bool((flat[victims] != FREE).all())
    assert int(flat[victims].max()) <= torch.quantile(live, 2 * eviction.BULK_FRACTION)  # cold: the sample's error aside
    assert bool((victims >= start).all()) and start < stop <= start + 60_000  # ~1000 / 5% rows read, not 400k
    assert stop == int(victims.max()) + 1


def test_the_sweep_wraps_around_the_table():
    access = _access()
    victims, stop = select_victims(access, 1000, torch.Generator().manual_seed(1), 395_000)
    assert victims.numel() == 1000
    assert bool((victims >= 395_000).any()) and bool((victims < 395_000).any()) and stop < 395_000


def test_more_victims_than_the_coldest_fraction_come_from_the_coldest_rows():
    access = _access()
    flat = torch.cat(access)
    want = 100_000  # a quarter of the rows: more than BULK_FRACTION of them
    victims, _ = select_victims(access, want, torch.Generator().manual_seed(2), 0)
    assert victims.numel() == want and victims.unique().numel() == want
    live = flat[flat != FREE].to(torch.float64)
    assert int(flat[victims].max()) <= torch.quantile(live, 0.35)


def test_a_small_table_gives_exactly_its_coldest_rows():
    access = [torch.tensor([5, FREE, 1, 9], dtype=torch.int32), torch.tensor([3, 7], dtype=torch.int32)]
    victims, stop = select_victims(access, 2, torch.Generator().manual_seed(0), 3)
    assert sorted(victims.tolist()) == [2, 4] and stop == 3


def test_an_eviction_takes_at_most_a_slice_more_than_it_needs():
    assert eviction.bulk_size(10, 1_000) == 50  # a small table: 5% of its capacity
    assert eviction.bulk_size(10, 1 << 26) == eviction.SLICE_ROWS  # a large one: a slice, not 5% (3.3M rows)
    assert eviction.bulk_size(200_000, 1 << 26) == 200_000


def test_an_estimate_made_beforehand_is_used_and_no_sample_taken_under_the_lock():
    access = _access()
    estimated = eviction.estimate(access, 1000, torch.Generator().manual_seed(3))
    generator = torch.Generator().manual_seed(1)
    state = generator.get_state()
    victims, _ = select_victims(access, 1000, generator, 0, estimated)
    assert victims.numel() == 1000 and int(torch.cat(access)[victims].max()) <= estimated[0]
    assert torch.equal(generator.get_state(), state)  # the estimate sufficed: nothing sampled again
    assert eviction.estimate([torch.tensor([5, 1, 9], dtype=torch.int32)], 1, generator) is None  # chosen exactly


def test_a_stale_estimate_sweeps_a_bounded_part_then_samples_anew(monkeypatch):
    access = _access()
    estimated = eviction.estimate(access, 1000, torch.Generator().manual_seed(3))
    flat = torch.cat(access)
    flat[(flat != FREE) & (flat <= estimated[0])] = 10**9  # every row below it touched since: none left there
    access = list(flat.split(100_000))
    sweeps = [0]  # the values each sweep read; a sample taken starts the next sweep
    real_threshold, real_cold_among = eviction._threshold, eviction._cold_among

    def threshold(*args):
        sweeps.append(0)
        return real_threshold(*args)

    def cold_among(values, *args):
        hits, step = real_cold_among(values, *args)
        sweeps[-1] += step
        return hits, step

    monkeypatch.setattr(eviction, "_threshold", threshold)
    monkeypatch.setattr(eviction, "_cold_among", cold_among)
    monkeypatch.setattr(native, "available", lambda: False)  # the tensor ops' sweep, whose reads are counted here
    victims, _ = select_victims(access, 1000, torch.Generator().manual_seed(1), 0, estimated)
    assert victims.numel() == 1000 and bool((flat[victims] != FREE).all()) and bool((flat[victims] < 10**9).all())
    limit = eviction._STALE_READS * 1000 / (eviction.BULK_FRACTION * estimated[1])
    assert len(sweeps) == 2 and 0 < sweeps[0] <= limit + 1 < 400_000 and sweeps[1] > 0  # gave up, then sampled anew


@pytest.mark.parametrize("count", [1, 37, 500, 10_000])
def test_the_kernels_take_the_cold_values_of_a_field_of_records_as_the_tensor_ops_do(native_kernels, count):
    records = torch.randint(-1, 50, (6_000, 13), dtype=torch.int32, generator=torch.Generator().manual_seed(5))
    values = records[:, 5]  # a field of 52-byte records: a strided view, as a table's access values are
    in_c = native_rows.select_at_most(values, 20, FREE, count)
    with_tensors = eviction._cold_among(values, 20, FREE, count)
    assert torch.equal(in_c[0], with_tensors[0]) and in_c[1] == with_tensors[1]
    assert bool(((values[in_c[0]] <= 20) & (values[in_c[0]] != FREE)).all())
    assert in_c[1] == (values.numel() if in_c[0].numel() < count else int(in_c[0][-1]) + 1)


def test_the_kernels_read_no_value_for_a_count_of_none_and_refuse_other_dtypes(native_kernels):
    hits, stop = native_rows.select_at_most(torch.tensor([1, 2, 3], dtype=torch.int32), 5, FREE, 0)
    assert hits.numel() == 0 and stop == 0
    with pytest.raises(ValueError, match="values must be a 1-D torch.int32"):
        native_rows.select_at_most(torch.tensor([1, 2, 3]), 5, FREE, 1)
    with pytest.raises(ValueError, match="count must not be negative"):
        native_rows.select_at_most(torch.tensor([1, 2, 3], dtype=torch.int32), 5, FREE, -1)


def test_the_victims_are_the_same_with_the_kernels_and_without(native_kernels, monkeypatch):
    access = _access()
    in_c = select_victims(access, 5_000, torch.Generator().manual_seed(4), 123_456)
    monkeypatch.setattr(native, "available", lambda: False)
    with_tensors = select_victims(access, 5_000, torch.Generator().manual_seed(4), 123_456)
    assert torch.equal(in_c[0], with_tensors[0]) and in_c[1] == with_tensors[1]


def test_the_eviction_part_passes_over_the_rows_kept_and_sweeps_on_from_where_it_stopped(store_kernels):
    rows = ChunkedRows({"access": FieldSpec(torch.int32)})
    rows.reserve(200_000)  # more rows than a sample: the victims are swept for, from the clock hand on
    access = rows["access"]
    access.scatter(torch.arange(200_000), torch.arange(200_000, dtype=torch.int32) % 1000)
    in_use = [access.chunk(c, rows.chunk_rows) for c in range(rows.num_chunks)]
    part = eviction.Eviction(access, seed=0)
    keep = torch.arange(0, 200_000, 1000)  # rows of access value 0, the coldest
    first = part.victims(in_use, 500, keep=keep)
    assert first.numel() == 500 and not bool(torch.isin(first, keep).any())
    assert torch.equal(access.gather(keep), torch.zeros(keep.numel(), dtype=torch.int32))  # unhidden after it
    second = part.victims(in_use, 500)
    assert int(second.min()) > int(first.max())  # the second sweep starts where the first stopped
    assert part.victims([], 10).numel() == 0  # a table with no row allocated has no victim
