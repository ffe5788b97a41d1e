"""Where the remote twins get their rows when serving: evaluation lookups, nothing pushed back.

This is serving's one point of contact with the twins' row protocol (``lightning_persia.embedding``): a
twin bound to a row source calls ``rows_for(module, source, plan)`` in its forward, where ``plan()`` builds
the batch's :class:`~lightning_persia.embedding.batch_rows.BatchRows` (unique ids per table), and expects
them back with their rows materialised on the device.
"""
from __future__ import annotations

from typing import Callable

import torch

from lightning_persia.embedding.batch_rows import BatchRows
from lightning_persia.embedding.modules import RemoteModule
from lightning_persia.remote_ps.client import PSClient


class ReadOnlyRowSource:
    """Rows for the twins' forwards from evaluation lookups (``train=False``: the shards insert nothing).

    Stateless: any number of threads may run forwards through it at once.

    Example::

        source = ReadOnlyRowSource(PSClient(addresses), wire_dtype="fp32", device=torch.device("cpu"))
        for twin in twins:
            twin.bind(source)
    """

    def __init__(self, client: PSClient, wire_dtype: str, device: torch.device, timeout_s: float = 30.0) -> None:
        self._client = client
        self._wire_dtype = wire_dtype
        self._device = device
        self._timeout_s = timeout_s

    def rows_for(self, module: RemoteModule, source: tuple[torch.Tensor, ...], plan: Callable[[], BatchRows]) -> BatchRows:
        rows = plan()
        rows.attach(self._client.lookup_async(rows.request(), train=False, wire_dtype=self._wire_dtype))
        rows.materialize(self._device, requires_grad=False, timeout_s=self._timeout_s)
        return rows
