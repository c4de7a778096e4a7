"""Meta-device stages made real: storage for this rank's shards only, filled with their part of the
seeded initialisation (torchtitan's order: build on ``meta``, apply TP and FSDP2, ``to_empty``,
initialise).

A parameter as a rank holds it is a box of the whole tensor: a TP slice (``Shard(d)`` over the
``tp`` mesh) and, under ZeRO-1/2/3, FSDP2's ``torch.chunk`` piece of that slice along dim 0 (a
``_StridedShard`` where both cut dim 0). :func:`local_box` gives that box from the DTensor's
placements (torch's own computation, :func:`medley.runtime.torch_adapter.shard_at`), for the
seeded values here and for the rows a rank reads of a Hugging Face checkpoint
(:mod:`medley.runtime.hf_weights`).

The values come from :func:`medley.runtime.transformer.init_values`, the one initialisation rule: each
layer's parameters are drawn whole, one at a time and in the same order as the single-process
model draws them, and each rank keeps its box, so its shards are bit-identical to the same rows
of the whole model and no more than one whole parameter is alive at once.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from medley.runtime.lora import is_adapter_name
from medley.runtime.tensor_parallel import local_tensor
from medley.runtime.torch_adapter import shard_at
from medley.runtime.transformer import TIED_COPY, Decoder, init_values, tied_copy_value


def local_box(param: torch.Tensor) -> tuple[slice, ...]:
    """The index box of the whole tensor that this rank holds of ``param`` (all of it for a plain
    tensor)."""
    if not isinstance(param, DTensor):
        return tuple(slice(0, size) for size in param.shape)
    mesh = param.device_mesh
    shape, offset = shard_at(tuple(param.shape), tuple(mesh.shape), tuple(mesh.get_coordinate()),
                             tuple(param.placements))
    if tuple(shape) != tuple(param.to_local().shape):
        raise AssertionError(f"local shape {tuple(param.to_local().shape)} is not the {tuple(shape)} its "
                             f"placements {param.placements} give")
    return tuple(slice(start, start + size) for start, size in zip(offset, shape, strict=True))


def init_local_shards(module: Decoder, seed: int, *, adapters_only: bool = False) -> None:
    """Fill every parameter of ``module`` (after ``to_empty``) with its box of the seeded
    initialisation, layer by layer; ``adapters_only``: the LoRA adapters' alone (a base read from
    a checkpoint or a Hugging Face directory)."""
    spec = module.spec
    with torch.no_grad():
        for index, layer in module.layer_modules().items():
            params = dict(layer.named_parameters())
            shapes = [(name, p.shape) for name, p in params.items()]
            values = init_values(shapes, seed, index, spec.num_blocks)
            for name, value in values:
                if is_adapter_name(name) or not adapters_only:
                    _fill(params[name], value)
                del value  # at most one whole tensor alive
        if adapters_only:
            return
        if module.head is not None and module.head.out is not None and spec.tied_embeddings \
                and module.embed is None:
            _fill(dict(module.named_parameters())[TIED_COPY], tied_copy_value(spec, seed))


def _fill(param: torch.Tensor, value: float | torch.Tensor) -> None:
    local = local_tensor(param)
    if isinstance(value, float):
        local.fill_(value)
    elif local.numel():
        local.copy_(value[local_box(param)])
