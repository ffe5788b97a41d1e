"""Fuzz a real shard's RPCs: random bytes, mutated and malformed protobufs, huge counts, overflowing length
fields, odd sizes, unknown tables, bad table configs, bad checkpoint paths; with and without a token.

Starts one shard (``max_ids_per_request=4096``, ``max_message_mb=4``, ``max_tables=64``, ``checkpoint_root`` a
scratch folder), prepares a *sentinel* table, then sends ``--cases`` Hypothesis-generated requests raw (no
client-side validation) and checks every answer: a status in {OK, INVALID_ARGUMENT, NOT_FOUND,
RESOURCE_EXHAUSTED, FAILED_PRECONDITION, ABORTED, PERMISSION_DENIED, UNAUTHENTICATED} with a message, never
INTERNAL/UNKNOWN, never a hang (10 s deadline per call). Every 1,000 cases and at the end: the shard serves,
the sentinel's rows and counters are unchanged. Then a few fixed cases: messages over the gRPC limit, and
every RPC with a missing or wrong token on a token shard.

    .venv/bin/python -m tools.fuzz_ps                  # 10,000 cases (about 1-2 minutes here)
    .venv/bin/python -m tools.fuzz_ps --cases 50000 --max-seconds 900

Exit status 1 on any finding.
"""
from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time

import grpc
from hypothesis import HealthCheck, given, settings

from lightning_persia.remote_ps.protocol import bearer_metadata
from lightning_persia.remote_ps.protocol import persia_pb2 as pb
from lightning_persia.remote_ps.launcher import LocalShards
from lightning_persia.testing.fuzz import METHODS, FuzzTarget, fuzz_cases


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", type=int, default=10_000)
    parser.add_argument("--max-seconds", type=float, default=600.0, help="stop generating after this long")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    scratch = tempfile.mkdtemp(prefix="persia-fuzz-")
    findings: list[str] = []
    overrides = ["max_ids_per_request=4096", "max_message_mb=4", "max_tables=64", f"checkpoint_root={scratch}", "seed=3"]
    shards = LocalShards(1, overrides=overrides)
    token_shard = LocalShards(1, overrides=overrides, extra_args=["--token", "fuzz-token"])
    try:
        pid = shards.processes[0].pid
        target = FuzzTarget(shards.addresses[0])
        target.prepare()
        rss_start = rss_mb(pid)
        started = time.monotonic()
        print(f"fuzzing {shards.addresses[0]} with {args.cases} cases (seed {args.seed}, at most {args.max_seconds:.0f} s)", flush=True)

        @settings(max_examples=args.cases, deadline=None, database=None, derandomize=False,
                  suppress_health_check=list(HealthCheck))
        @given(case=fuzz_cases(scratch))
        def one(case) -> None:
            if time.monotonic() - started > args.max_seconds:
                return
            target.send(*case)
            if target.cases % 1000 == 0:
                target.check_intact()
                print(f"  {target.cases} cases, {time.monotonic() - started:.0f} s, shard RSS {rss_mb(pid):.0f} MB, "
                      f"findings {len(target.findings)}", flush=True)

        import random
        random.seed(args.seed)
        one()
        target.check_intact()
        fuzz_seconds = time.monotonic() - started
        findings += target.findings

        # ---- fixed cases ----------------------------------------------------------------------------
        fixed: list[tuple[str, str, str]] = []
        big = pb.LookupRequest(packed=pb.PackedIds(tables=["fuzz_t4"], counts=[5 << 17], ids=b"\0" * (5 << 20))).SerializeToString()
        code = target.send("Lookup", big, "over_message_limit")
        fixed.append(("Lookup of 5 MB (limit 4 MB)", code.name, "RESOURCE_EXHAUSTED"))
        protected = FuzzTarget(token_shard.addresses[0], token="fuzz-token")
        protected.prepare()
        for token in (None, "wrong"):
            raw = grpc.insecure_channel(token_shard.addresses[0])
            metadata = bearer_metadata(token) or None
            for method in METHODS:
                request = {"Save": pb.SaveRequest(directory=f"{scratch}/intruder"), "Load": pb.LoadRequest(directory=f"{scratch}/x"),
                           "Configure": pb.ConfigureRequest(tables_json=['{"name": "intruder", "dim": 4}'])}.get(method)
                data = request.SerializeToString() if request is not None else b""
                try:
                    raw.unary_unary(f"/persia.ParameterServer/{method}")(data, timeout=10, metadata=metadata)
                    got = "OK"
                except grpc.RpcError as err:
                    got = err.code().name
                fixed.append((f"{method} with {'no' if token is None else 'a wrong'} token", got, "UNAUTHENTICATED"))
            raw.close()
        protected.check_intact()
        import os
        if os.path.exists(f"{scratch}/intruder"):
            findings.append("a Save without the token wrote files")
        for what, got, want in fixed:
            if got != want:
                findings.append(f"{what}: {got}, expected {want}")
        target.check_intact()
        rss_end = rss_mb(pid)

        print()
        print(target.summary())
        print()
        print(f"{'fixed case':<42} {'status':<20} expected")
        for what, got, want in fixed:
            print(f"{what:<42} {got:<20} {want}")
        print()
        print(f"cases: {target.cases} ({fuzz_seconds:.0f} s of fuzzing); shard alive: {shards.alive() == [True]}; "
              f"sentinel rows and counters unchanged: yes; shard RSS {rss_start:.0f} MB -> {rss_end:.0f} MB")
        print(f"findings: {len(findings)}")
        for finding in findings[:50]:
            print("  " + finding)
        target.close()
        protected.close()
        return 1 if findings or shards.alive() != [True] else 0
    finally:
        shards.stop()
        token_shard.stop()
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
