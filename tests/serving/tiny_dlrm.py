"""The tiny DLRM the serving tests train, export and serve, and the environment of their subprocesses."""
from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODEL_CLASS = "examples.dlrm.model.DLRM"
FEATURES = ["cat_0", "cat_1", "cat_2"]
NUM_EMBEDDINGS = [50, 50, 8]  # cat_2 (8 rows) is kept on the trainer, the others are remote
NUM_DENSE = 3
UNSEEN_ID = 987654321  # an id of cat_0 that training never saw


def serving_env() -> dict:
    """Environment of the serving subprocesses: this checkout first on the path (the examples, and this code)."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
