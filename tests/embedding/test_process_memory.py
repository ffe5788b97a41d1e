"""Reading another process's memory (process_vm_readv): exact bytes, a refusal or a bad address told, never a crash."""
from __future__ import annotations

import os

import pytest
import torch

from lightning_persia.embedding import process_memory


def test_a_tensor_is_read_back_exactly():
    source = torch.arange(300_000, dtype=torch.int64) * 7 - 5  # more than a page: the read may come in pieces
    got = process_memory.read(os.getpid(), source.data_ptr(), source.numel(), torch.int64)
    assert torch.equal(got, source) and got.data_ptr() != source.data_ptr()


def test_readable_says_whether_the_bytes_there_are_the_expected_ones():
    probe = torch.frombuffer(bytearray(b"persia-probe-123"), dtype=torch.uint8)
    assert process_memory.readable(os.getpid(), probe.data_ptr(), b"persia-probe-123")
    assert not process_memory.readable(os.getpid(), probe.data_ptr(), b"something-else!!")
    assert not process_memory.readable(2**22 + 12345, probe.data_ptr(), b"persia-probe-123")  # no such process


def test_a_bad_address_is_an_error_naming_it():
    with pytest.raises(OSError, match=r"could not read 64 bytes of process \d+ at 0x10"):
        process_memory.read(os.getpid(), 0x10, 8, torch.int64)
