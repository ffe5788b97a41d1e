"""The write-ahead log's benchmark (``wal_bench.py``) and its parts: the training run it starts (``train.py``), the
replication lag it reads (``lag.py``) and the comparison of results (``compare.py``)."""
