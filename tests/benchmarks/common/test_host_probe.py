"""benchmarks/common/host_probe.py: its probes measure what they say, and bad arguments are refused by name."""
from __future__ import annotations

import pytest

from benchmarks.common import host_probe


def test_read_speed_reads_the_whole_file(tmp_path, monkeypatch):
    """The read probe reads every byte of the file (a short read would inflate its GB/s)."""
    path = tmp_path / "data.bin"
    path.write_bytes(b"x" * (3 << 20) + b"y" * 1000)
    read = []
    real_readv = host_probe.os.readv
    monkeypatch.setattr(host_probe.os, "readv", lambda fd, buffers: read.append(real_readv(fd, buffers)) or read[-1])
    assert host_probe._read_gb_per_s(str(path), direct=False) > 0
    assert sum(read) == (3 << 20) + 1000 and read[-1] == 0


def test_canary_counts_its_rounds():
    """One worker per core, every round timed by the clock and by the thread's CPU."""
    out = host_probe.canary(0.3)
    assert out["canary_rounds"] >= host_probe.os.cpu_count()
    assert 0 < out["canary_median_s"] <= out["canary_worst_s"]
    assert 0 < out["canary_worst_cpu_s"] <= out["canary_worst_s"] + 0.01
    assert 0 <= out["canary_cpu_over_2x"] <= out["canary_rounds"]


@pytest.mark.parametrize("argv,message", [
    (["--memory-gb", "0"], "--memory-gb and --read-gb must be positive"),
    (["--read-gb", "-1"], "--memory-gb and --read-gb must be positive"),
    (["--canary-s", "-1"], "--settle and --canary-s not negative"),
])
def test_bad_arguments_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        host_probe.main(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err
