"""Helpers shared by benchmarks of several subjects: the host probe (``host_probe.py``) and the emulated networks
(``netem.py``, with its delaying forwarder ``delay_proxy.py``)."""
