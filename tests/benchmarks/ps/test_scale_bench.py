"""scale_bench's memory canary: which of a table's worst disk operations ran while the machine did not stall."""
from benchmarks.ps.scale_bench import MemoryCanary


def _canary(runs):
    canary = MemoryCanary()  # not started: its runs are the test's
    for start, cpu_s in runs:
        canary.add_run(start, start + cpu_s, cpu_s)
    return canary


def test_the_worst_calm_operation_is_the_heaviest_no_stalled_run_overlapped():
    canary = _canary([(t, 0.002) for t in range(0, 100)] + [(100, 0.050)] + [(t, 0.002) for t in range(101, 200)])
    stalled = {"cpu_s": 0.3, "at": 100.5, "wall_s": 0.4, "of": "lookup"}  # the 50 ms run (25x the median) overlapped it
    calm = {"cpu_s": 0.06, "at": 150.5, "wall_s": 0.7, "of": "promotion"}
    lighter = {"cpu_s": 0.01, "at": 160.5, "wall_s": 0.7, "of": "demotion"}
    unseen = {"cpu_s": 0.5, "at": 500.0, "wall_s": 0.1, "of": "compaction"}  # no run overlapped it: not called calm
    assert canary.worst_calm([lighter, stalled, unseen, calm]) == (calm, 0.002)
    assert canary.worst_calm([stalled, unseen]) == (None, None)
    assert MemoryCanary().worst_calm([calm]) == (None, None)  # no run at all
