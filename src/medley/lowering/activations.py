"""One micro-batch's activation bytes of a layout's stage by the formulas: the one rule the
compiler books where no layer was measured (:func:`medley.lowering.compile.stage_cost`) and the dry
run checks its traced bytes against (:mod:`medley.dryrun.traced_bytes`). Per layer its
recomputation mode (:meth:`medley.cost.recompute.Recompute.layer_modes`), its stage's TP degree and
the layout's sequence parallelism; per stage autocast's copies of the fp32 weights."""

from __future__ import annotations

from medley.cost import formulas
from medley.cost.zero_memory import autocast_copy_bytes, state_bytes_per_param
from medley.plan.layout import PlanLayout


def stage_modes(layout: PlanLayout, stage: int) -> dict[int, str]:
    """Each layer of ``stage``'s recomputation mode (:meth:`medley.cost.recompute.Recompute.layer_modes`)."""
    layers = layout.layer_range(stage)
    kinds = [layout.model.layer_kind(i) for i in layers]
    return dict(zip(layers, layout.stage_recompute(stage).layer_modes(kinds), strict=True))


def layer_bytes(layout: PlanLayout, layer: int, *, mode: str, tp: int) -> float:
    """What ``layer`` keeps of one micro-batch from its F to its B on one TP rank of degree ``tp``
    (:func:`medley.cost.formulas.layer_activation_bytes` at the layout's shape and dtype)."""
    return formulas.layer_activation_bytes(
        layout.model, layer, micro_batch_size=layout.micro_batch_size, seq_len=layout.seq_len,
        dtype_bytes=formulas.DTYPE_BYTES[layout.dtype], recompute=mode, tp=tp,
        sequence_parallel=layout.sequence_parallel and tp > 1)


def layer_bytes_after_b(layout: PlanLayout, layer: int, *, tp: int) -> float:
    """What ``layer`` still holds of one micro-batch between its B and its W on one TP rank of
    degree ``tp`` (:func:`medley.cost.formulas.layer_activation_bytes_after_b`; the same under every
    recomputation mode)."""
    return formulas.layer_activation_bytes_after_b(
        layout.model, layer, micro_batch_size=layout.micro_batch_size, seq_len=layout.seq_len,
        dtype_bytes=formulas.DTYPE_BYTES[layout.dtype], tp=tp)


def boundary_bytes(layout: PlanLayout) -> float:
    """Bytes of one micro-batch's hidden states crossing a stage boundary, whole (each way)."""
    return formulas.boundary_bytes(layout.model, micro_batch_size=layout.micro_batch_size,
                                   seq_len=layout.seq_len, dtype_bytes=formulas.DTYPE_BYTES[layout.dtype])


def autocast_copies(layout: PlanLayout, stage: int, modes: dict[int, str], *, tp: int) -> float:
    """Autocast's compute-dtype copies of the fp32 weights each forward of ``stage`` keeps for its
    backward (half precision without FSDP2; a recomputing block keeps none)."""
    per_param = state_bytes_per_param(layout.dtype)
    copies = autocast_copy_bytes(level=layout.zero[stage].level, dp=layout.zero_dp, per_param=per_param)
    return copies * sum(formulas.layer_autocast_params(layout.model, i, tp=tp, recompute=modes[i],
                                                       adapter=layout.adapter)
                        for i in layout.layer_range(stage))


def stage_activation_bytes(layout: PlanLayout, stage: int) -> float:
    """One micro-batch's activation bytes of ``stage`` on one of its TP ranks, all by the formulas."""
    modes, tp = stage_modes(layout, stage), layout.stage_tp(stage)
    return sum(layer_bytes(layout, i, mode=modes[i], tp=tp) for i in layout.layer_range(stage)) + \
        autocast_copies(layout, stage, modes, tp=tp)
