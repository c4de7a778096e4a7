#!/usr/bin/env bash
# The GPU check: on a machine with one or more CUDA GPUs, in at most ten minutes, the catalog match
# of each GPU, a ~1B model's profile, bf16/fp16 training steps through medley (pp and tp with two or
# more GPUs), predicted against measured step time and memory, and the MFU of a plain FSDP2 loop;
# JSON + Markdown in bench/results/gpu-check.{json,md} (bench/gpu_check.py says what each is).
#
#   scripts/gpu-check.sh              # on the GPU machine
#   scripts/gpu-check.sh --dry-run    # the same steps on CPU ranks with the tiny model (no GPU)
#
# Python: $PYTHON if set, else the repository's .venv, else python3 -- the first whose torch sees
# a CUDA device (any, for --dry-run) and that has medley's dependencies. medley runs from src/
# (PYTHONPATH), so nothing is installed. Nothing is downloaded: a machine without network needs
# those packages already there or carried as wheels.
set -uo pipefail
cd "$(dirname "$0")/.."

dry=0
for arg in "$@"; do
  case "$arg" in --dry-run|--device=cpu) dry=1 ;; esac
done
[[ " $* " == *" --device cpu "* ]] && dry=1

deps="import torch, numpy, scipy, pydantic, typer, rich, tomli_w, tokenizers, safetensors"
cuda="import torch, sys; sys.exit(0 if torch.cuda.is_available() else 3)"
candidates=()
[[ -n "${PYTHON:-}" ]] && candidates+=("$PYTHON")
[[ -x .venv/bin/python ]] && candidates+=(.venv/bin/python)
command -v python3 >/dev/null && candidates+=("$(command -v python3)")

chosen=""
for py in "${candidates[@]}"; do
  if ! missing=$("$py" -c "$deps" 2>&1 >/dev/null); then
    echo "gpu-check: $py lacks a dependency: $(echo "$missing" | tail -1)" >&2
    continue
  fi
  if [[ $dry == 0 ]] && ! "$py" -c "$cuda" 2>/dev/null; then
    echo "gpu-check: $py's torch $("$py" -c 'import torch; print(torch.__version__)') sees no CUDA device" >&2
    continue
  fi
  chosen=$py
  break
done

if [[ -z "$chosen" ]]; then
  cat >&2 <<'MSG'
gpu-check: no Python here has a CUDA-enabled torch and medley's dependencies.
  With network: python3 -m venv .venv && .venv/bin/pip install torch --index-url https://download.pytorch.org/whl/cu128
                && .venv/bin/pip install -e .   (then run this again; it uses .venv)
  Without network: use a Python whose torch sees the GPU (PYTHON=/path/to/python3 scripts/gpu-check.sh) and carry
  the packages it lacks (named above: e.g. pydantic, pydantic-core, annotated-types, typing-inspection, tomli-w)
  as wheels, installed with pip install --no-index --target DIR, then PYTHONPATH=DIR.
MSG
  exit 2
fi

echo "gpu-check: using $chosen ($("$chosen" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'))" >&2
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
exec timeout 600 "$chosen" bench/gpu_check.py "$@"
