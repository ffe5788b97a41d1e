#!/usr/bin/env bash
# Creates .venv with the whole stack, once, from pyproject.toml (the one place for versions): the package in
# editable mode (which builds its native kernels) with its "test" extra, and FBGEMM's build for this machine:
# the "cuda" extra where an NVIDIA GPU answers, else the "cpu" extra plus TorchRec installed last and without its
# dependencies: its metadata asks for the CUDA package fbgemm-gpu, which clashes with the CPU wheel
# fbgemm-gpu-cpu (the same library; TorchRec's other dependencies are the package's own). pip checks
# dependencies only on installs that resolve them, so that install reports nothing; a later `pip install` or
# `pip check` in this venv says "torchrec 1.8.0 requires fbgemm-gpu, which is not installed": expected, and
# harmless (README, "Install").
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
STAMP="$VENV/.installed-$(cat pyproject.toml setup.py | sha1sum | cut -c1-12)"

if [ -f "$STAMP" ]; then
  exit 0
fi

echo "setup: creating $VENV (a few minutes, once: torch, FBGEMM, TorchRec, Lightning, gRPC)"
python3 -m venv "$VENV"
PY="$VENV/bin/python"
PIP="$PY -m pip"
echo "setup: [1/3] pip"
$PIP install --upgrade pip

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  echo "setup: [2/3] NVIDIA GPU found: torch, FBGEMM (CUDA), TorchRec, Lightning, gRPC and lightning-persia (editable)"
  $PIP install -e ".[cuda,test]"
else
  echo "setup: [2/3] no GPU: torch, FBGEMM (CPU), Lightning, gRPC and lightning-persia (editable)"
  $PIP install -e ".[cpu,test]"
  echo "setup: [3/3] TorchRec (without its dependencies: see the top of this script)"
  TORCHREC=$("$PY" scripts/pinned.py cuda torchrec)
  $PIP install --no-deps "$TORCHREC"
fi
touch "$STAMP"
echo "setup: done ($VENV)"
