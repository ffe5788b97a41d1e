"""Serving benchmarks: the HTTP endpoint's rates (``serve_bench.py``) and online deltas (``delta_bench.py``)."""
