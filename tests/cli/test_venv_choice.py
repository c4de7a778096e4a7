"""scripts/venv.sh chooses the torch build (MEDLEY_TORCH, README "GPU set-up"): a CUDA build where
``nvidia-smi -L`` lists a GPU (the CUDA version by the driver's), the configured index's torch
elsewhere, and the exact version of constraints.txt either way. ``--dry-run`` prints the choice and
the pip command and installs nothing, so a fake ``nvidia-smi`` on PATH exercises each case here."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
SCRIPT = ROOT / "scripts" / "venv.sh"
TORCH = re.search(r"^torch==(\S+)$", (ROOT / "constraints.txt").read_text(), re.M).group(1)
HEADER = "| NVIDIA-SMI 570.86.15    Driver Version: 570.86.15    CUDA Version: {cuda}     |"
NO_DRIVER = "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver."


def fake_nvidia_smi(directory: Path, *, gpus: int, cuda: str = "12.8") -> None:
    """An ``nvidia-smi`` that lists ``gpus`` A100s (``-L``) under a driver of CUDA ``cuda``, or,
    with none, fails as it does on a machine without a working driver."""
    if gpus:
        listing = "\n".join(f"GPU {i}: NVIDIA A100-SXM4-80GB (UUID: GPU-{i})" for i in range(gpus))
        header = HEADER.format(cuda=cuda)
        body = f'if [ "$1" = "-L" ]; then\ncat <<EOF\n{listing}\nEOF\nelse\necho "{header}"\nfi\n'
    else:
        body = f'echo "{NO_DRIVER}"\nexit 9\n'
    path = directory / "nvidia-smi"
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)


def dry_run(directory: Path, **env: str) -> subprocess.CompletedProcess[str]:
    environment = {key: value for key, value in os.environ.items() if key != "MEDLEY_TORCH"}
    environment.update(PATH=f"{directory}{os.pathsep}{os.environ['PATH']}", **env)
    return subprocess.run([str(SCRIPT), "--dry-run"], capture_output=True, text=True, env=environment,
                          timeout=60, check=False)


@pytest.mark.parametrize(("cuda", "build"), [("12.8", "cu128"), ("13.0", "cu128"), ("12.6", "cu126")])
def test_a_machine_with_gpus_gets_the_cuda_build_its_driver_runs(tmp_path: Path, cuda: str,
                                                                 build: str) -> None:
    fake_nvidia_smi(tmp_path, gpus=2, cuda=cuda)
    done = dry_run(tmp_path)
    assert done.returncode == 0, done.stderr
    choice, command = done.stdout.splitlines()
    assert choice == (f"venv.sh: torch {TORCH}+{build} from PyTorch's index (auto: nvidia-smi lists 2 "
                      f"GPU(s), driver CUDA {cuda})")
    assert command == (f".venv/bin/python -m pip install -q -c constraints.txt torch=={TORCH}+{build} "
                       f"--extra-index-url https://download.pytorch.org/whl/{build}")


def test_without_a_gpu_the_configured_index_gives_torch_as_before(tmp_path: Path) -> None:
    fake_nvidia_smi(tmp_path, gpus=0)
    done = dry_run(tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        f"venv.sh: torch {TORCH} from the configured package index (auto: no NVIDIA GPU listed by "
        "nvidia-smi)",
        ".venv/bin/python -m pip install -q -c constraints.txt torch"]


@pytest.mark.parametrize(("choice", "wanted"), [
    ("cpu", f"torch=={TORCH}+cpu --extra-index-url https://download.pytorch.org/whl/cpu"),
    ("cu126", f"torch=={TORCH}+cu126 --extra-index-url https://download.pytorch.org/whl/cu126"),
    ("index", "-c constraints.txt torch"),
])
def test_medley_torch_chooses_whatever_the_machine_has(tmp_path: Path, choice: str, wanted: str) -> None:
    fake_nvidia_smi(tmp_path, gpus=4)
    done = dry_run(tmp_path, MEDLEY_TORCH=choice)
    assert done.returncode == 0, done.stderr
    assert f"(MEDLEY_TORCH={choice})" in done.stdout.splitlines()[0]
    assert done.stdout.splitlines()[1].endswith(wanted), done.stdout


def test_an_old_driver_and_an_unknown_build_are_one_line(tmp_path: Path) -> None:
    fake_nvidia_smi(tmp_path, gpus=1, cuda="12.4")
    old = dry_run(tmp_path)
    assert old.returncode == 2 and not old.stdout
    assert old.stderr.strip() == (f"venv.sh: nvidia-smi lists 1 GPU(s) but its driver supports CUDA "
                                  f"12.4; torch {TORCH}'s CUDA builds need 12.6 or later: update the NVIDIA "
                                  "driver, or set MEDLEY_TORCH=cpu")
    bad = dry_run(tmp_path, MEDLEY_TORCH="cuda")
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1
    assert "MEDLEY_TORCH='cuda' is not a torch build" in bad.stderr
