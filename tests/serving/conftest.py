"""A trained tiny DLRM and its bundle, shared by the serving tests (training runs once, in its own process)."""
from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from lightning_persia.serving import Bundle, export_bundle
from online_run import Online, train_online
from tiny_dlrm import MODEL_CLASS, ROOT

SCRIPT = Path(__file__).with_name("train_tiny.py")

if str(ROOT) not in sys.path:  # the bundle names examples.dlrm.model.DLRM
    sys.path.insert(0, str(ROOT))


@dataclass
class Trained:
    """A checkpoint of a 2-shard run and what ``trainer.predict`` answered for the test batches."""

    ckpt: Path
    expected: dict  # batches, scores (one tensor per batch), requests (JSON bodies, one per row), flat_scores


@pytest.fixture(scope="session")
def trained(tmp_path_factory) -> Trained:
    out = tmp_path_factory.mktemp("trained")
    result = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return Trained(out / "model.ckpt", torch.load(out / "expected.pt", weights_only=False))


@pytest.fixture(scope="session")
def bundle(trained, tmp_path_factory) -> Bundle:
    """The bundle of the trained checkpoint (exported with the class path: the model was built in Python)."""
    return export_bundle(trained.ckpt, tmp_path_factory.mktemp("bundles") / "bundle", model_class=MODEL_CLASS)


@pytest.fixture(scope="session")
def online(trained, tmp_path_factory) -> Online:
    """One rank trains on from the bundle's checkpoint for 6 steps, publishing a version every 2 steps."""
    out = tmp_path_factory.mktemp("online")
    return train_online(trained.ckpt, trained.expected["scores"], out / "deltas", out)
