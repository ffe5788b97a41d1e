"""The free rows of a table: taken first freed first, across the tensors they were freed in."""
import torch

from lightning_persia.remote_ps.store.free_rows import FreeRows


def test_rows_are_taken_in_the_order_they_were_freed_across_pushes():
    free = FreeRows()
    free.push(torch.tensor([4, 9, 2]))
    free.push(torch.empty(0, dtype=torch.int64))
    free.push(torch.tensor([7, 1]))
    assert len(free) == 5
    assert free.take(2).tolist() == [4, 9]
    assert free.take(2).tolist() == [2, 7]  # the rest of one push and the start of the next
    assert len(free) == 1
    assert free.take(5).tolist() == [1]  # fewer than asked: all there are
    assert len(free) == 0 and free.take(3).numel() == 0 and free.take(3).dtype == torch.int64
