#!/usr/bin/env bash
# Creates .venv with the whole stack, once: the package in editable mode (which builds its native kernels) with its
# "test" extra, at the one known-good set of releases of scripts/constraints/known-good.txt (pyproject.toml declares
# the ranges the package supports), and FBGEMM's build for this machine: the "cuda" extra where an NVIDIA GPU
# answers, else the "cpu" extra plus TorchRec installed last and without its dependencies: its metadata asks for the
# CUDA package fbgemm-gpu, which clashes with the CPU wheel fbgemm-gpu-cpu (the same library; TorchRec's other
# dependencies are the package's own). pip checks dependencies only on installs that resolve them, so that install
# reports nothing; a later `pip install` or `pip check` in this venv says "torchrec 1.8.0 requires fbgemm-gpu, which
# is not installed": expected, and harmless (README, "Install").
#
# CONSTRAINTS=scripts/constraints/oldest.txt VENV=... installs another set the same way (scripts/oldest_env.sh).
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
CONSTRAINTS=${CONSTRAINTS:-scripts/constraints/known-good.txt}
STAMP="$VENV/.installed-$(cat pyproject.toml setup.py "$CONSTRAINTS" | sha1sum | cut -c1-12)"

if [ -f "$STAMP" ]; then
  exit 0
fi

echo "setup: creating $VENV (a few minutes, once: torch, FBGEMM, TorchRec, Lightning, gRPC; releases of $CONSTRAINTS)"
python3 -m venv "$VENV"
PY="$VENV/bin/python"
PIP="$PY -m pip"
echo "setup: [1/3] pip"
$PIP install --upgrade pip

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  echo "setup: [2/3] NVIDIA GPU found: torch, FBGEMM (CUDA), TorchRec, Lightning, gRPC and lightning-persia (editable)"
  $PIP install -c "$CONSTRAINTS" -e ".[cuda,test]"
else
  echo "setup: [2/3] no GPU: torch, FBGEMM (CPU), Lightning, gRPC and lightning-persia (editable)"
  $PIP install -c "$CONSTRAINTS" -e ".[cpu,test]"
  echo "setup: [3/3] TorchRec (without its dependencies: see the top of this script)"
  $PIP install --no-deps "$("$PY" scripts/pinned.py torchrec "$CONSTRAINTS")"
fi
touch "$STAMP"
echo "setup: done ($VENV)"
