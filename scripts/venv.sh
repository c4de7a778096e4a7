#!/usr/bin/env bash
# Create or reuse .venv and install medley into it (editable, with test tools).
# Re-installs only when pyproject.toml changed since the last install.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null 2>&1 || PY=python3
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.medley-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1
  # torch first and pinned exactly, so that no other package pulls a CUDA build.
  .venv/bin/python -m pip install -q "torch==2.13.0" 2>&1 | grep -v "is ignored" || true
  .venv/bin/python -m pip install -q -e ".[dev]" 2>&1 | grep -v "is ignored" || true
  touch "$stamp"
fi
