# The two commands of the README. Both install the stack into .venv first if it is missing (scripts/setup.sh)
# and build the native kernels of this checkout (setup.py; a no-op without a C compiler).
PY := .venv/bin/python

.PHONY: setup native test demo

setup:
	@bash scripts/setup.sh

native: setup
	@rm -f lightning_persia/ops/native/_kernels_*.so
	@$(PY) setup.py -q build_ext --inplace

test: native
	$(PY) -m pytest -q tests

demo: native
	$(PY) -m lightning_persia.cli fit --config examples/dlrm/config.yaml --config examples/dlrm/demo.yaml
