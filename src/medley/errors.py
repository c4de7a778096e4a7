"""The one error type for bad user input, shared by every package (the CLI turns it into exit 2)."""

from __future__ import annotations


class MedleyInputError(ValueError):
    """Bad user input. The message names the file, the field and the fix."""
