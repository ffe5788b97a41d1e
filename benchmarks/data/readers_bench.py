"""How fast the file readers turn rows into batches, on one core (as a DataLoader worker runs them).

- **Criteo TSV**: the synthetic stream written as Criteo TSV, parsed in batches of ``--batch-size`` lines by the line
  parser (``parse_criteo_lines``) and by the ``pyarrow.csv`` tokeniser the reader uses; then the reader end to end;
- **binary days**: a day in TorchRec's one-hot layout and the same rows in MLPerf DLRM-DCNv2's multi-hot layout
  (``day_N_sparse_multi_hot.npz``, MLPerf's 1 to 100 ids a feature, 214 a row), read by ``CriteoBinaryDataset``.

    .venv/bin/python -m benchmarks.data.readers_bench [--rows 100000] [--batch-size 4096] [--json]
"""

import argparse
import json
import os
import tempfile
import time

import numpy as np
import torch

from lightning_persia.data import CriteoBinaryDataset, CriteoIterableDataset, SyntheticCriteo
from lightning_persia.data.criteo import _HASHED, _tokenised, parse_criteo_lines

#: MLPerf DLRM-DCNv2's ids per row of each feature (its --multi_hot_sizes)
MULTI_HOT_SIZES = [3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3, 1, 1]


def _best_rate(rows: int, run, repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - started)
    return rows / best


def tsv_rates(directory: str, rows: int, batch_size: int) -> dict:
    path = SyntheticCriteo(cardinality_scale=0.01).write_tsv(os.path.join(directory, "day.tsv"), rows)
    with open(path, "rb") as handle:
        lines = handle.readlines()
    chunks = [lines[i : i + batch_size] for i in range(0, len(lines), batch_size)]
    tokenised = [_tokenised(chunk, _HASHED) for chunk in chunks]
    if any(t is None for t in tokenised):
        raise RuntimeError("the tokeniser refused a well-formed chunk")
    return {
        "tsv_line_parser_rows_per_s": _best_rate(rows, lambda: [parse_criteo_lines(chunk) for chunk in chunks]),
        "tsv_pyarrow_rows_per_s": _best_rate(rows, lambda: [_tokenised(chunk, _HASHED) for chunk in chunks]),
        "tsv_reader_rows_per_s": _best_rate(rows, lambda: sum(b.batch_size for b in CriteoIterableDataset([path], batch_size=batch_size))),
    }


def binary_rates(directory: str, rows: int, batch_size: int) -> dict:
    rng = np.random.default_rng(0)
    prefix = os.path.join(directory, "day_0")
    np.save(f"{prefix}_dense.npy", rng.random((rows, 13), dtype=np.float32))
    np.save(f"{prefix}_labels.npy", rng.integers(0, 2, (rows, 1), dtype=np.int32))
    np.save(f"{prefix}_sparse.npy", rng.integers(0, 100_000, (rows, 26), dtype=np.int32))
    multi = os.path.join(directory, "multi_hot")
    os.makedirs(multi, exist_ok=True)
    multi_prefix = os.path.join(multi, "day_0")
    np.savez(f"{multi_prefix}_sparse_multi_hot.npz", **{str(f): rng.integers(0, 100_000, (rows, k), dtype=np.int32)
                                                       for f, k in enumerate(MULTI_HOT_SIZES)})
    for part in ("dense", "labels"):
        os.link(f"{prefix}_{part}.npy", f"{multi_prefix}_{part}.npy")

    def read(day: str):
        return lambda: sum(b.batch_size for b in CriteoBinaryDataset([day], batch_size=batch_size))

    return {"binary_one_hot_rows_per_s": _best_rate(rows, read(prefix)),
            "binary_multi_hot_rows_per_s": _best_rate(rows, read(multi_prefix))}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--batch-size", type=int, default=4096)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.rows < 1 or args.batch_size < 1:
        parser.error(f"--rows and --batch-size must be >= 1, got {args.rows} and {args.batch_size}")
    torch.set_num_threads(1)  # a DataLoader worker's
    with tempfile.TemporaryDirectory() as directory:
        out = {"rows": args.rows, "batch_size": args.batch_size, **tsv_rates(directory, args.rows, args.batch_size),
               **binary_rates(directory, args.rows, args.batch_size), "load_average_1m": os.getloadavg()[0],
               "cpus": os.cpu_count()}
    print(json.dumps(out) if args.json else "\n".join(f"{k}: {v:,.0f}" if isinstance(v, float) and v > 100 else f"{k}: {v}"
                                                        for k, v in out.items()))
    return out


if __name__ == "__main__":
    main()
