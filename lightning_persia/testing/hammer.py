"""A load client for exactness checks: pushes known SGD gradients, so that the final rows are known exactly.

Client ``k`` at step ``s`` sends, for every table, :func:`step_ids` (with duplicates) and gradient rows all
equal to :func:`step_value`; with ``SGD(lr=1)`` and ``Constant(0)`` rows, row ``i`` ends at
``-sum(step_value(k, s) * count of i in step_ids(k, s))`` over every client and step: small integers, exact
in float32 whatever the order the shard applies them in. A lost update or one applied twice shows.

Run one client per process (what the tests and ``tools/ps_soak.py`` do)::

    python -m lightning_persia.testing.hammer --addresses 127.0.0.1:5000,127.0.0.1:5001 --client 0 --steps 200 \\
        --tables load_a,load_b [--drop-probability 0.01]

It prints one JSON line with what it did.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Sequence

import torch

NUM_IDS = 4096
IDS_PER_STEP = 256
DIM = 8


def step_ids(client: int, step: int, num_ids: int = NUM_IDS, count: int = IDS_PER_STEP) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1_000_003 * client + step)
    return torch.randint(0, num_ids, (count,), generator=generator)


def step_value(client: int, step: int) -> float:
    return float(client + 1 + step % 5)


def expected_rows(clients: Sequence[int], steps: int, num_ids: int = NUM_IDS, dim: int = DIM) -> torch.Tensor:
    """The rows every table must hold after ``steps`` steps of each client in ``clients``."""
    total = torch.zeros(num_ids, dtype=torch.float64)
    for client in clients:
        for step in range(steps):
            total.index_add_(0, step_ids(client, step, num_ids), torch.full((IDS_PER_STEP,), step_value(client, step), dtype=torch.float64))
    return (-total).to(torch.float32).unsqueeze(1).expand(num_ids, dim).contiguous()


def run(addresses: list[str], client_index: int, steps: int, tables: list[str], *, drop_probability: float = 0.0,
        in_flight: int = 4, seed: int = 0, max_retries: int = 60) -> dict:
    from lightning_persia.remote_ps.client import PSClient
    from lightning_persia.testing.chaos_proxy import ChaosProxy

    proxies = [ChaosProxy(a, drop_probability=drop_probability, seed=seed * 100 + i) for i, a in enumerate(addresses)] if drop_probability else []
    targets = [p.address for p in proxies] or addresses
    client = PSClient(targets, timeout_s=20, max_retries=max_retries, backoff_s=0.02, max_backoff_s=0.5)
    started = time.perf_counter()
    pending = []
    try:
        for step in range(steps):
            ids = step_ids(client_index, step)
            grads = torch.full((ids.numel(), DIM), step_value(client_index, step))
            if step % 8 == 0:  # lookups in between, as a trainer does
                client.lookup({t: torch.unique(ids) for t in tables}, train=True, wire_dtype="fp32")
            pending.append(client.update_async({t: (ids, grads) for t in tables}, wire_dtype="fp32"))
            if len(pending) >= in_flight:
                pending.pop(0).result()
        for future in pending:
            future.result()
    finally:
        client.close()
        for proxy in proxies:
            proxy.close()
    return {
        "client": client_index, "steps": steps, "seconds": round(time.perf_counter() - started, 3),
        "client_id": client.client_id, "connections": sum(p.connections for p in proxies), "dropped_connections": sum(p.dropped for p in proxies),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--addresses", required=True)
    parser.add_argument("--client", type=int, required=True)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--tables", default="load_a,load_b")
    parser.add_argument("--drop-probability", type=float, default=0.0)
    parser.add_argument("--in-flight", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    result = run(args.addresses.split(","), args.client, args.steps, args.tables.split(","),
                 drop_probability=args.drop_probability, in_flight=args.in_flight, seed=args.seed)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
