"""Prints the requirement of one package as pyproject.toml pins it: ``python scripts/pinned.py EXTRA NAME``
(``EXTRA`` is ``-`` for the main dependencies). For install steps that pip cannot express as an extra."""
import re
import sys
import tomllib
from pathlib import Path


def pinned(extra: str, name: str) -> str:
    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
    requirements = project["dependencies"] if extra == "-" else project["optional-dependencies"][extra]
    for requirement in requirements:
        if re.split(r"[\s\[<>=!~;]", requirement, maxsplit=1)[0].lower().replace("_", "-") == name.lower():
            return requirement
    raise SystemExit(f"pyproject.toml pins no {name!r} in {'the dependencies' if extra == '-' else f'extra {extra!r}'}")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    print(pinned(sys.argv[1], sys.argv[2]))
