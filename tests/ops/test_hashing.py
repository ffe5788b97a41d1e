"""The mix hash is a fixed function: its tensor and Python versions agree."""
import torch

from lightning_persia.ops.hashing import mix64, mix64_int


def test_tensor_mix_equals_python_mix():
    ids = torch.tensor([0, 1, -1, 2**62, -(2**63), 2**63 - 1, 123456789])
    assert mix64(ids).tolist() == [mix64_int(i) for i in ids.tolist()]
