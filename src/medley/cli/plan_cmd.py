"""Placeholder module: filled by its owner; registers nothing yet."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    del app
