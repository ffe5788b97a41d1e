"""Tensor kernels shared by the trainer and the parameter server: hashing, dedup, wire codecs, pooled lookup."""
