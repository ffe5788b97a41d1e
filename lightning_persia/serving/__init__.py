"""Serving a model trained with PersiaStrategy: export a bundle, predict from it, serve it over HTTP.

    lightning-persia export --ckpt runs/dlrm/checkpoints/last.ckpt --out runs/dlrm/bundle
    lightning-persia serve runs/dlrm/bundle --port 8000
    curl -X POST localhost:8000/predict -d '{"sparse": {"cat_0": [17], ...}, "dense": [0.5, ...]}'

* :func:`export_bundle`: a checkpoint -> a self-contained, checksummed :class:`Bundle`.
* :class:`Predictor`: the bundle's module answering batches without a Trainer, its tables on read-only shards.
* :class:`PredictAPI` / :func:`serve`: the LitServe endpoint (``POST /predict``, ``GET /health``).
* :class:`PublishDeltas`: a training callback publishing versioned deltas; :class:`Delta`, :class:`DeltaWatcher`:
  reading and applying them in order (the predictor and ``--watch-deltas`` shards do).

Names are imported on first use: a parameter-server shard reads bundles (``serving.bundle``) without
importing Lightning.
"""
import importlib

__all__ = ["Bundle", "BundleError", "export_bundle", "Predictor", "Prediction", "ServingError", "PredictAPI", "serve",
           "RequestDecoder", "CriteoRequestDecoder", "RequestError", "PublishDeltas", "Delta", "DeltaError", "DeltaWatcher"]

_WHERE = {
    "Bundle": "lightning_persia.serving.bundle",
    "BundleError": "lightning_persia.serving.bundle",
    "export_bundle": "lightning_persia.serving.export",
    "Predictor": "lightning_persia.serving.predictor",
    "Prediction": "lightning_persia.serving.predictor",
    "ServingError": "lightning_persia.serving.predictor",
    "PublishDeltas": "lightning_persia.serving.publish",
    "Delta": "lightning_persia.serving.delta",
    "DeltaError": "lightning_persia.serving.delta",
    "DeltaWatcher": "lightning_persia.serving.delta",
    "RequestDecoder": "lightning_persia.serving.decoding",
    "CriteoRequestDecoder": "lightning_persia.serving.decoding",
    "RequestError": "lightning_persia.serving.decoding",
    "PredictAPI": "lightning_persia.serving.endpoint",
    "serve": "lightning_persia.serving.endpoint",
}


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'lightning_persia.serving' has no attribute {name!r}")
