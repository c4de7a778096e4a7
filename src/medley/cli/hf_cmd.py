"""Hugging Face model directories: ``medley export STEP --hf OUT``, and the ``--init-from`` /
``--export-hf`` parts of ``medley train`` (checked before any rank starts)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from medley.cli.console import literal
from medley.cli.error_exit import MedleyInputError, exit_on_input_error
from medley.fileio import check_output_dir, remove_path


def export_checkpoints(out: Path) -> Path:
    """Where a run with ``--export-hf OUT`` and no ``--checkpoint-dir`` saves its final step
    (the same path on every rank; removed after the export). A symbolic link there is refused:
    the run would write and then remove checkpoints wherever it points."""
    directory = out.parent / f".{out.name}.checkpoints"
    if directory.is_symlink():
        raise MedleyInputError(f"--export-hf {out}: {directory} (where the run keeps its checkpoints until "
                               "the export) is a symbolic link; delete it, or give --checkpoint-dir")
    return directory


def check_export_target(out: Path, *, flag: str) -> Path:
    out = check_output_dir(Path(out), flag=flag)
    if os.path.lexists(out):
        raise MedleyInputError(f"{flag} {out}: already exists; give a new directory (the export "
                               "creates it)")
    return out


def check_init_from(model, init_from: Path) -> None:  # noqa: ANN001 - a ModelSpec
    """``init_from``'s config.json describes the plan's model (RoPE, norms: what shapes do not
    show) and every tensor the model needs is there with its shape (headers only)."""
    import dataclasses

    from medley.runtime.hf_weights import check_hf_weights
    from medley.spec.model_arg import get_model

    if not Path(init_from).is_dir():
        raise MedleyInputError(f"--init-from {init_from}: not a directory; give a Hugging Face model "
                               "directory (config.json and *.safetensors)")
    if (Path(init_from) / "config.json").is_file():
        theirs = dataclasses.asdict(get_model(str(init_from)))
        differ = [key for key, value in dataclasses.asdict(model).items()
                  if key != "name" and theirs[key] != value]
        if differ:
            key = differ[0]
            raise MedleyInputError(
                f"--init-from {init_from}: its config.json has {key} = {theirs[key]!r} but the model trained "
                f"has {dataclasses.asdict(model)[key]!r}; train --model {init_from} (or a plan made for it)")
    check_hf_weights(model, Path(init_from))


def hf_dir_of(model: str | None, init_from: Path | None) -> Path | None:
    """The Hugging Face directory a run's model came from (for the tokenizer files of an export)."""
    if init_from is not None:
        return Path(init_from)
    return Path(model) if model is not None and Path(model).is_dir() else None


def export_after_training(checkpoint_dir: Path, out: Path, *, temporary: bool, dtype: str = "fp32") -> Path:
    """Export the newest checkpoint of the finished run; drop the checkpoints if only the export
    needed them."""
    from medley.runtime.checkpoint_layout import latest_checkpoint
    from medley.runtime.hf_export import export_hf

    latest = latest_checkpoint(checkpoint_dir)
    if latest is None:
        raise MedleyInputError(f"--export-hf {out}: the run saved no checkpoint in {checkpoint_dir}")
    try:
        return export_hf(latest, out, dtype=dtype, flag="--export-dtype")
    finally:
        if temporary:
            remove_path(checkpoint_dir)


def register(app: typer.Typer) -> None:
    @app.command("export")
    @exit_on_input_error
    def export_cmd(
        checkpoint: Annotated[Path, typer.Argument(help="A checkpoint step directory (CKPT_DIR/step-N)")],
        hf: Annotated[Path, typer.Option(help="Write a Hugging Face model directory here (new)")],
        max_shard_mb: Annotated[int, typer.Option(help="Largest safetensors file, MiB")] = 5120,
        dtype: Annotated[str, typer.Option(help="Weights' dtype: fp32, bf16 or fp16")] = "fp32",
        merge: Annotated[bool, typer.Option(help="A LoRA run's checkpoint: write the whole model, each "
                                            "adapter folded into its weight (default: PEFT's adapter "
                                            "directory)")] = False,
    ) -> None:
        """Export a checkpoint step, whatever plan wrote it, as a Hugging Face model directory
        (safetensors, config.json, the tokenizer files of the model it came from); a LoRA run's as
        PEFT's adapter directory, or merged into the base with --merge."""
        from medley.runtime.hf_export import check_export_dtype, export_hf

        if not checkpoint.is_dir():
            raise MedleyInputError(f"{checkpoint}: not a directory; give a checkpoint step directory "
                                   "(CHECKPOINT_DIR/step-N)")
        if max_shard_mb < 1:
            raise MedleyInputError(f"--max-shard-mb {max_shard_mb}: must be at least 1")
        check_export_dtype(dtype, flag="--dtype")
        out = check_export_target(hf, flag="--hf")
        export_hf(checkpoint, out, max_shard_bytes=max_shard_mb * 2**20, dtype=dtype, merge=merge)
        typer.echo(f"wrote {literal(str(out))}")
