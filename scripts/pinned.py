"""Prints the requirement of one package in a constraints file: ``python scripts/pinned.py NAME [FILE]`` (``FILE``
defaults to scripts/constraints/known-good.txt). For install steps that pip cannot express as an extra: TorchRec
installed without its dependencies on a CPU machine, a Docker build argument."""
import re
import sys
from pathlib import Path

KNOWN_GOOD = Path(__file__).resolve().parent / "constraints" / "known-good.txt"


def pinned(name: str, constraints: Path = KNOWN_GOOD) -> str:
    for line in constraints.read_text().splitlines():
        requirement = line.split("#", 1)[0].strip()
        if requirement and re.split(r"[\s\[<>=!~;]", requirement, maxsplit=1)[0].lower().replace("_", "-") == name.lower():
            return requirement
    raise SystemExit(f"{constraints} pins no {name!r}")


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3):
        raise SystemExit(__doc__)
    print(pinned(sys.argv[1], Path(sys.argv[2]) if len(sys.argv) == 3 else KNOWN_GOOD))
