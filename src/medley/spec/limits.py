"""Upper bounds on the sizes medley accepts, so that no input runs for minutes or exhausts memory.

Each bound is checked where the size is read (cluster file or short form, plan file, flags, model
config) before anything of that size is built; beyond it the input is refused with a
:class:`MedleyInputError` that states the limit. The figures were measured on a 2-core CPU
(docs/cluster-format.md and docs/plan-format.md list them for users):

* ``medley simulate`` costs about 20 µs of CPU per stage-micro-batch and about 4-7 µs per action
  of the step's schedules, linearly in both (bench/results/sim_limits.md: pp 8 x 6,250
  micro-batches 1.0 s, dp 50,000 x 1 micro-batch 4.7 s, 997,100 actions of streamed ZeRO-3 3.7 s,
  at most 5.2 s at the limits), so the stage-micro-batches (:data:`MAX_SIM_WORK`) and the actions
  (:data:`MAX_SIM_ACTIONS`) of one step are bounded to keep a run within seconds;
* the planner simulates every rank of its best candidates (256 A100s x LLaMA-2-70B: ~60 s,
  1,024: ~150 s), so it plans clusters of at most :data:`MAX_PLAN_DEVICES` devices.
"""

from __future__ import annotations

from medley.errors import MedleyInputError

MAX_DEVICES = 65_536
"""Devices in one cluster (all nodes, ``repeat`` expanded)."""

MAX_MICRO_BATCHES = 10_000
"""Micro-batches per replica in one step."""

MAX_SIM_WORK = 50_000
"""Pipeline stages (virtual stages included) x micro-batches, summed over the replicas: about
10 s of simulation at most."""

MAX_SIM_ACTIONS = 1_000_000
"""Actions of one simulated step's schedules, summed over the replicas: compute, ZeRO collectives
and optimizer steps (streamed ZeRO-3, many buckets or gather windows multiply them beyond the
stage-micro-batches): about 5-7 s at the limit."""

MAX_WINDOWS = 256
"""ZeRO gather or gradient rounds per stage and step (each round is a set of collectives)."""

MAX_PLAN_DEVICES = 1_024
"""Devices the planner searches over (``medley plan``); larger clusters: plan a part of them."""

MAX_BLOCKS = 1_024
"""Transformer blocks of a model (the largest public models have under 200)."""

MAX_SIZE = 2**31 - 1
"""Any other model dimension (width, heads, vocabulary, sequence length)."""

MAX_SEED = 2**32 - 1
"""``medley train --seed``: 0..2**32 - 1 (the weights and the data order seed torch generators with
seed x 1,000,003 + index, which must stay within 64 bits)."""

MAX_STEPS = 1_000_000_000
"""``medley train --steps`` and ``--warmup-steps``: a billion optimizer steps at most."""


def check_sim_work(*, stages: int, micro_batches: tuple[int, ...] | list[int], where: str) -> None:
    """Refuse a plan whose simulation would run for more than seconds (``where`` names the input)."""
    too_many = [m for m in micro_batches if m > MAX_MICRO_BATCHES]
    if too_many:
        raise MedleyInputError(
            f"{where}: {too_many[0]:,} micro-batches in one replica; the limit is "
            f"{MAX_MICRO_BATCHES:,} per replica: use fewer (or a larger micro-batch size)."
        )
    work = stages * sum(micro_batches)
    if work > MAX_SIM_WORK:
        raise MedleyInputError(
            f"{where}: {stages} stages x {sum(micro_batches):,} micro-batches (all replicas) = {work:,} "
            f"stage-micro-batches to simulate; the limit is {MAX_SIM_WORK:,} (about 10 s): use fewer "
            "micro-batches, stages or replicas."
        )


def check_sim_actions(actions: int, *, where: str) -> None:
    """Refuse a step of more than :data:`MAX_SIM_ACTIONS` actions to simulate (``where`` names
    the input)."""
    if actions > MAX_SIM_ACTIONS:
        raise MedleyInputError(
            f"{where}: one step has {actions:,} actions to simulate (compute, ZeRO collectives and "
            f"optimizer steps of all replicas); the limit is {MAX_SIM_ACTIONS:,}: use fewer replicas, "
            "micro-batches, ZeRO buckets or gather windows (or ZeRO-1/2 instead of streaming ZeRO-3)."
        )
