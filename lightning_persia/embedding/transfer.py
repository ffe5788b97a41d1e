"""A step's tensors between host and device, off the trainer's CUDA stream (TorchRec's train-pipeline copies).

On a GPU the trainer's stream runs the dense step; a copy queued on it, or a synchronous one from pageable
memory, makes the step wait. So every copy of the embedding path runs on a side stream of its own, from or into
pinned host memory, and the two sides meet through CUDA events, never a device synchronisation:

- **to the device** (:meth:`DeviceTransfer.upload`, on the prefetch thread or the PS client's): the rows of step
  ``t + 1`` and its inverse indices go up while step ``t`` computes; the forward makes the trainer's stream wait
  for the copy's event (:meth:`Upload.get`), which costs the host nothing;
- **to the host** (:meth:`DeviceTransfer.download`, on the trainer's thread after the backward): the gradient is
  copied once the backward's kernels are done (an event recorded on the trainer's stream), and whoever encodes
  and pushes it (the pusher's thread) waits for that copy (:meth:`Download.get`), not the trainer.

A tensor made on one stream and used on another is marked with ``record_stream`` so that the caching allocator
does not hand its memory out again before the other stream is done with it. On the CPU there is nothing to copy:
both sides hand the tensor through.
"""
from __future__ import annotations

from typing import Optional

import torch


class Upload:
    """A tensor on its way to the device; :meth:`get` on the stream that uses it."""

    def __init__(self, tensor: torch.Tensor, event: Optional["torch.cuda.Event"] = None, source: Optional[torch.Tensor] = None) -> None:
        self._tensor = tensor
        self._event = event
        # The host tensor copied from, held while the copy may run: an embedding worker's shared buffer goes back to
        # its pool once nothing holds it, and torch's caching host allocator does not track memory it did not allocate.
        self._source = source

    def get(self) -> torch.Tensor:
        """The tensor, usable by work queued on the current stream from now on (which waits for the copy)."""
        if self._event is not None:
            stream = torch.cuda.current_stream(self._tensor.device)
            stream.wait_event(self._event)
            self._tensor.record_stream(stream)
            self._event = None
        return self._tensor


class Download:
    """A tensor on its way to pinned host memory; :meth:`get` blocks the calling thread (only) until it is there."""

    def __init__(self, tensor: torch.Tensor, event: Optional["torch.cuda.Event"] = None) -> None:
        self._tensor = tensor
        self._event = event

    def get(self) -> torch.Tensor:
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        return self._tensor


class DeviceTransfer:
    """Copies between the host and ``device`` on side streams (CUDA), or none at all (CPU).

    Example::

        transfer = DeviceTransfer(torch.device("cuda"))
        pending = transfer.upload(rows)          # any thread: pinned copy, then an async copy on the upload stream
        weights = pending.get()                  # the trainer's thread, in the forward: its stream waits for the copy
        grad = transfer.download(weights.grad)   # the trainer's thread, after the backward
        host = grad.get()                        # the pusher's thread: waits for the copy, not the trainer
    """

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self._cuda = self.device.type == "cuda"
        self._up: Optional[torch.cuda.Stream] = torch.cuda.Stream(self.device) if self._cuda else None
        self._down: Optional[torch.cuda.Stream] = torch.cuda.Stream(self.device) if self._cuda else None

    @property
    def on_gpu(self) -> bool:
        return self._cuda

    def upload(self, host: torch.Tensor) -> Upload:
        """Starts ``host``'s copy to the device (from pinned memory, on the upload stream) and returns at once."""
        if not self._cuda:
            return Upload(host if host.device == self.device else host.to(self.device))
        assert self._up is not None
        pinned = host if host.is_pinned() else _pinned_copy(host)
        with torch.cuda.stream(self._up):
            on_device = pinned.to(self.device, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._up)
        return Upload(on_device, event, pinned)

    def download(self, on_device: torch.Tensor, dtype: Optional[torch.dtype] = None) -> Download:
        """Starts ``on_device``'s copy (as ``dtype``) to pinned host memory once the current stream's work so far is
        done (the backward that wrote it), on the download stream; returns at once."""
        if not self._cuda or on_device.device.type != "cuda":
            return Download(on_device.detach().to("cpu", dtype or on_device.dtype))
        assert self._down is not None
        written = torch.cuda.Event()
        written.record(torch.cuda.current_stream(self.device))
        host = torch.empty(on_device.shape, dtype=dtype or on_device.dtype, pin_memory=True)
        with torch.cuda.stream(self._down):
            self._down.wait_event(written)
            source = on_device.detach()
            source.record_stream(self._down)  # its memory stays the gradient's until this copy is done
            host.copy_(source if dtype is None else source.to(dtype), non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._down)
        return Download(host, done)


def _pinned_copy(host: torch.Tensor) -> torch.Tensor:
    pinned = torch.empty(host.shape, dtype=host.dtype, pin_memory=True)
    pinned.copy_(host)
    return pinned


def small_tensor(values: list[int], device: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """``torch.tensor(values)`` on ``device`` without waiting for it: from pinned memory, asynchronously, on the
    current stream (``torch.tensor(values, device=...)`` on a GPU is a synchronous copy, a wait for the device)."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
