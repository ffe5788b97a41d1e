"""Bindings of ``jobs.c``: a training request's kernels, the lookups and the sparse updates of many tables in one call
and the admission of the ids a table's lookup did not find. :class:`~.id_index.Index` builds the jobs, checking
their buffers."""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from lightning_persia.remote_ps.store import native

_P, _I64, _I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32

SIGNATURES = {
    "lp_find_many": ([_P, _I64], None),
    "lp_update_many": ([_P, _I64], None),
    "lp_admit": ([_P], _I64),
}
"""Argument and result types of every function of ``jobs.c`` (tests/remote_ps/store/test_store_native_interface.py
checks them, and the job structures below)."""

native.LIBRARY.declare(SIGNATURES)

RULES = {"SGD": 0, "Adagrad": 1, "RowwiseAdagrad": 2}
"""The sparse rules :func:`update_many` runs in C (``remote_ps/store/optimizers.py`` names; Adam runs in torch)."""


_HEAD = [("index", _P), ("chunks", _P), ("shift", _I64), ("stride", _I64), ("ids", _P), ("n", _I64), ("rows", _P)]
"""The fields every job begins with (``jobs.c``'s ``JOB_HEAD``): a table's index and rows, the job's ids, a row each."""


class FindJob(ctypes.Structure):
    """One table's part of :func:`find_many` (``jobs.c``'s ``find_job_t``)."""

    _fields_ = _HEAD + [("offset", _I64), ("width", _I64), ("out", _P), ("touch_offset", _I64), ("value", _I32),
                        ("add", _I32), ("missing", _I64)]


class UpdateJob(ctypes.Structure):
    """One table's part of :func:`update_many` (``jobs.c``'s ``update_job_t``)."""

    _fields_ = _HEAD + [("grads", _P), ("dim", _I64), ("weights_offset", _I64), ("state_offset", _I64),
                        ("version_offset", _I64), ("weights_half", _I32), ("rule", _I32), ("version", _I32),
                        ("bounded", _I32), ("lr", ctypes.c_float), ("eps", ctypes.c_float), ("weight_decay", ctypes.c_float),
                        ("bound", ctypes.c_float), ("applied", _I64), ("absent", _I64), ("not_unique", _I32)]


@dataclass(frozen=True)
class AdmitFields:
    """Where :func:`admit` writes a new record: ``weights`` (offset, dtype), ``access`` and ``version`` (offset, value),
    ``state``: one record's initial optimizer state (float32, possibly empty) at ``state_offset``."""

    weights: tuple[int, torch.dtype]
    access: tuple[int, int]
    version: tuple[int, int]
    state: torch.Tensor
    state_offset: int


class AdmitJob(ctypes.Structure):
    """One table's :func:`admit` call (``jobs.c``'s ``admit_job_t``); keeps the tensors it points at alive."""

    _fields_ = _HEAD + [("out", _P), ("dim", _I64), ("weights_offset", _I64), ("weights_half", _I32),
                        ("access_value", _I32), ("access_offset", _I64), ("version_offset", _I64),
                        ("version", _I32), ("pad", _I32), ("state_offset", _I64), ("state_bytes", _I64),
                        ("state", _P), ("init_key", _I64), ("low", ctypes.c_double), ("high", ctypes.c_double),
                        ("fresh", _P), ("fresh_count", _I64), ("used", _I64)]

    def __init__(self, *values, _keep: tuple = ()) -> None:
        super().__init__(*values)
        self._keep = _keep


def find_many(jobs: list[FindJob]) -> None:
    """Lookups of several tables in one call (each job: :meth:`Index.find` with a copy and a touch); sets ``missing``.

    The jobs' buffers are checked by their builder (``Index.find_job``); the caller holds every table's lock.
    """
    array = (FindJob * len(jobs))(*jobs)
    native.LIBRARY.require().lp_find_many(array, len(jobs))
    for job, done in zip(jobs, array):
        job.missing = done.missing


def update_many(jobs: list[UpdateJob]) -> None:
    """Sparse updates of several tables in one call; sets each job's ``applied``, ``absent`` and ``not_unique`` (ids
    not strictly increasing: that job applied nothing). The caller holds every table's lock."""
    array = (UpdateJob * len(jobs))(*jobs)
    native.LIBRARY.require().lp_update_many(array, len(jobs))
    for job, done in zip(jobs, array):
        job.applied, job.absent, job.not_unique = done.applied, done.absent, done.not_unique


def admit(job: AdmitJob) -> int:
    """Runs an :meth:`Index.admit_job`; returns the rows of ``fresh`` it took. MemoryError when the index cannot grow,
    ValueError when ``fresh`` runs out; the ids admitted until then stay, and ``job.used`` counts them. The caller
    holds the table's lock."""
    failed = native.LIBRARY.require().lp_admit(ctypes.byref(job))
    if failed == -2:
        raise ValueError(f"admit: {job.fresh_count} fresh rows were too few for the absent ids")
    if failed:
        raise MemoryError(f"out of memory while indexing new ids ({job.used} admitted before)")
    return job.used
