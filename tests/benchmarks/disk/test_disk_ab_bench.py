"""Smoke tests of benchmarks/disk/disk_ab_bench.py: a tiny run of three real shards, each running the package of its own
folder, prints the rates and its JSON; an unknown baseline and a budget smaller than a request are named."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from benchmarks.disk import disk_ab_bench
from benchmarks.ps.scale_bench import TABLE


def test_tiny_run_prints_both_disk_tables_rates_against_each_other_and_the_memory_table(tmp_path, capsys):
    assert disk_ab_bench.main(["--baseline", "HEAD", "--disk-dir", str(tmp_path), "--rows", "2e4", "--memory-rows", "1e4",
                               "--warmup", "25", "--repeats", "50", "--request-ids", "4096", "--memory-table", "--json"]) == 0
    out = capsys.readouterr().out
    figures = json.loads(out.strip().splitlines()[-1])
    assert figures["rows"] == 20000 and figures["baseline"] == "HEAD"
    shards = figures["shards"]
    assert list(shards) == ["baseline", "this checkout", "memory"]
    for one in shards.values():
        assert one["zipf_rows_per_s"] > 0
        assert one["over_memory"] == pytest.approx(one["zipf_rows_per_s"] / shards["memory"]["zipf_rows_per_s"])
    changed = shards["this checkout"]
    assert changed["over_first"] == pytest.approx(changed["zipf_rows_per_s"] / shards["baseline"]["zipf_rows_per_s"])
    assert len(changed["turns_over_first"]) == 2  # 50 timed requests: two turns of 25 a shard
    for name in ("this checkout", "memory"):  # the baseline's code may predate the counts (NaN then)
        for figure in ("lock_wait_ms_per_request", "demoter_cpu_ms_per_request"):
            assert math.isfinite(shards[name][figure]) and shards[name][figure] >= 0.0, (name, figure)
    assert shards["memory"]["demoter_cpu_ms_per_request"] == 0.0  # the memory table's shard has no demoter at work
    assert "this checkout over the baseline:" in out
    assert list(tmp_path.iterdir()) == []  # the baseline's package and the tiers are gone


def test_without_the_memory_table_two_shards_run_and_no_ratio_to_it_is_given(tmp_path, capsys):
    assert disk_ab_bench.main(["--baseline", "HEAD", "--disk-dir", str(tmp_path), "--rows", "2e4", "--memory-rows", "1e4",
                               "--warmup", "0", "--repeats", "25", "--request-ids", "4096", "--json"]) == 0
    shards = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["shards"]
    assert list(shards) == ["baseline", "this checkout"] and not any("over_memory" in one for one in shards.values())


def test_the_baseline_may_demote_by_another_policy_than_the_checkout(tmp_path, capsys, monkeypatch):
    started = {}
    real_start = disk_ab_bench.start

    def start(tree, memory_rows, disk_dir, eviction):
        started[tree == disk_ab_bench._CHECKOUT] = eviction
        return real_start(tree, memory_rows, disk_dir, eviction)

    monkeypatch.setattr(disk_ab_bench, "start", start)
    assert disk_ab_bench.main(["--baseline", "HEAD", "--disk-dir", str(tmp_path), "--rows", "2e4", "--memory-rows", "1e4",
                               "--warmup", "0", "--repeats", "25", "--request-ids", "4096", "--eviction", "lfu",
                               "--baseline-eviction", "lru", "--json"]) == 0
    out = capsys.readouterr().out
    assert started == {False: "lru", True: "lfu"}
    figures = json.loads(out.strip().splitlines()[-1])
    assert (figures["baseline_eviction"], figures["eviction"]) == ("lru", "lfu")
    assert "HEAD (lru) against this checkout (lfu)" in out


def test_each_shard_runs_the_package_of_its_own_folder(tmp_path, monkeypatch):
    tree = disk_ab_bench.baseline_tree("HEAD", tmp_path / "tree")
    monkeypatch.chdir(disk_ab_bench._CHECKOUT)  # where the checkout's package would come first on a shard's path
    shards = disk_ab_bench.start(tree, 10_000, tmp_path / "tier", "lru")
    try:
        shards.client.lookup({TABLE: torch.arange(100)}, train=True)  # a disk table: the kernels loaded
        maps = Path(f"/proc/{shards.pids[0]}/maps").read_text()
    finally:
        shards.close()
    kernels = {line.split()[-1] for line in maps.splitlines() if "/_kernels_" in line}
    assert kernels and all(path.startswith(str(tree)) for path in kernels)


def test_a_baseline_that_is_not_a_commit_is_named(tmp_path):
    with pytest.raises(SystemExit, match="--baseline 'no-such-commit' is not a commit"):
        disk_ab_bench.baseline_tree("no-such-commit", tmp_path / "tree")


def test_a_memory_budget_smaller_than_a_request_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        disk_ab_bench.main(["--baseline", "HEAD", "--disk-dir", str(tmp_path), "--rows", "2e4", "--memory-rows", "1e3",
                            "--request-ids", "4096"])
    assert "--memory-rows (1000) must hold a request (--request-ids 4096)" in capsys.readouterr().err
