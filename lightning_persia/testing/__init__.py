"""Fault-injection helpers for tests and benchmarks (a TCP proxy that delays or severs connections, load clients).

Nothing in the library imports this package.
"""
