"""Data-side benchmarks: how fast the file readers turn stored rows into batches (``readers_bench.py``)."""
