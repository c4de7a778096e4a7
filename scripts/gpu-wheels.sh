#!/usr/bin/env bash
# Here (with access to PyPI), before a device run: the pure-Python packages medley needs that the
# GPU image may lack, as wheels in .gpu-wheels/ (git-ignored; carried to the device machine), with
# requirements.txt naming them and stamp.json the commit they go with (the device gets no .git).
#
#   scripts/gpu-wheels.sh                # then the device run, one line (carry: [".gpu-wheels"]):
#   bash scripts/gpu-check.sh            # timeout_s 420; results come back in $OUT
#
# Versions: constraints.txt. The image (KINDS.md: Python 3.12, torch 2.11 + CUDA 13) has numpy,
# scipy, matplotlib, tokenizers, safetensors, pyarrow and jinja2; it lacks pydantic (+ core,
# annotated-types, typing-inspection) and tomli-w; typer, click, rich and their needs are carried at
# medley's versions so the CLI is the one CI tests. pydantic-core is compiled: wheels for cp311 and
# cp312 (GPU_PYTHONS="3.12 3.11"), pip picks the one that fits.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=.gpu-wheels
names="pydantic pydantic_core annotated-types typing-inspection typing_extensions tomli_w typer click
shellingham rich markdown-it-py mdurl Pygments annotated-doc"
py=${PYTHON:-.venv/bin/python}
[[ -x $py ]] || py=python3
mkdir -p "$dir"
: >"$dir/requirements.txt"
pins=()
for name in $names; do
  pin=$(grep -i "^${name//[-_]/[-_]}==" constraints.txt || true)
  [[ -n $pin ]] || { echo "gpu-wheels: $name is not in constraints.txt" >&2; exit 2; }
  pins+=("$pin")
  echo "$pin" >>"$dir/requirements.txt"
done
for version in ${GPU_PYTHONS:-3.12 3.11}; do
  "$py" -m pip download -q --no-deps --only-binary=:all: --python-version "$version" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$dir" "${pins[@]}"
done
"$py" - "$dir" <<'PY'
import datetime, json, subprocess, sys
from pathlib import Path
head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
status = subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True).stdout.splitlines()
changed = [line[3:] for line in status if not line[3:].startswith(("bench/results/", ".gpu-wheels"))]
stamp = {"commit": head + ("+dirty" if changed else ""), "changed": changed,
         "written": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}
Path(sys.argv[1], "stamp.json").write_text(json.dumps(stamp, indent=1) + "\n")
PY
echo "gpu-wheels: $(ls "$dir"/*.whl | wc -l) wheels, $(du -sh "$dir" | cut -f1) in $dir (commit $(git rev-parse --short HEAD))"
