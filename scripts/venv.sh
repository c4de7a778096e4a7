#!/usr/bin/env bash
# Create or reuse .venv and install medley into it (editable, with test tools).
# Re-installs only when pyproject.toml or constraints.txt changed since the last install. The exact
# versions come from constraints.txt (pyproject.toml states the ranges medley works with).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null 2>&1 || PY=python3
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.medley-installed
pip_quiet() {
  # The local package mirror prints a warning per package; show pip's output only on failure.
  local log
  log=$(mktemp)
  if ! .venv/bin/python -m pip install -q "$@" >"$log" 2>&1; then
    grep -v "is ignored" "$log" >&2 || true
    rm -f "$log"
    exit 1
  fi
  rm -f "$log"
}
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ constraints.txt -nt "$stamp" ]; then
  pip_quiet --upgrade pip
  # torch first and pinned exactly, so that no other package pulls a CUDA build.
  pip_quiet -c constraints.txt torch
  pip_quiet -c constraints.txt -e ".[dev]"
  touch "$stamp"
fi
