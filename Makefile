# The two commands of the README. Both install the stack into .venv first if it is missing (scripts/setup.sh).
PY := .venv/bin/python

.PHONY: setup test demo

setup:
	@bash scripts/setup.sh

test: setup
	$(PY) -m pytest -q tests

demo: setup
	$(PY) -m lightning_persia.cli fit --config examples/dlrm/config.yaml --config examples/dlrm/demo.yaml
