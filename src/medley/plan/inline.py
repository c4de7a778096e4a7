"""A plan described inline by command-line flags (``--pp 4 --dp 2 --split 6,8,9,9 --zero 3,3,1,1``).

Defaults follow HyperPipe's grouping: replicas of one stage sit side by side in cluster order (so a
stage's DP group, which carries the ZeRO collectives, shares a node where it can) and the pipeline
crosses the slower links between stages; layers are split in proportion to each stage's speed.
"""

from __future__ import annotations

from dataclasses import dataclass

from medley.cost.interfaces import CostSource, Pass
from medley.cost.recompute import Recompute, parse_recompute
from medley.cost.tp_cost import TensorPricing
from medley.errors import MedleyInputError
from medley.flags import setting
from medley.plan.layout import TP_DEGREES, PlanLayout, check_tp, speed_split
from medley.schedule.generators import generate
from medley.schedule.zero_settings import Placement, StageZero
from medley.spec.adapter import lora_of
from medley.spec.catalog import check_precision, half_precision
from medley.spec.cluster import Cluster
from medley.spec.cluster_schema import printable
from medley.spec.limits import MAX_BLOCKS, MAX_MICRO_BATCHES, MAX_WINDOWS, check_sim_work
from medley.spec.model import ModelSpec


@dataclass(frozen=True, kw_only=True)
class InlineFlags:
    """A plan's shape given by flags, as ``medley simulate`` and ``medley train`` (without
    ``--plan``) take it: each field is the flag of its name (``micro_batch_size`` is
    ``--micro-batch-size``), with one default for every command; its metadata holds the flag's help
    and lowest value (:func:`medley.flags.setting`; medley.cli.options makes the options)."""

    pp: int = setting(1, "Pipeline ranks per replica", minimum=1)
    dp: int = setting(1, "Data-parallel replicas", minimum=1)
    schedule: str = setting("1f1b", "Schedule family (gpipe, 1f1b, interleaved, zb-h1, ...)")
    micro_batches: str = setting("8", "Micro-batches per replica: one value, or one per replica")
    micro_batch_size: int = setting(1, "Sequences per micro-batch", minimum=1)
    seq_len: int | None = setting(None, "Tokens per sequence (default: 2048, or the model's longest if "
                                  "shorter)", minimum=1)
    virtual_stages: int = setting(2, "Chunks per rank (interleaved)", minimum=1)
    split: str | None = setting(None, "Blocks (or layers) per stage, e.g. 6,8,9,9 (default: in proportion to "
                                "each stage's speed)")
    zero: str | None = setting(None, "ZeRO level per stage, e.g. 3,3,1,1 (default 1)")
    zero_placement: str = setting("bubble", "Where ZeRO collectives go: naive or bubble")
    buckets: int = setting(4, "Layer buckets per stage for ZeRO collectives", minimum=1)
    gather_windows: int = setting(1, "ZeRO-3 gather rounds per step: 1 keeps weights gathered, 0 streams "
                                  "buckets", minimum=0)
    recompute: bool = setting(False, "Recompute block activations in the backward")
    recompute_mode: str | None = setting(None, "How blocks recompute, one setting or one per stage: none, "
                                         "full, selective, or MODE:K for a stage's first K blocks (full:2); "
                                         "overrides --recompute")
    assignment: str | None = setting(None, "Device id per pipeline rank, replicas separated by ';' (3,0;1,2)")
    tp: str | None = setting(None, "Tensor-parallel degree per pipeline rank (1, 2, 4 or 8; one value for "
                             "all, e.g. 2 or 2,1): rank k runs on tp[k] consecutive devices of one node "
                             "from its --assignment id")
    sequence_parallel: bool = setting(False, "Sequence parallelism on the stages of tp > 1 (norms on 1/tp of "
                                      "the tokens, all-gather and reduce-scatter instead of all-reduce); "
                                      "seq-len must divide by each tp")
    lora_rank: int = setting(0, "LoRA adapters of this rank on the blocks' linear layers, the base frozen "
                             "(0: full fine-tuning)", minimum=0)
    lora_alpha: float = setting(16.0, "LoRA scale numerator: the adapters' output is scaled by alpha / rank")
    lora_dropout: float = setting(0.0, "Dropout on the LoRA adapters' input")
    lora_targets: str = setting("all", "Linear layers LoRA adapts: a comma list of q,k,v,o,gate,up,down "
                                "(or q_proj, ...), or all")

    def __post_init__(self) -> None:
        if not isinstance(self.recompute, bool):
            raise TypeError(f"recompute={self.recompute!r}: a bool (full or none); give a mode as "
                            "recompute_mode")

    def sequence_length(self, model: ModelSpec) -> int:
        """``seq_len``, or the model's default (:meth:`ModelSpec.default_seq_len`) where it is None."""
        return model.default_seq_len() if self.seq_len is None else self.seq_len


def parse_int_list(
    text: str | None, *, flag: str, count: int, minimum: int = 0, maximum: int | None = None
) -> tuple[int, ...] | None:
    """``"3,3,1,1"`` (or one value for all) as ``count`` integers, or None when not given."""
    if text is None or text == "":
        return None
    parts = str(text).split(",")
    if any(len(v.strip()) > 12 for v in parts) or len(parts) > MAX_MICRO_BATCHES:
        raise MedleyInputError(f"{flag}: '{printable(text[:40])}...' is too long; give small integers")
    try:
        values = tuple(int(v) for v in parts)
    except ValueError:
        raise MedleyInputError(
            f"{flag} '{printable(text)}' must be comma-separated integers, like '3,1'"
        ) from None
    if len(values) == 1 and count > 1:
        values = values * count
    if len(values) != count:
        raise MedleyInputError(f"{flag} '{text}' gives {len(values)} values; give {count} (or one for all)")
    if any(v < minimum for v in values):
        raise MedleyInputError(f"{flag} '{text}': every value must be >= {minimum}")
    if maximum is not None and any(v > maximum for v in values):
        raise MedleyInputError(f"{flag} '{text}': every value must be <= {maximum:,} (the limit)")
    return values


def _check_flags(
    *, pp: int, dp: int, micro_batch_size: int, seq_len: int, virtual_stages: int, buckets: int,
    gather_windows: int
) -> None:
    """Each size flag within its range, before anything is built."""
    ranges = {
        "--pp": (pp, 1, MAX_BLOCKS + 2),
        "--dp": (dp, 1, None),
        "--micro-batch-size": (micro_batch_size, 1, None),
        "--seq-len": (seq_len, 1, None),
        "--virtual-stages": (virtual_stages, 1, MAX_BLOCKS + 2),
        "--buckets": (buckets, 1, MAX_BLOCKS),
        "--gather-windows": (gather_windows, 0, MAX_WINDOWS),
    }
    for flag, (value, low, high) in ranges.items():
        if value < low or (high is not None and value > high):
            bound = f"in {low}..{high:,}" if high is not None else f">= {low}"
            raise MedleyInputError(f"{flag} {value}: must be {bound}; give a value in that range")


def parse_tp(text: str | None, *, pp: int) -> tuple[int, ...]:
    """``--tp 2`` or ``--tp 2,1`` as the degree of each of the ``pp`` pipeline ranks; () when not
    given or 1 everywhere (the layout's "no TP")."""
    degrees = parse_int_list(text, flag="--tp", count=pp, minimum=1, maximum=max(TP_DEGREES)) or ()
    return () if all(t == 1 for t in degrees) else degrees


def devices_needed(*, pp: int, dp: int, tp: tuple[int, ...] = ()) -> int:
    """The devices a layout of ``pp`` ranks, ``dp`` replicas and degrees ``tp`` (() = 1 each) uses."""
    return dp * sum(tp or (1,) * pp)


def default_assignment(
    cluster: Cluster, *, pp: int, dp: int, tp: tuple[int, ...] = ()
) -> tuple[tuple[int, ...], ...]:
    """Replica r's rank k on the (k·dp + r)-th device (group of ``tp[k]`` devices): each stage's
    DP group is contiguous, its TP groups side by side."""
    degrees = tp or (1,) * pp
    need = devices_needed(pp=pp, dp=dp, tp=tp)
    if need > cluster.num_devices:
        tp_part = f" x tp {','.join(map(str, degrees))}" if tp else ""
        lower = "--pp, --dp or --tp" if tp else "--pp or --dp"
        raise MedleyInputError(
            f"--pp {pp} x --dp {dp}{tp_part} needs {need} devices but the cluster has {cluster.num_devices}; "
            f"lower {lower}"
        )
    firsts = [sum(degrees[:k]) * dp for k in range(pp)]
    return tuple(tuple(firsts[k] + r * degrees[k] for k in range(pp)) for r in range(dp))


def parse_assignment(text: str, cluster: Cluster, *, pp: int, dp: int) -> tuple[tuple[int, ...], ...]:
    """``--assignment "3,0;1,2"``: replica rows separated by ``;``, one device id per pipeline rank."""
    rows = str(text).split(";")
    shown = printable(str(text)[:80])
    example = ";".join(",".join(map(str, row)) for row in default_assignment(cluster, pp=pp, dp=dp))
    if len(rows) != dp or any(len(row.split(",")) != pp for row in rows):
        raise MedleyInputError(
            f"--assignment '{shown}': give {dp} replica row(s) (--dp) separated by ';', each with {pp} "
            f"device id(s) (--pp) separated by ',', like '{example}'")
    table = tuple(parse_int_list(row, flag="--assignment", count=pp, minimum=0) or () for row in rows)
    used = [d for row in table for d in row]
    if max(used) >= cluster.num_devices:
        raise MedleyInputError(f"--assignment '{shown}': device {max(used)} is not in cluster "
                               f"'{cluster.name}' (device ids 0..{cluster.num_devices - 1})")
    if len(set(used)) != len(used):
        twice = sorted({d for d in used if used.count(d) > 1})
        raise MedleyInputError(f"--assignment '{shown}' uses device {twice[0]} twice; give each pipeline "
                               "rank its own device")
    return table


def _expand_split(model: ModelSpec, split: tuple[int, ...]) -> tuple[int, ...]:
    """Per-stage layers; a split over the blocks only gets the embedding and head added."""
    total = sum(split)
    if total == model.num_layers:
        return split
    if total == model.num_blocks:
        return (split[0] + 1, *split[1:-1], split[-1] + 1) if len(split) > 1 else (total + 2,)
    raise MedleyInputError(
        f"--split sums to {total}; {model.name} has {model.num_blocks} blocks, or {model.num_layers} "
        "layers counting the embedding and the head"
    )


def inline_layout(
    *, cluster: Cluster, model: ModelSpec, cost: CostSource, dtype: str | None = None,
    clip_grad: bool = False, **flags: object,
) -> PlanLayout:
    """A :class:`PlanLayout` from the inline-plan flags: ``flags`` are :class:`InlineFlags`'s fields
    (the others at their defaults); ``dtype`` None: bf16 where every device used has it, else fp16."""
    return layout_of(InlineFlags(**flags), cluster=cluster, model=model, cost=cost, dtype=dtype,  # type: ignore[arg-type]
                     clip_grad=clip_grad)


def layout_of(
    f: InlineFlags, *, cluster: Cluster, model: ModelSpec, cost: CostSource, dtype: str | None = None,
    clip_grad: bool = False,
) -> PlanLayout:
    """:func:`inline_layout` of the flags ``f``; every flag is checked, naming it."""
    seq_len = f.sequence_length(model)
    _check_flags(pp=f.pp, dp=f.dp, micro_batch_size=f.micro_batch_size, seq_len=seq_len,
                 virtual_stages=f.virtual_stages, buckets=f.buckets, gather_windows=f.gather_windows)
    model.check_seq_len(seq_len)
    degrees = parse_tp(f.tp, pp=f.pp)
    default_assignment(cluster, pp=f.pp, dp=f.dp, tp=degrees)
    counts = parse_int_list(f.micro_batches, flag="--micro-batches", count=f.dp, minimum=1,
                            maximum=MAX_MICRO_BATCHES)
    assert counts is not None
    knobs = {"virtual_stages": f.virtual_stages} if f.schedule == "interleaved" else {}
    check_sim_work(stages=f.pp * (f.virtual_stages if knobs else 1), micro_batches=counts,
                   where=f"--pp {f.pp} --micro-batches {f.micro_batches}")
    try:
        probe = generate(f.schedule, pp=f.pp, micro_batches=counts[0], **knobs)
    except ValueError as err:
        raise MedleyInputError(f"--schedule {f.schedule}: {err}") from None
    stages = probe.num_stages
    # Two-direction schedules hold the model twice: the up pipeline's k-th stage (global p + k)
    # has the same layers as the down pipeline's k-th, so the split names the down stages only.
    mirrored = f.schedule == "bidirectional"
    chain = f.pp if mirrored else stages
    devices = (default_assignment(cluster, pp=f.pp, dp=f.dp, tp=degrees) if f.assignment is None
               else parse_assignment(f.assignment, cluster, pp=f.pp, dp=f.dp))
    layers = parse_int_list(f.split, flag="--split", count=chain, minimum=0)
    if layers is None:
        stage_ranks = probe.stage_to_rank[:chain]
        layers = _speed_split(cluster, model, cost, devices=devices, stage_ranks=stage_ranks, tp=degrees,
                              micro_batch_size=f.micro_batch_size, seq_len=seq_len)
    else:
        layers = _expand_split(model, layers)
    if mirrored:
        layers = layers + layers
    levels = parse_int_list(f.zero, flag="--zero", count=stages, minimum=0) or (1,) * stages
    if any(level > 3 for level in levels):
        raise MedleyInputError(f"--zero '{f.zero}': ZeRO levels are 0, 1, 2 or 3")
    used = {cluster.devices[d].type for row in devices for d in row}
    if dtype is None:
        dtype = half_precision(used)
    check_precision(dtype, used, where="--dtype bf16",
                    fix="give --dtype fp16 or fp32, or --assignment devices that have bf16")
    try:
        policy = Placement(f.zero_placement)
    except ValueError:
        raise MedleyInputError(f"--zero-placement '{f.zero_placement}' must be 'naive' or 'bubble'") from None
    layout = PlanLayout(
        model=model, pp=f.pp, dp=f.dp, assignment=devices, stage_layers=layers, schedule=f.schedule,
        micro_batches=counts, micro_batch_size=f.micro_batch_size, seq_len=seq_len,
        zero=tuple(StageZero(level=lv, buckets=f.buckets, gather_windows=f.gather_windows) for lv in levels),
        placement=policy, recompute=_recompute(f.recompute if f.recompute_mode is None else f.recompute_mode,
                                               stages),
        dtype=dtype, knobs=knobs, clip_grad=clip_grad, tp=degrees, sequence_parallel=f.sequence_parallel,
        adapter=lora_of(rank=f.lora_rank, alpha=f.lora_alpha, dropout=f.lora_dropout, targets=f.lora_targets,
                        model=model),
    )
    check_tp(layout, cluster)
    return layout


def _speed_split(
    cluster: Cluster, model: ModelSpec, cost: CostSource, *, devices: tuple[tuple[int, ...], ...],
    stage_ranks: tuple[int, ...] | list[int], tp: tuple[int, ...], micro_batch_size: int, seq_len: int,
) -> tuple[int, ...]:
    """Layers per stage in proportion to each stage's speed (its slowest replica's device)."""
    tensor = TensorPricing(model, cost, cluster).of("bf16")  # TP's compute ratios, as the search's tables
    speeds = []
    for rank in stage_ranks:
        types = {cluster.devices[row[rank]].type.name for row in devices}
        block_time = max(
            sum(tensor.layer_time(1, p, micro_batch_size=micro_batch_size, seq_len=seq_len, device_type=t,
                                  tp=tp[rank] if tp else 1) for p in Pass)
            for t in types
        )
        speeds.append(1.0 / block_time)
    return speed_split(model, speeds)


def _recompute(value: bool | str, stages: int) -> tuple[Recompute, ...]:
    """Each stage's recomputation from ``--recompute`` (a bool) or ``--recompute-mode`` (text)."""
    if isinstance(value, bool):
        return (parse_recompute(value),) * stages
    items = [item for item in value.split(",") if item.strip()]
    if len(items) not in (1, stages):
        raise MedleyInputError(f"--recompute-mode '{value}': give one setting or one per stage ({stages})")
    settings = tuple(parse_recompute(item, where="--recompute-mode") for item in items)
    return settings * stages if len(settings) == 1 else settings
