"""A Hugging Face model directory's weights into medley's layers (``--init-from``).

The files are read and checked by :mod:`medley.hf.read` (only the files that hold a stage's own
layers' tensors, and only those tensors); this module gives it the model's parameters and puts
what it reads into them: a plain parameter its whole tensor, a TP slice or ZeRO shard only its own
box. :func:`check_hf_weights` checks the headers alone against the whole model, so a missing or
mis-shaped tensor is one line before any rank starts.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch

from medley.errors import MedleyInputError
from medley.hf.read import check_tensors, checked_slices
from medley.runtime.lora import is_adapter_name
from medley.runtime.materialize import local_box
from medley.runtime.tensor_parallel import local_tensor
from medley.runtime.transformer import Decoder
from medley.spec.cluster_schema import printable
from medley.spec.model import ModelSpec


def check_hf_weights(spec: ModelSpec, directory: Path) -> None:
    """Every tensor the model needs is in ``directory`` with its shape and a floating-point
    dtype, and no other tensor is there (headers only, no data)."""
    with torch.device("meta"):
        model = Decoder(spec, init=False)
    check_tensors(spec, model.named_parameters(), directory)


def load_hf_weights(module: Decoder, directory: Path) -> None:
    """Fill ``module``'s parameters (a stage or the whole model) from ``directory``, reading only
    the tensors of its own layers."""
    load_hf_tensors(module.spec, module.named_parameters(), directory)


def load_hf_tensors(spec: ModelSpec, named: Iterable[tuple[str, torch.Tensor]], directory: Path) -> None:
    """Fill parameters given by medley name from ``directory``: a plain one with its whole tensor,
    a TP slice or ZeRO-1/2/3 shard (DTensor) with only its own box of it (read as a slice of the
    file, :func:`medley.runtime.materialize.local_box`). LoRA adapters are not the base model's:
    they are left to their initialisation."""
    named = [(name, param) for name, param in named if not is_adapter_name(name)]
    with torch.no_grad():
        for file, hf, param, piece in checked_slices(spec, named, directory):
            local = local_tensor(param)
            if local.numel():  # a short dim-0 cut can leave a rank no rows
                local.copy_(piece[local_box(param)] if local.dim() else piece[:])
            if not bool(torch.isfinite(local).all()):
                raise MedleyInputError(printable(
                    f"{file}: tensor '{hf}' holds NaN or infinite values; give the directory of "
                    "a model whose weights are finite"))
