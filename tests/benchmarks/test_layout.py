"""The benchmarks' front door holds: every benchmark is listed in benchmarks/README.md with a command that names its
module, none edits the import path, and every record stays one experiment long."""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
RECORD_LINES = 320  # "one dated experiment per file, at most ~300 lines"
PARTS = ("common/delay_proxy.py", "wal/train.py")  # processes that a benchmark starts, not run by hand


def _modules() -> list[Path]:
    return sorted(p for p in BENCHMARKS.rglob("*.py") if "results" not in p.parts)


def _runnable() -> list[Path]:
    """The benchmarks' scripts: the modules with a ``__main__`` guard, but for the processes benchmarks start."""
    return [p for p in _modules() if 'if __name__ == "__main__"' in p.read_text()
            and p.relative_to(BENCHMARKS).as_posix() not in PARTS]


def _edits_the_import_path(source: str) -> list[int]:
    """Lines of calls to ``sys.path.insert``/``append``/``extend`` in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("insert", "append", "extend"):
            target = node.func.value
            if isinstance(target, ast.Attribute) and target.attr == "path" and isinstance(target.value, ast.Name) and target.value.id == "sys":
                found.append(node.lineno)
    return found


def test_the_path_check_finds_an_edit_and_nothing_else():
    assert _edits_the_import_path("import sys\nsys.path.insert(0, 'x')\nsys.path.append('y')\n") == [2, 3]
    assert _edits_the_import_path("paths = []\npaths.insert(0, 'x')\nimport os\nos.path.join('a')\n") == []


def test_no_benchmark_edits_the_import_path():
    edits = {str(p.relative_to(ROOT)): lines for p in _modules() if (lines := _edits_the_import_path(p.read_text()))}
    assert not edits, f"run benchmarks as modules (python -m benchmarks....) instead of editing sys.path: {edits}"


def test_every_benchmark_is_listed_with_its_module_command():
    readme = (BENCHMARKS / "README.md").read_text()
    runnable = _runnable()
    assert len(runnable) >= 15, [str(p) for p in runnable]
    missing = []
    for path in runnable:
        rel = path.relative_to(BENCHMARKS)
        module = "benchmarks." + ".".join(rel.with_suffix("").parts)
        if f"`{rel.as_posix()}`" not in readme or f"python -m {module}" not in readme:
            missing.append(rel.as_posix())
    assert not missing, f"benchmarks/README.md lacks these benchmarks, or their `python -m` command: {missing}"


def test_every_record_is_at_most_one_experiment_long():
    records = sorted((BENCHMARKS / "results").rglob("*.md"))
    assert records
    long = {str(p.relative_to(ROOT)): n for p in records if (n := len(p.read_text().splitlines())) > RECORD_LINES}
    assert not long, f"records over {RECORD_LINES} lines (split them, one experiment a file): {long}"


def test_every_record_the_readme_links_exists():
    readme = (BENCHMARKS / "README.md").read_text()
    links = re.findall(r"\]\((results/[^)]+)\)", readme)
    assert links and all((BENCHMARKS / link).is_file() for link in links), [l for l in links if not (BENCHMARKS / l).is_file()]
