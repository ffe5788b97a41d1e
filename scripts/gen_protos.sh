#!/usr/bin/env bash
# Regenerates the Python stubs of the PS wire protocol (persia_pb2.py, persia_pb2_grpc.py, persia_pb2.pyi)
# with grpcio-tools. Run from anywhere; the generated files are committed.
# The include root is the repository root, so the stubs import each other as
# `from lightning_persia.remote_ps.protocol import persia_pb2` and need no patching.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
[ -x "$PYTHON" ] || PYTHON=python3
PROTO=lightning_persia/remote_ps/protocol/persia.proto
"$PYTHON" -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. "$PROTO"
echo "gen_protos: regenerated stubs of $PROTO"
