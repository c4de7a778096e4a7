"""The ``--model`` argument: a preset name or a Hugging Face ``config.json`` (or its directory)."""

from __future__ import annotations

from pathlib import Path

from medley.errors import MedleyInputError
from medley.fileio import read_user_json
from medley.spec.hf_config import load_hf_config
from medley.spec.model import PRESETS, ModelSpec


def get_model(name_or_path: str) -> ModelSpec:
    """A preset by name (case-insensitive) or a model read from a local HF ``config.json``."""
    preset = PRESETS.get(name_or_path.strip().lower())
    if preset is not None:
        return preset
    path = Path(name_or_path)
    if path.is_dir():
        path = path / "config.json"
    if path.suffix == ".json" or path.exists():
        return load_hf_config(path)
    if "/" in name_or_path or name_or_path.startswith("."):  # meant as a path
        raise MedleyInputError(
            f"model {name_or_path}: no such file or directory; give the path of a Hugging Face model "
            "directory or its config.json (e.g. hf download ORG/NAME --local-dir DIR), "
            "or a preset (medley model list)")
    raise MedleyInputError(
        f"unknown model '{name_or_path}': give a preset ({', '.join(PRESETS)}; medley model list) or the "
        f"path of a Hugging Face config.json."
    )


_CONFIG_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def trained_dtype(name_or_path: str) -> str | None:
    """The dtype a Hugging Face model's weights are stored in (``config.json``'s ``dtype``, or the
    older ``torch_dtype``) as ``bf16``/``fp16``/``fp32``; None for a preset or a config that says
    none."""
    if name_or_path.strip().lower() in PRESETS:
        return None
    path = Path(name_or_path)
    path = path / "config.json" if path.is_dir() else path
    config = read_user_json(path, what="model config", fix="fix the syntax")
    if not isinstance(config, dict):
        return None
    value = config.get("dtype", config.get("torch_dtype"))
    return _CONFIG_DTYPES.get(value) if isinstance(value, str) else None
