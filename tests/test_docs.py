"""Every repository path a Markdown doc names exists: a moved or deleted file leaves no dangling reference in a doc."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_SKIPPED_DIRS = {".venv", ".git", "build", "node_modules", ".pytest_cache"}
_EXTENSIONS = (".py", ".yaml", ".yml", ".md", ".sh", ".c", ".h", ".toml", ".txt", ".json", ".proto", ".cfg")
# a bare file name is checked only for source files: `manifest.json` or `BASE.json` name files a run writes
_SOURCE_EXTENSIONS = (".py", ".md", ".sh", ".c", ".h", ".toml", ".proto")
_PACKAGE = ROOT / "lightning_persia"
_CODE = re.compile(r"`([^`\n]+)`")
_LINK = re.compile(r"\]\(([^)\s]+)\)")


def _repository_files() -> list[str]:
    return [str(p.relative_to(ROOT)) for p in ROOT.rglob("*") if not _SKIPPED_DIRS & set(p.relative_to(ROOT).parts)]


_FILES = _repository_files()
# a path starting with one of these names the repository's tree; a path under anything else may be a run's output
_ROOTS = {p.name for p in ROOT.iterdir()} | {p.name for p in _PACKAGE.iterdir() if p.is_dir()}


def docs() -> list[Path]:
    """The repository's Markdown files."""
    return sorted(ROOT / f for f in _FILES if f.endswith(".md"))


def candidates(text: str) -> set[str]:
    """Path-like words in backticks and link targets: a `/` or a file extension; no URL, flag, glob or placeholder."""
    found = set()
    for raw in _CODE.findall(text) + _LINK.findall(text):
        for word in raw.split():
            word = word.strip("'\"(),;:@").split("#")[0].split("::")[0]
            word = re.sub(r":\d+(-\d+)?$", "", word)  # file.py:42
            if not word or "://" in word or word.startswith(("-", "$", "~")) or "=" in word:
                continue
            if any(c in word for c in "*<>{}[]|$%±"):
                continue
            if "/" in word or word.endswith(_EXTENSIONS):
                found.add(word)
    return found


def exists(word: str, doc: Path) -> bool | None:
    """Whether a repository path exists; None for a word that is not one (an absolute path, a run's output, a ratio)."""
    if word.startswith("/"):
        return None  # a path on a machine (/tmp, /proc, a pod's /checkpoints), never the repository's
    rel = word.rstrip("/")
    if word.startswith(("./", "../")):
        return (doc.parent / rel).exists()
    if any((base / rel).exists() for base in (ROOT, doc.parent, _PACKAGE)):
        return True
    if "/" not in rel:
        return any(f == rel or f.endswith("/" + rel) for f in _FILES) if rel.endswith(_SOURCE_EXTENSIONS) else None
    if rel.endswith(_EXTENSIONS):  # a path relative to a package folder: `store/admission.py`
        return any(f.endswith("/" + rel) for f in _FILES)
    return False if rel.split("/")[0] in _ROOTS else None


def dangling(doc: Path) -> list[str]:
    """The repository paths `doc` names that do not exist."""
    return sorted(w for w in candidates(doc.read_text()) if exists(w, doc) is False)


def test_the_docs_are_found():
    names = {str(p.relative_to(ROOT)) for p in docs()}
    assert "README.md" in names and any(n.startswith("docs/") for n in names), names
    assert not any(n.startswith(".venv/") for n in names)


def test_a_dangling_path_is_caught_and_other_words_are_not(tmp_path):
    doc = tmp_path / "probe.md"
    doc.write_text("See `lightning_persia/remote_ps/nowhere.py`, [gone](../nowhere/README.md), `store/gone.py`, "
                   "`embedding/worker.py`, `vanished.py`, `examples/nowhere/`.\n"
                   "Not paths of ours: `/tmp/x`, `--wal-dir DIR`, [site](https://a.org/b.py), `lightning_persia.remote_ps`, "
                   "`ls ~/.cache/x`, `manifest.json`, `rows/s`, `runs/dlrm/deltas/`, `shard-*.yaml`.\n"
                   "Present: `README.md`, `lightning_persia/remote_ps/`, `remote_ps/store/`, `trainer/run_one.py:12`.\n")
    assert dangling(doc) == sorted(["lightning_persia/remote_ps/nowhere.py", "../nowhere/README.md", "store/gone.py",
                                    "embedding/worker.py", "vanished.py", "examples/nowhere/"])


def test_every_path_a_doc_names_exists():
    missing = {str(doc.relative_to(ROOT)): bad for doc in docs() if (bad := dangling(doc))}
    assert not missing, "docs naming files or folders that do not exist:\n" + "\n".join(
        f"  {doc}: {', '.join(bad)}" for doc, bad in missing.items())
