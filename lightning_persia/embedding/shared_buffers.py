"""Host buffers in named shared memory, through which the trainer and its embedding workers hand over rows, ids and
gradients without a copy on either side (``embedding/worker_client.py``).

The trainer owns every buffer (:class:`SharedBuffers`): it takes one for each lookup's ids and rows and each update's
gradient, and the worker maps the same segment by name (:class:`MappedSegments`) and reads or writes it in place. A
segment is handed out again only once nothing in the trainer still reads the tensor taken from it (its storage is
gone: a weak reference to it has expired), so the rows of a step stay valid as long as its forward, backward or a
user's view holds them. Segments are reused rather than made per step: a fresh mapping costs a page fault per 4 KiB
on first touch (13 MB of rows a step for DLRM at batch 16,384).

Where CUDA is present, each segment is registered as pinned memory (``cudaHostRegister``), so rows go from the shared
segment to the GPU in one asynchronous copy with no staging buffer.
"""
from __future__ import annotations

import bisect
import logging
import threading
import uuid
from multiprocessing import resource_tracker, shared_memory
from typing import Callable, Optional

import torch
from torch.multiprocessing.reductions import StorageWeakRef

log = logging.getLogger(__name__)

MIN_SEGMENT_BYTES = 1 << 20  # small buffers share a size class: a step's ids and rows change size a little every step


class SharedTensor:
    """A tensor in a shared segment, and where another process finds it: ``segment`` name and byte ``offset``."""

    __slots__ = ("tensor", "segment", "offset")

    def __init__(self, tensor: torch.Tensor, segment: str, offset: int) -> None:
        self.tensor, self.segment, self.offset = tensor, segment, offset


class _Segment:
    def __init__(self, nbytes: int, prefix: str, pin: bool) -> None:
        self.memory = shared_memory.SharedMemory(name=f"{prefix}-{uuid.uuid4().hex[:12]}", create=True, size=nbytes)
        self.size = nbytes
        self.address = _address(self.memory)
        self.pinned = pin and _register_pinned(self.memory)
        self.held: Optional[StorageWeakRef] = None  # the storage of the tensor last handed out

    @property
    def free(self) -> bool:
        return self.held is None or self.held.expired()

    def close(self) -> bool:
        """Unlinks the segment; unmaps it when nothing here reads it any more (else the mapping ends with the process)."""
        self.memory.unlink()
        if not self.free:
            return False
        if self.pinned:
            _unregister_pinned(self.memory)
        self.memory.close()
        return True


class SharedBuffers:
    """The trainer's pool of shared segments; :meth:`take` hands out a tensor in one that nothing reads any more.

    ``on_drop(name)`` is told of every segment the pool lets go of (a worker that mapped it unmaps it).
    """

    def __init__(self, prefix: str = "persia", pin: Optional[bool] = None, on_drop: Optional[Callable[[str], None]] = None) -> None:
        self._prefix = prefix
        self._pin = torch.cuda.is_available() if pin is None else pin
        self._on_drop = on_drop
        self._segments: list[_Segment] = []
        self._lock = threading.Lock()  # the prefetch and push threads take buffers

    def take(self, numel: int, dtype: torch.dtype) -> SharedTensor:
        """A flat tensor of ``numel`` elements of ``dtype`` in a shared segment (its content undefined)."""
        nbytes = max(numel * _itemsize(dtype), 1)
        with self._lock:
            segment = self._free_segment(nbytes)
            tensor = torch.frombuffer(segment.memory.buf, dtype=dtype, count=numel) if numel else torch.empty(0, dtype=dtype)
            segment.held = StorageWeakRef(tensor.untyped_storage()) if numel else None
        return SharedTensor(tensor, segment.memory.name, 0)

    def locate(self, tensor: torch.Tensor) -> Optional[SharedTensor]:
        """``tensor`` as a :class:`SharedTensor` when it lies in one of the pool's segments (taken from it, or a
        contiguous view of what was: a worker's deduplicated ids), so that it crosses without a copy; else None."""
        if not tensor.is_contiguous() or tensor.device.type != "cpu":
            return None
        start = tensor.data_ptr()
        with self._lock:
            for segment in self._segments:
                if segment.address <= start and start + tensor.numel() * tensor.element_size() <= segment.address + segment.size:
                    return SharedTensor(tensor, segment.memory.name, start - segment.address)
        return None

    def close(self) -> None:
        """Unlinks every segment (each unmapped once nothing reads it; the rest when the process ends)."""
        with self._lock:
            segments, self._segments = self._segments, []
        for segment in segments:
            segment.close()

    def _free_segment(self, nbytes: int) -> _Segment:
        # The pool is kept smallest first, so the first free one that fits is the smallest: a step takes five buffers
        # from a pool of about twenty, and each look at a segment asks whether its storage expired (a few us).
        smallest_free: Optional[_Segment] = None
        for segment in self._segments:
            if segment.free:
                if segment.size >= nbytes:
                    return segment
                if smallest_free is None:
                    smallest_free = segment
        if smallest_free is not None:  # a free one too small is replaced, so that the pool holds at most the buffers in use at once
            self._segments.remove(smallest_free)
            smallest_free.close()
            if self._on_drop is not None:
                self._on_drop(smallest_free.memory.name)
        size = max(MIN_SEGMENT_BYTES, 1 << (nbytes - 1).bit_length())  # a power of two: room for the next steps' growth
        segment = _Segment(size, self._prefix, self._pin)
        bisect.insort(self._segments, segment, key=lambda s: s.size)
        return segment


class MappedSegments:
    """A worker's view of the trainer's segments: each mapped once, by name, and unmapped when the trainer drops it."""

    def __init__(self) -> None:
        self._mapped: dict[str, shared_memory.SharedMemory] = {}

    def tensor(self, segment: str, offset: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """The flat tensor of ``numel`` elements of ``dtype`` at byte ``offset`` of ``segment`` (shared: writes are seen)."""
        if numel == 0:
            return torch.empty(0, dtype=dtype)
        memory = self._mapped.get(segment)
        if memory is None:
            memory = shared_memory.SharedMemory(name=segment, create=False)
            # The trainer made it and unlinks it: Python would also track it here, and unlink it when this process ends.
            resource_tracker.unregister(f"/{memory.name}", "shared_memory")
            self._mapped[segment] = memory
        return torch.frombuffer(memory.buf, dtype=dtype, count=numel, offset=offset)

    def drop(self, segment: str) -> None:
        memory = self._mapped.pop(segment, None)
        if memory is not None:
            try:
                memory.close()
            except BufferError:  # a tensor of it is still alive here: the mapping ends with the process
                pass

    def close(self) -> None:
        for name in list(self._mapped):
            self.drop(name)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def _address(memory: shared_memory.SharedMemory) -> int:
    return torch.frombuffer(memory.buf, dtype=torch.uint8).data_ptr()


def _register_pinned(memory: shared_memory.SharedMemory) -> bool:
    """Pins the segment for asynchronous copies to the GPU (``cudaHostRegister``); False if CUDA refuses."""
    try:
        error = torch.cuda.cudart().cudaHostRegister(_address(memory), memory.size, 0)
    except Exception as failure:  # noqa: BLE001 - pinning is an optimisation: the copy goes through a staging buffer
        log.warning("could not pin a shared embedding buffer for the GPU (%s); rows will be staged", failure)
        return False
    if int(error) != 0:
        log.warning("cudaHostRegister refused a shared embedding buffer (error %s); rows will be staged", int(error))
        return False
    return True


def _unregister_pinned(memory: shared_memory.SharedMemory) -> None:
    torch.cuda.cudart().cudaHostUnregister(_address(memory))
