"""Fixtures of the strategy tests: a clean process group and environment around every in-process Trainer."""
from __future__ import annotations

import os

import pytest
import torch.distributed as dist

_DDP_ENV = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "LOCAL_WORLD_SIZE", "PL_GLOBAL_SEED")


@pytest.fixture(autouse=True)
def clean_distributed():
    saved = {k: os.environ.get(k) for k in _DDP_ENV}
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
