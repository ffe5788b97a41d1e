"""Disk tier benchmarks: two checkouts' disk tables against each other (``disk_ab_bench.py``), the tier against
embedded stores (``disk_store_bench.py``) and a profile of its Zipf lookups (``disk_zipf_profile.py``)."""
