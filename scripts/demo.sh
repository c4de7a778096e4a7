#!/usr/bin/env bash
# The main job: set up .venv if needed, then run the demo on the built-in example.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/venv.sh
exec .venv/bin/medley demo "$@"
