"""Why nothing fits, when nothing does: the smallest memory shortfall of the plans tried and of
the least-memory plan medley can build, where it is, and which knobs would close it."""

from __future__ import annotations

from collections.abc import Sequence

from medley.cost import formulas
from medley.cost.zero_memory import state_bytes_per_param
from medley.errors import MedleyInputError
from medley.schedule.generators.classic import one_f_one_b_depth
from medley.search.estimate.bounds import stage_memory
from medley.search.estimate.context import PlanContext
from medley.search.rank.ranking import RankedPlan, rank_plan
from medley.search.rules import builder, memory_rules, split_rules
from medley.search.space import PP_CHOICES, Candidate, Constraints, Structure, memory_option

GB = 1e9
FRUGAL_BUCKETS = 8
"""Buckets of the least-memory plan's streamed ZeRO-3 (two live at once: a quarter of a stage)."""


def frugal_candidate(ctx: PlanContext, devices: list[int], max_pp: int, mbs: int) -> Candidate:
    """The least memory per device medley can offer on ``devices``: streamed ZeRO-3 (when
    replicated) and recomputation everywhere, the smallest micro-batch, an even split, at the
    pipeline depth whose estimated worst overshoot is smallest."""
    model = ctx.model
    order = sorted(devices, key=lambda d: (-ctx.cluster.devices[d].type.memory_bytes, d))
    total = ctx.global_batch // mbs
    best: tuple[float, int, Candidate] | None = None
    for pp in (p for p in PP_CHOICES if p <= min(max_pp, len(devices), model.num_layers)):
        dp = max(1, min(len(devices) // pp, total))
        structure = Structure(
            pool="frugal", strategy="memory-first", pp=pp, dp=dp,
            assignment=ctx.assign(order, pp, dp, "stage-major"), micro_batch_size=mbs,
        )
        option = memory_option(3 if dp > 1 else 0, buckets=FRUGAL_BUCKETS, recompute=True)
        candidate = builder.build(
            ctx, structure, "1f1b", split=split_rules.uniform, memory=memory_rules.fixed(option),
            micro_batches=builder.equal_micro_batches(), estimate=builder.no_estimate,
        )
        assert candidate is not None  # a fixed option always places
        overshoot = _overshoot(ctx, candidate)
        if best is None or overshoot < best[0]:
            best = (overshoot, pp, candidate)
    assert best is not None
    return best[2]


def _overshoot(ctx: PlanContext, candidate: Candidate) -> float:
    """The largest estimated memory beyond capacity of any stage on the first replica's devices."""
    st, split = candidate.structure, candidate.stage_layers
    return max(
        stage_memory(
            ctx.table(ctx.cluster.devices[st.assignment[0][s]].type.name, st.micro_batch_size),
            sum(split[:s]),
            sum(split[: s + 1]),
            option=candidate.options[s],
            dp=st.dp,
            in_flight=one_f_one_b_depth(st.pp, s, max(candidate.micro_batches)),
        )
        - ctx.capacity(st.assignment[0][s])
        for s in range(st.pp)
    )


def shortfall_error(
    estimator: PlanContext,
    ranked: Sequence[RankedPlan],
    pools: dict[str, list[int]],
    constraints: Constraints,
    global_batch: int,
    sizes: Sequence[int],
) -> MedleyInputError:
    """The error for "the model fits nowhere": the smallest shortfall, where, and what would close it."""
    cluster, model = estimator.cluster, estimator.model
    tried = list(ranked)
    max_pp = constraints.max_pp or model.num_layers
    frugal = frugal_candidate(estimator, pools["all"], max_pp, min(sizes))
    try:
        tried.append(
            rank_plan(
                frugal,
                frugal.layout(model, estimator.seq_len),
                cluster,
                estimator.cost,
                constraints.memory_headroom,
                pricing=estimator.pricing,
            )
        )
    except MedleyInputError:
        pass
    if not tried:
        return MedleyInputError(f"{model.name}: no plan could be built on cluster '{cluster.name}'.")
    closest = max(tried, key=lambda p: (p.min_headroom_gb, -tried.index(p)))
    report = min(
        closest.result.devices,
        key=lambda r: (
            cluster.devices[r.device].type.memory_bytes * (1 - constraints.memory_headroom)
            - r.peak_memory_bytes,
            r.device,
        ),
    )
    device = cluster.devices[report.device]
    short_gb = -closest.min_headroom_gb
    lay = closest.plan.layout
    hints = []
    if constraints.max_pp is not None and constraints.max_pp < min(len(pools["all"]), model.num_layers):
        hints.append(f"raise --max-pp above {constraints.max_pp} (more stages, fewer layers each)")
    if constraints.memory_headroom > 0 and short_gb < device.type.memory_gb * constraints.memory_headroom:
        hints.append(f"lower --memory-headroom (now {constraints.memory_headroom:.0%})")
    if constraints.exclude_devices:
        hints.append("stop excluding devices with --exclude-devices (more devices shard ZeRO state further)")
    state_gb = state_bytes_per_param(lay.dtype).total * formulas.total_params(model) / GB
    total_gb = sum(cluster.devices[d].type.memory_gb for d in pools["all"])
    hints.append(f"a shorter --seq-len than {estimator.seq_len} (activations grow with it)")
    if state_gb > 0.5 * total_gb:
        hints.append(
            f"more or larger devices: weights, gradients and Adam state alone take {state_gb:,.0f} GB "
            f"against {total_gb:,.0f} GB on the devices planned on"
        )
    else:
        hints.append("devices with more memory for the first stages (they hold the most activations)")
    levels = sorted({"streamed ZeRO-3" if z.streams else f"ZeRO-{z.level}" for z in lay.zero})
    zero = " / ".join(levels)
    tp = f", tp={','.join(map(str, lay.tp))}" if lay.tp else ""
    return MedleyInputError(
        f"{model.name} fits nowhere on cluster '{cluster.name}' at --global-batch {global_batch}, --seq-len "
        f"{estimator.seq_len}: the closest plan (pp={lay.pp}, dp={lay.dp}{tp}, micro-batch size "
        f"{lay.micro_batch_size}, {zero}, recompute {'on' if all(lay.recompute) else 'off'}) is "
        f"{short_gb:.1f} GB short on device {report.device} ({device.type.name}, "
        f"{device.type.memory_gb:g} GB, "
        f"{constraints.memory_headroom:.0%} kept free). Knobs that would close it: " + "; ".join(hints) + "."
    )
