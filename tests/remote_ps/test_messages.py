"""Handover pages as they travel: the moving slots' sighting counters (``messages.fill_sightings_page``)."""
import grpc
import pytest
import torch

from lightning_persia.remote_ps import messages
from lightning_persia.remote_ps.protocol import persia_pb2


def test_sightings_travel_as_slots_and_their_counters():
    slots, counters = torch.tensor([3, 4095]), torch.arange(16, dtype=torch.uint8).reshape(2, 8)
    page = persia_pb2.HandoverPage()
    messages.fill_sightings_page(page, [("t", slots, counters)])
    [(name, got_slots, got_counters)] = messages.sightings_contents(persia_pb2.HandoverPage.FromString(page.SerializeToString()))
    assert name == "t" and torch.equal(got_slots, slots) and torch.equal(got_counters, counters)


@pytest.mark.parametrize("slots, counters, problem", [
    (b"\x01", b"\x00\x00", "is not a whole number of them"),
    (b"\x01\x00\x02\x00", b"\x00\x00\x00", "3 counters do not split evenly over 2 slots"),
    (b"\x01\x00", b"", "0 counters do not split evenly over 1 slots"),
])
def test_sightings_that_do_not_parse_are_refused_naming_the_problem(slots, counters, problem):
    page = persia_pb2.HandoverPage(sightings=[persia_pb2.SlotSightings(table="t", slots=slots, counters=counters)])
    with pytest.raises(messages.RpcRefusal, match=problem) as refused:
        messages.sightings_contents(page)
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
