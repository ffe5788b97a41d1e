"""Wire codecs: ids and rows to little-endian bytes and back."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from lightning_persia.ops import wire


@given(st.lists(st.integers(min_value=-(2**63), max_value=2**63 - 1), max_size=200))
def test_ids_round_trip(values):
    ids = torch.tensor(values, dtype=torch.int64)
    data = wire.encode_ids(ids)
    assert data == np.asarray(values, dtype="<i8").tobytes()
    assert torch.equal(wire.decode_ids(data), ids)


@pytest.mark.parametrize("dtype,tolerance", [("fp32", 0.0), ("fp16", 1e-3)])
def test_rows_round_trip(dtype, tolerance):
    rows = torch.randn(50, 7)
    data = wire.encode_rows(rows, dtype)
    assert len(data) == 50 * 7 * (2 if dtype == "fp16" else 4)
    decoded = wire.decode_rows(data, dtype, 7)
    assert decoded.dtype == torch.float32 and decoded.shape == (50, 7)
    torch.testing.assert_close(decoded, rows, rtol=tolerance, atol=tolerance)
    decoded += 1  # a fresh, writable tensor: the message's bytes are untouched
    assert torch.equal(wire.decode_rows(data, dtype, 7), wire.decode_rows(data, dtype, 7))


def test_fp16_is_little_endian_half():
    assert wire.encode_rows(torch.tensor([[1.0, -2.0]]), "fp16") == np.array([1.0, -2.0], dtype="<f2").tobytes()


def test_empty_inputs():
    assert wire.decode_ids(b"").shape == (0,)
    assert wire.decode_rows(b"", "fp16", 4).shape == (0, 4)
    assert wire.encode_ids(torch.empty(0, dtype=torch.int64)) == b""


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda: wire.decode_ids(b"\x00" * 9), "ids is 9 bytes, not a multiple of 8 (int64)"),
        (lambda: wire.decode_rows(b"\x00" * 3, "fp16", 1), "rows is 3 bytes, not a multiple of 2 (fp16)"),
        (lambda: wire.decode_rows(b"\x00" * 6, "fp32", 1), "rows is 6 bytes, not a multiple of 4 (fp32)"),
        (lambda: wire.decode_rows(b"\x00" * 12, "fp32", 2), "holds 3 fp32 values, not a whole number of rows of dim 2"),
        (lambda: wire.decode_rows(b"", "fp64", 2), "unknown wire dtype 'fp64'"),
        (lambda: wire.encode_rows(torch.zeros(2, 2), "int8"), "unknown wire dtype 'int8'"),
        (lambda: wire.encode_ids(torch.zeros(2, dtype=torch.int32)), "ids must be int64"),
        (lambda: wire.encode_ids(torch.zeros(2, 2, dtype=torch.int64)), "ids must be 1-d"),
        (lambda: wire.encode_rows(torch.zeros(2, 2, dtype=torch.int64)), "rows must be a floating-point tensor"),
    ],
)
def test_errors_name_the_problem(call, message):
    with pytest.raises(wire.WireFormatError, match=message.replace("(", r"\(").replace(")", r"\)")):
        call()
