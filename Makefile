# The two commands of the README. Both install the stack into .venv first if it is missing (scripts/setup.sh)
# and build the native kernels of this checkout (setup.py; without a C compiler the tensor fallback runs).
PY := .venv/bin/python

.PHONY: setup native test scenarios demo

setup:
	@bash scripts/setup.sh

# A source checkout's kernels: built in place, from whatever kernels.c holds now (a library built from another
# version of it is never loaded).
native:
	@rm -f lightning_persia/ops/native/_kernels_*.so
	@$(PY) setup.py -q build_ext --inplace

test: setup native
	$(PY) -m pytest -q tests -m "not scenario"

# The long scenario runs (minutes each: many kills, longer streams); CI runs them after `make test`.
scenarios: setup native
	$(PY) -m pytest -q tests -m scenario

demo: setup native
	$(PY) -m lightning_persia.cli fit --config examples/dlrm/config.yaml --config examples/dlrm/demo.yaml
