"""A plan described inline by command-line flags (``--pp 4 --dp 2 --split 6,8,9,9 --zero 3,3,1,1``).

Defaults follow HyperPipe's grouping: replicas of one stage sit side by side in cluster order (so a
stage's DP group, which carries the ZeRO collectives, shares a node where it can) and the pipeline
crosses the slower links between stages; layers are split in proportion to each stage's speed.
"""

from __future__ import annotations

from medley.cost.estimator import CatalogCostSource
from medley.cost.interfaces import CostSource, Pass
from medley.cost.recompute import Recompute, parse_recompute
from medley.cost.tensor_parallel import TensorParallelCompute
from medley.errors import MedleyInputError
from medley.plan.layout import TP_DEGREES, PlanLayout, check_tp
from medley.plan.split_rules import speed_split
from medley.schedule.generators import generate
from medley.schedule.zero_settings import Placement, StageZero
from medley.spec.catalog import check_precision, half_precision
from medley.spec.cluster import Cluster
from medley.spec.cluster_schema import printable
from medley.spec.limits import MAX_BLOCKS, MAX_MICRO_BATCHES, MAX_WINDOWS, check_sim_work
from medley.spec.model import ModelSpec


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
    *,
    cluster: Cluster,
    model: ModelSpec,
    cost: CostSource,
    pp: int,
    dp: int,
    schedule: str,
    micro_batches: str,
    micro_batch_size: int,
    seq_len: int,
    virtual_stages: int = 1,
    split: str | None = None,
    zero: str | None = None,
    placement: str = "bubble",
    buckets: int = 4,
    gather_windows: int = 1,
    recompute: bool | str = False,
    dtype: str | None = None,
    clip_grad: bool = False,
    assignment: str | None = None,
    tp: str | None = None,
    sequence_parallel: bool = False,
) -> PlanLayout:
    """A :class:`PlanLayout` from the flags of ``medley simulate`` (and ``medley train``);
    ``assignment`` (``--assignment "3,0;1,2"``) puts replica r's pipeline rank k on the k-th id of
    row r instead of :func:`default_assignment` (the first device of its TP group); ``tp``
    (``--tp 2`` or ``--tp 2,1``) the tensor-parallel degree of each pipeline rank, with
    ``sequence_parallel`` (``--sequence-parallel``) sequence parallelism on its TP stages; ``recompute``
    every stage's recomputation, or text (``--recompute-mode``): one setting for all stages or one
    per stage (``none,full:2``, see :mod:`medley.cost.recompute`)."""
    _check_flags(pp=pp, dp=dp, micro_batch_size=micro_batch_size, seq_len=seq_len,
                 virtual_stages=virtual_stages, buckets=buckets, gather_windows=gather_windows)
    model.check_seq_len(seq_len)
    degrees = parse_tp(tp, pp=pp)
    default_assignment(cluster, pp=pp, dp=dp, tp=degrees)
    counts = parse_int_list(micro_batches, flag="--micro-batches", count=dp, minimum=1,
                            maximum=MAX_MICRO_BATCHES)
    assert counts is not None
    knobs = {"virtual_stages": virtual_stages} if schedule == "interleaved" else {}
    check_sim_work(stages=pp * (virtual_stages if knobs else 1), micro_batches=counts,
                   where=f"--pp {pp} --micro-batches {micro_batches}")
    try:
        probe = generate(schedule, pp=pp, micro_batches=counts[0], **knobs)
    except ValueError as err:
        raise MedleyInputError(f"--schedule {schedule}: {err}") from None
    stages = probe.num_stages
    # Two-direction schedules hold the model twice: the up pipeline's k-th stage (global p + k)
    # has the same layers as the down pipeline's k-th, so the split names the down stages only.
    mirrored = schedule == "bidirectional"
    chain = pp if mirrored else stages
    devices = (default_assignment(cluster, pp=pp, dp=dp, tp=degrees) if assignment is None
               else parse_assignment(assignment, cluster, pp=pp, dp=dp))
    layers = parse_int_list(split, flag="--split", count=chain, minimum=0)
    if layers is None:
        tensor = TensorParallelCompute(model, cost, catalog=CatalogCostSource.for_cluster(model, cluster))
        speeds = []
        for stage in range(chain):
            rank = probe.stage_to_rank[stage]
            types = {cluster.devices[devices[r][rank]].type.name for r in range(dp)}
            block_time = max(
                sum(
                    tensor.layer_time(1, p, micro_batch_size=micro_batch_size, seq_len=seq_len, device_type=t,
                                      tp=degrees[rank] if degrees else 1)
                    for p in Pass
                )
                for t in types
            )
            speeds.append(1.0 / block_time)
        layers = speed_split(model, speeds)
    else:
        layers = _expand_split(model, layers)
    if mirrored:
        layers = layers + layers
    levels = parse_int_list(zero, flag="--zero", count=stages, minimum=0) or (1,) * stages
    if any(level > 3 for level in levels):
        raise MedleyInputError(f"--zero '{zero}': ZeRO levels are 0, 1, 2 or 3")
    used = {cluster.devices[d].type for row in devices for d in row}
    if dtype is None:
        dtype = half_precision(used)
    check_precision(dtype, used, where="--dtype bf16",
                    fix="give --dtype fp16 or fp32, or --assignment devices that have bf16")
    try:
        policy = Placement(placement)
    except ValueError:
        raise MedleyInputError(f"--zero-placement '{placement}' must be 'naive' or 'bubble'") from None
    layout = PlanLayout(
        model=model,
        pp=pp,
        dp=dp,
        assignment=devices,
        stage_layers=layers,
        schedule=schedule,
        micro_batches=counts,
        micro_batch_size=micro_batch_size,
        seq_len=seq_len,
        zero=tuple(StageZero(level=lv, buckets=buckets, gather_windows=gather_windows) for lv in levels),
        placement=policy,
        recompute=_recompute(recompute, stages),
        dtype=dtype,
        knobs=knobs,
        clip_grad=clip_grad,
        tp=degrees,
        sequence_parallel=sequence_parallel,
    )
    check_tp(layout, cluster)
    return layout


def _recompute(value: bool | str, stages: int) -> tuple[Recompute, ...]:
    """Each stage's recomputation from ``--recompute`` (a bool) or ``--recompute-mode`` (text)."""
    if isinstance(value, bool):
        return (parse_recompute(value),) * stages
    items = [item for item in value.split(",") if item.strip()]
    if len(items) not in (1, stages):
        raise MedleyInputError(f"--recompute-mode '{value}': give one setting or one per stage ({stages})")
    settings = tuple(parse_recompute(item, where="--recompute-mode") for item in items)
    return settings * stages if len(settings) == 1 else settings
