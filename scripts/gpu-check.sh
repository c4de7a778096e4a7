#!/usr/bin/env bash
# The GPU check (bench/gpu_check.py says what it measures): in one call of at most six minutes on a
# machine with a CUDA GPU, medley's plans, predictions and training of a 1B and a 7B LLaMA next to a
# plain PyTorch loop; JSON + Markdown in bench/results/gpu-check.{json,md}, copied to $OUT if set.
#
# The first lent GPU machine (image: torch 2.11 + CUDA 13, Python 3.12, no network): here, first
#   scripts/gpu-wheels.sh                  # wheels + commit stamp into .gpu-wheels/ (git-ignored)
# then ONE device call: command `bash scripts/gpu-check.sh`, carry [".gpu-wheels"], timeout_s 420.
#
#   scripts/gpu-check.sh --dry-run         # the same steps on CPU ranks with the tiny model (no GPU)
#
# Python: $PYTHON if set, else the repository's .venv, else python3 -- the first whose torch sees a
# CUDA device (any, for --dry-run) and that has medley's dependencies. Wheels in .gpu-wheels/ are
# installed first (pip --no-index --target, then PYTHONPATH): nothing is downloaded. medley runs
# from src/ (PYTHONPATH), so nothing of it is installed.
set -uo pipefail
cd "$(dirname "$0")/.."

dry=0
for arg in "$@"; do
  case "$arg" in --dry-run) dry=1 ;; esac
done
[[ " $* " == *" --device cpu "* ]] && dry=1

candidates=()
[[ -n "${PYTHON:-}" ]] && candidates+=("$PYTHON")
[[ -x .venv/bin/python ]] && candidates+=(.venv/bin/python)
command -v python3 >/dev/null && candidates+=("$(command -v python3)")

site=${MEDLEY_WHEEL_SITE:-/tmp/medley-gpu-site}
if [[ -f .gpu-wheels/requirements.txt && $dry == 0 ]]; then
  for py in "${candidates[@]}"; do
    if "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --find-links .gpu-wheels \
        --target "$site" -r .gpu-wheels/requirements.txt >&2; then
      export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
      break
    fi
  done
fi

deps="import torch, numpy, scipy, pydantic, typer, rich, tomli_w, tokenizers, safetensors"
cuda="import torch, sys; sys.exit(0 if torch.cuda.is_available() else 3)"
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
  Without network: scripts/gpu-wheels.sh where pip works, carry .gpu-wheels/ here, run this again.
  With network: python3 -m venv .venv && .venv/bin/pip install torch --index-url https://download.pytorch.org/whl/cu128
                && .venv/bin/pip install -e .   (then run this again; it uses .venv)
MSG
  exit 2
fi

echo "gpu-check: using $chosen ($("$chosen" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'))" >&2
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
log=$(mktemp)
timeout 350 "$chosen" bench/gpu_check.py "$@" 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
if [[ -n "${OUT:-}" && -d "${OUT:-}" ]]; then
  stem=gpu-check; [[ $dry == 1 ]] && stem=gpu-check-dry-run
  cp bench/results/$stem.json bench/results/$stem.md "$OUT"/ 2>/dev/null
  cp "$log" "$OUT/$stem.log"
fi
exit "$rc"
