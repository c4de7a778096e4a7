#!/usr/bin/env bash
# The tests: set up .venv if needed, lint, then run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/venv.sh
.venv/bin/ruff check src tests bench
exec .venv/bin/python -m pytest "$@"
