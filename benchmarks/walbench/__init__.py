"""Parts of ``benchmarks/wal_bench.py``: the training run it starts (``train.py``) and the comparison of results."""
