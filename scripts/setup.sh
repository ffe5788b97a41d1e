#!/usr/bin/env bash
# Creates .venv with the whole stack, once. CPU machines get the CPU wheels of torch and fbgemm;
# machines with an NVIDIA GPU get the CUDA builds. torchrec is installed with --no-deps because its
# metadata asks for the CUDA fbgemm-gpu, which clashes with the CPU wheel.
set -euo pipefail
cd "$(dirname "$0")/.."

TORCH_VERSION=2.13.0
FBGEMM_VERSION=1.8.0
TORCHREC_VERSION=1.8.0
VENV=${VENV:-.venv}
STAMP="$VENV/.installed-$TORCH_VERSION-$FBGEMM_VERSION-$TORCHREC_VERSION-$(sha1sum scripts/requirements.txt pyproject.toml | sha1sum | cut -c1-12)"

if [ -f "$STAMP" ]; then
  exit 0
fi

python3 -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
$PIP install -q --upgrade pip

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  echo "setup: NVIDIA GPU found, installing CUDA builds"
  $PIP install -q "torch==$TORCH_VERSION" "fbgemm-gpu==$FBGEMM_VERSION"
else
  echo "setup: no GPU, installing CPU builds"
  $PIP install -q "torch==$TORCH_VERSION" "fbgemm-gpu-cpu==$FBGEMM_VERSION"
fi
$PIP install -q --no-deps "torchrec==$TORCHREC_VERSION"
$PIP install -q -r scripts/requirements.txt
$PIP install -q --no-deps -e .
touch "$STAMP"
echo "setup: done ($VENV)"
