"""The files a dataset reads: patterns expanded in order, a missing file named before anything is read."""
from __future__ import annotations

import glob
import os
from typing import List, Optional, Sequence


def expand_files(patterns: Optional[Sequence[str]], what: str) -> List[str]:
    """Paths in order; a pattern with ``*``, ``?`` or ``[`` expands to its sorted matches (none is an error), any
    other path must be a file (``what`` names its kind in the error: ``"Criteo file"``)."""
    out: List[str] = []
    for pattern in patterns or []:
        pattern = os.path.expanduser(str(pattern))
        if any(ch in pattern for ch in "*?["):
            matches = sorted(glob.glob(pattern))
            if not matches:
                raise FileNotFoundError(f"no file matches {pattern!r}")
            out.extend(matches)
        elif not os.path.isfile(pattern):
            raise FileNotFoundError(f"{what} not found: {pattern!r}")
        else:
            out.append(pattern)
    return out
