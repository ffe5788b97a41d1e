#!/usr/bin/env bash
# Creates .venv with the whole stack, once, from pyproject.toml (the one place for versions): the package in
# editable mode (which builds its native kernels) with its "test" extra, and FBGEMM's build for this machine:
# the "cuda" extra where an NVIDIA GPU answers, else the "cpu" extra plus TorchRec installed without its
# metadata, which asks for the CUDA fbgemm-gpu (that would replace the CPU build; TorchRec's other
# dependencies are the package's own).
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
STAMP="$VENV/.installed-$(cat pyproject.toml setup.py | sha1sum | cut -c1-12)"

if [ -f "$STAMP" ]; then
  exit 0
fi

python3 -m venv "$VENV"
PY="$VENV/bin/python"
PIP="$PY -m pip"
$PIP install -q --upgrade pip

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  echo "setup: NVIDIA GPU found, installing CUDA builds"
  $PIP install -q -e ".[cuda,test]"
else
  echo "setup: no GPU, installing CPU builds"
  $PIP install -q -e ".[cpu,test]"
  TORCHREC=$("$PY" scripts/pinned.py cuda torchrec)
  $PIP install -q --no-deps "$TORCHREC"
fi
touch "$STAMP"
echo "setup: done ($VENV)"
