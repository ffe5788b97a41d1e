"""Trainer-side benchmarks (``train_bench.py``, ``pipeline_bench.py``, ``example_bench.py``, ``plan_bench.py``) and
the parts ``train_bench.py`` runs: one run in its own process (``run_one.py``), its data, models and probe."""
