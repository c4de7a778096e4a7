#!/usr/bin/env bash
# Create or reuse .venv and install medley into it (editable, with test tools).
# Re-installs only when pyproject.toml or constraints.txt changed since the last install, or when the
# torch build asked for changed. The exact versions come from constraints.txt (pyproject.toml states
# the ranges medley works with); torch is the same exact version whichever build is installed.
#
# Which torch build (README, "GPU set-up"): MEDLEY_TORCH=
#   auto     (default) CUDA where `nvidia-smi -L` lists a GPU: cu128, or cu126 when the driver's CUDA
#            (nvidia-smi's "CUDA Version") is older than 12.8; elsewhere the configured package index's
#            torch, as before (a CPU build where that index has one, as on CI)
#   cu126, cu128, cu130, ...   that CUDA build, from PyTorch's index https://download.pytorch.org/whl/<build>
#   cpu      PyTorch's CPU-only build (https://download.pytorch.org/whl/cpu; no CUDA libraries)
#   index    the configured package index's torch, whatever the machine (no PyTorch index)
# scripts/venv.sh --dry-run prints the choice and the pip command, and changes nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
dry=0
[[ "${1:-}" == "--dry-run" ]] && dry=1
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null 2>&1 || PY=python3
stamp=.venv/.medley-installed
torch_version=$(sed -n 's/^torch==\([^ ]*\).*/\1/p' constraints.txt)
choice="${MEDLEY_TORCH:-auto}"

driver_cuda() {  # the CUDA version nvidia-smi's header reports (12.8), empty when none
  nvidia-smi 2>/dev/null | sed -n 's/.*CUDA Version: *\([0-9][0-9]*\.[0-9][0-9]*\).*/\1/p' | head -1
}

build=""
why=""
case "$choice" in
  auto)
    gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
    if [[ "${gpus:-0}" -gt 0 ]]; then
      cuda=$(driver_cuda)
      major=${cuda%%.*}
      minor=${cuda#*.}
      if [[ -z "$cuda" ]] || (( major > 12 || (major == 12 && minor >= 8) )); then
        build=cu128
      elif (( major == 12 && minor >= 6 )); then
        build=cu126
      else
        echo "venv.sh: nvidia-smi lists $gpus GPU(s) but its driver supports CUDA $cuda; torch $torch_version's" \
          "CUDA builds need 12.6 or later: update the NVIDIA driver, or set MEDLEY_TORCH=cpu" >&2
        exit 2
      fi
      why="auto: nvidia-smi lists $gpus GPU(s), driver CUDA ${cuda:-unknown}"
    else
      build=index
      why="auto: no NVIDIA GPU listed by nvidia-smi"
    fi ;;
  cpu|index|cu[0-9][0-9][0-9])
    build=$choice
    why="MEDLEY_TORCH=$choice" ;;
  *)
    echo "venv.sh: MEDLEY_TORCH='$choice' is not a torch build; use auto, cpu, index or a CUDA build such" \
      "as cu126 or cu128" >&2
    exit 2 ;;
esac

torch_args=(-c constraints.txt)
if [[ "$build" == index ]]; then
  torch_args+=(torch)
  what="torch $torch_version from the configured package index"
else
  torch_args+=("torch==$torch_version+$build" --extra-index-url "https://download.pytorch.org/whl/$build")
  what="torch $torch_version+$build from PyTorch's index"
fi

if [[ $dry == 1 ]]; then
  echo "venv.sh: $what ($why)"
  echo ".venv/bin/python -m pip install -q ${torch_args[*]}"
  exit 0
fi

if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
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
installed=$(cat "$stamp" 2>/dev/null || true)
installed=${installed:-index}  # a stamp written before the build was recorded: the index's torch
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ constraints.txt -nt "$stamp" ] ||
   [ "$installed" != "$build" ]; then
  [[ "$build" == index ]] || echo "venv.sh: installing $what ($why)" >&2
  pip_quiet --upgrade pip
  # torch first and pinned exactly, so that no other package pulls another build.
  pip_quiet "${torch_args[@]}"
  pip_quiet -c constraints.txt -e ".[dev]"
  echo "$build" >"$stamp"
fi
