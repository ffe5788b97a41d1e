"""Smoke tests of benchmarks/disk/disk_zipf_profile.py: a tiny run prints both rates and both profiles; bad sizes are named."""
from __future__ import annotations

import pytest

from benchmarks.disk import disk_zipf_profile


@pytest.mark.usefixtures("disk_tier_kernels")
@pytest.mark.parametrize("promotion", [[], ["--promote-at-once"]])
def test_tiny_run_prints_both_rates_and_both_profiles(tmp_path, capsys, promotion):
    assert disk_zipf_profile.main(["--rows", "3e5", "--memory-rows", "1e5", "--warmup", "2", "--requests", "2",
                                   "--disk-dir", str(tmp_path), "--profile-rows", "400", *promotion]) == 0
    out = capsys.readouterr().out
    assert "memory table:" in out and "disk table:" in out and "the memory table's rate" in out
    assert "--- the requests" in out and "--- the demoter's promotions, estimates and demotions" in out
    requests = out.split("--- the requests")[1].split("--- the demoter's")[0]
    assert ("(_promote)" in requests) == bool(promotion)  # else the lookups queued what they read, for the demoter
    assert list(tmp_path.iterdir()) == []  # the disk table's folder is gone


def test_a_budget_not_below_the_rows_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        disk_zipf_profile.main(["--rows", "1e5", "--memory-rows", "2e5", "--disk-dir", str(tmp_path)])
    assert "needs 0 < --memory-rows < --rows" in capsys.readouterr().err
