"""Training on from the serving tests' checkpoint while publishing versions (train_online.py in its own process)."""
from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

SCRIPT = Path(__file__).with_name("train_online.py")


@dataclass
class Online:
    """The versions a run of train_online.py published, and ``trainer.predict``'s scores at each."""

    deltas: Path
    scores: dict  # version -> scores (one tensor per test batch); version 1: the checkpoint's (the bundle's)

    def flat(self, version: int) -> list[float]:
        return torch.cat(self.scores[version]).tolist()


def train_online(ckpt: Path, bundle_scores: list, deltas: Path, out: Path, *args: str) -> Online:
    """Runs train_online.py from the checkpoint ``ckpt`` (whose ``trainer.predict`` scores are ``bundle_scores``),
    publishing into ``deltas``; ``args``: more of its options."""
    result = subprocess.run([sys.executable, str(SCRIPT), "--ckpt", str(ckpt), "--deltas", str(deltas), "--out", str(out), *args],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return Online(deltas, {1: bundle_scores, **torch.load(out / "online.pt", weights_only=False)})
