from examples.dlrm.model import DLRM

__all__ = ["DLRM"]
