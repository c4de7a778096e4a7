"""The one error type for bad user input, shared by every package (the CLI turns it into exit 2),
and the one switch that shows tracebacks and rank stack dumps (``--debug`` / ``MEDLEY_DEBUG=1``)."""

from __future__ import annotations

import os

DEBUG_ENV = "MEDLEY_DEBUG"


class MedleyInputError(ValueError):
    """Bad user input. The message names the file, the field and the fix."""


def debug_enabled() -> bool:
    """True when the user asked for tracebacks and stack dumps (``--debug`` sets ``MEDLEY_DEBUG=1``,
    which launched ranks inherit)."""
    return os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no")
