"""Parameter-server benchmarks: a shard's RPC rates (``ps_bench.py``), one shard at scale (``scale_bench.py``) and
its allocators against each other (``malloc_bench.py``)."""
