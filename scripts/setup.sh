#!/usr/bin/env bash
# Creates .venv with the whole stack, once. CPU machines get the CPU wheels of torch and fbgemm;
# machines with an NVIDIA GPU get the CUDA builds. torchrec is installed last and with --no-deps: its
# metadata asks for the CUDA package fbgemm-gpu, which clashes with the CPU wheel fbgemm-gpu-cpu (the same
# library). pip checks dependencies only on installs that resolve them, so the --no-deps install of torchrec
# reports nothing; a later `pip install` or `pip check` in this venv says "torchrec 1.8.0 requires
# fbgemm-gpu, which is not installed": expected, and harmless (README, "Install").
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

echo "setup: creating $VENV (a few minutes, once: torch, FBGEMM, TorchRec, Lightning, gRPC)"
python3 -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
$PIP install --upgrade pip

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  echo "setup: [1/4] NVIDIA GPU found, installing the CUDA builds of torch and FBGEMM"
  $PIP install "torch==$TORCH_VERSION" "fbgemm-gpu==$FBGEMM_VERSION"
else
  echo "setup: [1/4] no GPU, installing the CPU builds of torch and FBGEMM"
  $PIP install "torch==$TORCH_VERSION" "fbgemm-gpu-cpu==$FBGEMM_VERSION"
fi
echo "setup: [2/4] Lightning, gRPC and the rest of scripts/requirements.txt"
$PIP install -r scripts/requirements.txt
echo "setup: [3/4] TorchRec (without its dependencies: see the top of this script)"
$PIP install --no-deps "torchrec==$TORCHREC_VERSION"
echo "setup: [4/4] lightning-persia itself (editable)"
$PIP install --no-deps -e .
touch "$STAMP"
echo "setup: done ($VENV)"
