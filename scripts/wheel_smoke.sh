#!/usr/bin/env bash
# Builds the package with `python -m build` (an sdist, then the wheel from it), installs the wheel into a fresh
# virtualenv the way the README's CPU install does (at the known-good releases), and runs scripts/smoke_test.py
# there, outside the checkout.
# Needs .venv (scripts/setup.sh) for `build`; prints how long each stage took.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
stage() { echo "wheel-smoke: $1 ($((SECONDS - START)) s)"; START=$SECONDS; }

START=$SECONDS
.venv/bin/python -m build --outdir "$WORK/dist" . >"$WORK/build.log" 2>&1 || { tail -40 "$WORK/build.log"; exit 1; }
WHEEL=$(ls "$WORK"/dist/*.whl)
stage "built $(basename "$WHEEL") and $(cd "$WORK/dist" && ls ./*.tar.gz | xargs -n1 basename)"
python3 -m venv "$WORK/venv"
PIP="$WORK/venv/bin/python -m pip"
{ $PIP install -c scripts/constraints/known-good.txt "$WHEEL[cpu]" && $PIP install --no-deps "$(python3 scripts/pinned.py torchrec)"; } >"$WORK/pip.log" 2>&1 \
  || { tail -40 "$WORK/pip.log"; exit 1; }
stage "installed it into a fresh virtualenv ($(du -sm "$WORK/venv" | cut -f1) MB)"
(cd "$WORK" && "$WORK/venv/bin/python" "$ROOT/scripts/smoke_test.py")
stage "smoke test"
