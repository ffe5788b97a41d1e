"""Runs launched the way a cluster launches them: hosts as network namespaces (``multihost.py``)."""
