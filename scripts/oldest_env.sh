#!/usr/bin/env bash
# Installs the oldest supported releases (scripts/constraints/oldest.txt: torch 2.11, FBGEMM 1.6.0, TorchRec 1.6.1,
# Lightning 2.6.0) into a second virtualenv the way scripts/setup.sh installs the known-good set, and runs the fast
# subset of the tests listed in scripts/oldest_subset.txt there. CI runs it after `make test`.
#
# PyPI has no CPU build of torch 2.11, only its CUDA 13 build: about 3.5 GB downloaded (pip's cache keeps it for the
# next run) and 4.8 GB installed, which runs on a machine without a GPU. The virtualenv goes under $TMPDIR (or /tmp)
# and is removed at the end unless OLDEST_VENV names one to keep; each stage prints its time.
#
#   bash scripts/oldest_env.sh                            # install, run the subset, remove the virtualenv
#   OLDEST_VENV=DIR bash scripts/oldest_env.sh install    # only install into DIR (CI: in the background, while the
#   OLDEST_VENV=DIR bash scripts/oldest_env.sh test       # main suite runs), then only run the subset there
set -euo pipefail
cd "$(dirname "$0")/.."
STAGE=${1:-all}
case "$STAGE" in all | install | test) ;; *) echo "oldest_env.sh: unknown stage '$STAGE' (all, install or test)" >&2; exit 2 ;; esac
if [ "$STAGE" != all ] && [ -z "${OLDEST_VENV:-}" ]; then
  echo "oldest_env.sh: the '$STAGE' stage needs OLDEST_VENV (the virtualenv both stages use)" >&2
  exit 2
fi
VENV=${OLDEST_VENV:-${TMPDIR:-/tmp}/lightning-persia-oldest-$$}
if [ -z "${OLDEST_VENV:-}" ]; then
  trap 'rm -rf "$VENV" "$VENV.log"' EXIT
fi
if [ "$STAGE" != test ]; then
  START=$SECONDS
  VENV="$VENV" CONSTRAINTS=scripts/constraints/oldest.txt bash scripts/setup.sh >"$VENV.log" 2>&1 || { tail -40 "$VENV.log"; exit 1; }
  rm -f "$VENV.log"
  "$VENV/bin/python" - <<'PY'
from lightning_persia import _versions
print("oldest-env:", ", ".join(f"{name} {version}" for name, version in _versions.installed().items()))
PY
  echo "oldest-env: installed into $VENV ($(du -sm "$VENV" | cut -f1) MB) in $((SECONDS - START)) s"
fi
if [ "$STAGE" != install ]; then
  START=$SECONDS
  mapfile -t TESTS < <(grep -v '^#' scripts/oldest_subset.txt | grep .)
  "$VENV/bin/python" -m pytest -q -p no:cacheprovider -p no:warnings "${TESTS[@]}"
  echo "oldest-env: the subset ran in $((SECONDS - START)) s"
fi
