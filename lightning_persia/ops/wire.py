"""Tensor <-> bytes codecs of the PS wire protocol.

Ids travel as little-endian int64, rows and gradients as little-endian fp16 (the default) or fp32, row-major.
Decoding is zero-copy where the dtype allows it (``torch.frombuffer`` over the message's bytes): a decoded
id tensor shares memory with the ``bytes`` object it came from, so it must be treated as read-only.
Rows always come back as float32; fp16 is widened in one vectorised pass.
"""
from __future__ import annotations

import sys
import warnings

import numpy as np
import torch


class WireFormatError(ValueError):
    """Bytes that cannot be the tensor they claim to be; the message names the field and the sizes."""


WIRE_DTYPES: dict[str, torch.dtype] = {"fp16": torch.float16, "fp32": torch.float32}
ID_BYTES = 8

_LITTLE = sys.byteorder == "little"

# torch warns once per process that a tensor over immutable ``bytes`` is not writable. The codecs never
# write into such tensors and never hand them out as mutable results, so that one warning is consumed here.
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    torch.frombuffer(bytes(8), dtype=torch.int64)


def wire_dtype(name: str) -> torch.dtype:
    """The torch dtype of a wire dtype name (``"fp16"`` or ``"fp32"``)."""
    try:
        return WIRE_DTYPES[name]
    except (KeyError, TypeError):
        raise WireFormatError(f"unknown wire dtype {name!r}; expected one of {sorted(WIRE_DTYPES)}") from None


def _to_bytes(tensor: torch.Tensor) -> bytes:
    array = tensor.contiguous().numpy()
    if not _LITTLE:
        array = array.astype(array.dtype.newbyteorder("<"))
    return array.tobytes()


def _from_bytes(data: bytes, dtype: torch.dtype) -> torch.Tensor:
    if not data:
        return torch.empty(0, dtype=dtype)
    if _LITTLE:
        return torch.frombuffer(data, dtype=dtype)
    little = torch.empty(0, dtype=dtype).numpy().dtype.newbyteorder("<")
    return torch.from_numpy(np.frombuffer(data, dtype=little).astype(little.newbyteorder("=")))


def encode_ids(ids: torch.Tensor) -> bytes:
    """Little-endian int64 bytes of a 1-d id tensor."""
    if ids.dtype != torch.int64:
        raise WireFormatError(f"ids must be int64, got {ids.dtype}")
    if ids.dim() != 1:
        raise WireFormatError(f"ids must be 1-d, got shape {tuple(ids.shape)}")
    return _to_bytes(ids.cpu())


def decode_ids(data: bytes, what: str = "ids") -> torch.Tensor:
    """int64 tensor over ``data`` (zero-copy, read-only); ``what`` names the field in errors."""
    if len(data) % ID_BYTES:
        raise WireFormatError(f"{what} is {len(data)} bytes, not a multiple of {ID_BYTES} (int64)")
    return _from_bytes(data, torch.int64)


def encode_rows(rows: torch.Tensor, dtype: str = "fp16") -> bytes:
    """Bytes of a float tensor ``[n, dim]`` in the wire dtype (converted in one pass)."""
    target = wire_dtype(dtype)
    if not rows.is_floating_point():
        raise WireFormatError(f"rows must be a floating-point tensor, got {rows.dtype}")
    return _to_bytes(rows.detach().to(device="cpu", dtype=target))


def rows_view(data: bytes, dtype: str, dim: int, what: str = "rows") -> torch.Tensor:
    """``[n, dim]`` tensor of the wire dtype over ``data`` (zero-copy, read-only)."""
    target = wire_dtype(dtype)
    size = torch.empty(0, dtype=target).element_size()
    if len(data) % size:
        raise WireFormatError(f"{what} is {len(data)} bytes, not a multiple of {size} ({dtype})")
    if dim < 1:
        raise WireFormatError(f"{what}: dim must be >= 1, got {dim}")
    count = len(data) // size
    if count % dim:
        raise WireFormatError(f"{what} holds {count} {dtype} values, not a whole number of rows of dim {dim}")
    return _from_bytes(data, target).view(count // dim, dim)


def decode_rows(data: bytes, dtype: str, dim: int, what: str = "rows") -> torch.Tensor:
    """float32 ``[n, dim]`` tensor of ``data``; a fresh tensor (fp16 widened, fp32 copied)."""
    view = rows_view(data, dtype, dim, what)
    return view.to(torch.float32, copy=True)
