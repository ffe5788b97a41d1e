"""The HTTP endpoint on LitServe: ``POST /predict`` answers ``{"score": float, "version": int}``; ``GET /health``.

Requests are batched dynamically (LitServe's ``max_batch_size`` / ``batch_timeout``): the rows of requests
that arrive together run through the model as one batch, and each answer names the model version that
computed it. A malformed request gets HTTP 400 with a message naming the field at fault; the other requests
of its batch are answered as usual. With a folder of deltas the inference worker's :class:`Predictor` applies
each new version between two batches (see its docstring).
"""
from __future__ import annotations

import logging
import os
import signal
from typing import Any, Callable, Optional, Sequence

import litserve as ls
import torch
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from lightning_persia.serving.bundle import DENSE_FILE, Bundle
from lightning_persia.serving.decoding import CriteoRequestDecoder, RequestDecoder, RequestError
from lightning_persia.serving.predictor import Predictor

DecoderFactory = Callable[[Predictor], RequestDecoder]


class PredictAPI(ls.LitAPI):
    """LitServe API of a bundle: one :class:`Predictor` per inference worker, built in :meth:`setup`.

    Args:
        bundle: the bundle's folder.
        ps_addresses: inference shards serving it; ``None`` starts them in the worker.
        decoder: ``f(predictor) -> RequestDecoder`` for this model's requests (default: the
            :class:`CriteoRequestDecoder` of the module's features).
        max_batch_size, batch_timeout: LitServe's dynamic batching (at most this many requests per batch,
            gathered for at most this many seconds).
        predictor_options: more arguments of :meth:`Predictor.from_bundle` (``wire_dtype``, ``num_shards``, ...).
        torch_threads: intra-op threads of the inference worker; 0 keeps torch's default. Batches of a few rows
            gain nothing from more, and on cores shared with the shards more threads wait on each other (one
            row took 9 ms with 1 thread, 27 ms with 2, on 2 busy cores).
        log_level: the level of the worker's ``lightning_persia`` log on stderr (the versions it applies, the
            deltas it refuses); ``None`` leaves logging as it is.
    """

    def __init__(
        self,
        bundle: str | os.PathLike,
        *,
        ps_addresses: Optional[Sequence[str]] = None,
        decoder: DecoderFactory = CriteoRequestDecoder.from_predictor,
        max_batch_size: int = 32,
        batch_timeout: float = 0.002,
        predictor_options: Optional[dict[str, Any]] = None,
        torch_threads: int = 1,
        log_level: Optional[str] = None,
    ) -> None:
        super().__init__(max_batch_size=max_batch_size, batch_timeout=batch_timeout)
        if torch_threads < 0:
            raise ValueError(f"torch_threads must be >= 0, got {torch_threads}")
        self.torch_threads = torch_threads
        self.bundle_path = str(bundle)
        self.ps_addresses = list(ps_addresses) if ps_addresses else None
        self.decoder_factory = decoder
        self.predictor_options = dict(predictor_options or {})
        self.log_level = log_level
        self._predictor: Optional[Predictor] = None
        self._decoder: Optional[RequestDecoder] = None

    def setup(self, device: str) -> None:
        if self.log_level is not None:  # the worker is a process of its own: its log goes to stderr like the server's
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("%(asctime)s lightning-persia serve %(levelname)s %(message)s"))
            logger = logging.getLogger("lightning_persia")
            logger.addHandler(handler)
            logger.setLevel(self.log_level)
            logger.propagate = False  # LitServe's worker may log the root logger too: each line once
        if self.torch_threads:
            torch.set_num_threads(self.torch_threads)
        self._predictor = Predictor.from_bundle(self.bundle_path, self.ps_addresses, **self.predictor_options)
        self._decoder = self.decoder_factory(self._predictor)

    # The annotation makes FastAPI parse the body as a JSON object before it is queued (see serve()).
    def decode_request(self, request: dict) -> Any:
        try:
            return self._decoder.decode(request)
        except RequestError as err:  # answered alone in encode_response: the rest of the batch goes on
            return err

    def batch(self, inputs: list) -> list:
        return list(inputs)

    def predict(self, inputs: Any) -> Any:
        batched = self.max_batch_size > 1
        inputs = inputs if batched else [inputs]
        rows = [x for x in inputs if not isinstance(x, RequestError)]
        answers = iter(())
        if rows:
            prediction = self._predictor.predict(self._decoder.collate(rows))
            scores = self._decoder.scores(prediction.output, len(rows))
            answers = iter({"score": score, "version": prediction.version} for score in scores)
        outputs = [x if isinstance(x, RequestError) else next(answers) for x in inputs]
        return outputs if batched else outputs[0]

    def unbatch(self, output: list) -> list:
        return output

    def encode_response(self, output: Any) -> Any:
        if isinstance(output, RequestError):
            return JSONResponse({"detail": str(output)}, status_code=400)
        return output


def build_server(api: PredictAPI, *, timeout_s: float = 30.0) -> ls.LitServer:
    """The LitServer of ``api``: ``/predict``, ``/health``, and ``/info`` (the bundle, its version, the deltas' folder)."""
    bundle = Bundle.open(api.bundle_path)
    bundle.verify([DENSE_FILE])  # fail here, with the reason, rather than in the worker
    server = ls.LitServer(
        api, accelerator="cpu", devices=1, workers_per_device=1, timeout=timeout_s,
        model_metadata={"bundle": str(bundle.path), "bundle_version": bundle.version, "module": bundle.module_class_path,
                        "deltas": str(api.predictor_options["deltas"]) if api.predictor_options.get("deltas") else None},
    )
    server.app.add_exception_handler(RequestValidationError, _bad_body)
    return server


def serve(
    bundle: str | os.PathLike,
    *,
    port: int = 8000,
    host: str = "127.0.0.1",
    timeout_s: float = 30.0,
    **api_options: Any,
) -> None:
    """Serves the bundle over HTTP until interrupted (``api_options``: those of :class:`PredictAPI`).

    Example::

        serve("runs/dlrm/bundle", port=8000, max_batch_size=64)
    """
    server = build_server(PredictAPI(bundle, **api_options), timeout_s=timeout_s)
    # LitServe shuts its workers down on KeyboardInterrupt only; a SIGTERM (kill, Kubernetes) must do the same.
    signal.signal(signal.SIGTERM, _interrupt)
    server.run(host=host, port=port, num_api_servers=1, generate_client_file=False)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


async def _bad_body(request: Request, exc: RequestValidationError) -> JSONResponse:
    """A body that is not a JSON object: HTTP 400 (FastAPI's default is 422) with what is wrong where."""
    problems = []
    for error in exc.errors():
        location = ".".join(str(part) for part in error.get("loc", ()) if part != "body") or "body"
        if error.get("type") == "json_invalid":
            detail = (error.get("ctx") or {}).get("error", "")
            problems.append(f"body: not valid JSON ({detail} at character {location})" if detail else "body: not valid JSON")
        elif error.get("type") == "dict_type":
            sent = request.headers.get("content-type") or "no Content-Type"
            problems.append(f"body: must be a JSON object sent as Content-Type: application/json (got {sent})")
        else:
            problems.append(f"{location}: {error.get('msg')}")
    return JSONResponse({"detail": "; ".join(problems)}, status_code=400)
