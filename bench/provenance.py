"""What every benchmark result records about how it was made: the commit and the command."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()


def provenance() -> dict[str, str]:
    """``{"commit": HEAD (``+dirty`` with uncommitted changes), "command": how this ran}``."""
    dirty = "+dirty" if _git("status", "--porcelain") else ""
    return {"commit": _git("rev-parse", "HEAD") + dirty, "command": " ".join(["python", *sys.argv])}
