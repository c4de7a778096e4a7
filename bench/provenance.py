"""What every benchmark result records about how it was made: the commit and the command.

The commit is ``+dirty`` only when something other than benchmark results differs from it (code,
tests, docs): results files that an earlier section of the same run rewrote, or that are not
committed yet, do not change what was measured. The changed paths are listed, so a dirty result
says what it ran on.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]
RESULTS = "bench/results/"


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()


def changed_paths(root: Path = ROOT) -> list[str]:
    """Paths of the checkout at ``root`` that differ from HEAD (modified, staged or untracked),
    benchmark results left out."""
    out = subprocess.run(["git", "status", "--porcelain", "-z", "--untracked-files=all"], cwd=root,
                         capture_output=True, text=True).stdout
    entries = out.split("\0")
    paths, index = [], 0
    while index < len(entries):
        entry = entries[index]
        index += 1
        if len(entry) < 4:
            continue
        if entry[0] in "RC":  # a rename or copy: its source path follows as the next entry
            index += 1
        if not entry[3:].startswith(RESULTS):
            paths.append(entry[3:])
    return paths


def provenance() -> dict[str, str | list[str]]:
    """``{"commit": HEAD (``+dirty`` when code differs from it), "command": how this ran}``, and
    ``"changed"``: the paths that differ when dirty."""
    changed = changed_paths()
    out: dict[str, str | list[str]] = {"commit": _git("rev-parse", "HEAD") + ("+dirty" if changed else ""),
                                       "command": " ".join(["python", *sys.argv])}
    if changed:
        out["changed"] = changed
    return out
