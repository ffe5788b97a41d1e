"""Helpers of benchmarks/train_bench.py."""
