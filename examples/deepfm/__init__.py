from examples.deepfm.model import DeepFM

__all__ = ["DeepFM"]
