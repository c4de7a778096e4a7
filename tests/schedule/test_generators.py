"""Every generator's output is a valid schedule, and its memory follows the family's rule."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from medley.schedule.generators import FAMILIES, generate
from medley.schedule.ir import Kind
from medley.schedule.validate import peak_in_flight, validate

SPLIT_BACKWARD = {"zb-h1", "zb-h2"}


@st.composite
def family_case(draw: st.DrawFn) -> tuple[str, int, int, dict]:
    family = draw(st.sampled_from(FAMILIES))
    pp = draw(st.integers(1, 8))
    m = draw(st.integers(1, 24))
    knobs: dict = {}
    if family == "interleaved":
        knobs["virtual_stages"] = draw(st.integers(1, 4))
    elif family == "hetero-1f1b":
        extra = draw(st.lists(st.integers(0, 3), min_size=pp, max_size=pp))
        # Non-increasing depths at least 1F1B's: cumulative extra from the back.
        depths = [pp - s + sum(extra[s:]) for s in range(pp)]
        knobs["warmup"] = tuple(depths)
    elif family == "bidirectional":
        knobs["down_micro_batches"] = draw(st.integers(0, m))
    if family in ("zb-h2", "bidirectional") and draw(st.booleans()):
        n = pp if family == "zb-h2" else 2 * pp
        knobs["stage_costs"] = [tuple(draw(st.integers(1, 4)) for _ in range(3)) for _ in range(n)]
    return family, pp, m, knobs


@settings(max_examples=150, deadline=None)
@given(family_case())
def test_every_generated_schedule_validates(case: tuple[str, int, int, dict]) -> None:
    family, pp, m, knobs = case
    schedule = generate(family, pp=pp, micro_batches=m, **knobs)
    validate(schedule)
    assert schedule.family == family
    assert schedule.num_ranks == pp
    kinds = {a.kind for row in schedule.actions for a in row}
    assert (Kind.W in kinds) == (family in SPLIT_BACKWARD)
    assert Kind.BW not in kinds or family not in SPLIT_BACKWARD


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 8), st.integers(1, 32))
def test_1f1b_stage_holds_at_most_min_p_minus_s_and_m(pp: int, m: int) -> None:
    schedule = generate("1f1b", pp=pp, micro_batches=m)
    assert peak_in_flight(schedule) == [min(pp - s, m) for s in range(pp)]
    validate(schedule, activation_limit=[min(pp - s, m) for s in range(pp)])


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 8), st.integers(1, 32))
def test_zb_h1_keeps_1f1b_peak_memory(pp: int, m: int) -> None:
    peak = peak_in_flight(generate("zb-h1", pp=pp, micro_batches=m))
    assert max(peak) == max(peak_in_flight(generate("1f1b", pp=pp, micro_batches=m)))


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 6), st.integers(1, 24), st.integers(1, 4))
def test_interleaved_peak_follows_megatron_warmup(pp: int, m: int, v: int) -> None:
    schedule = generate("interleaved", pp=pp, micro_batches=m, virtual_stages=v)
    assert schedule.num_stages == pp * v
    if m % pp == 0:
        expected = [min(v * m, 2 * (pp - r - 1) + (v - 1) * pp + 1) for r in range(pp)]
        assert peak_in_flight(schedule) == expected


def test_hetero_default_is_1f1b_and_deeper_warmup_holds_more() -> None:
    base = generate("1f1b", pp=4, micro_batches=8)
    assert generate("hetero-1f1b", pp=4, micro_batches=8).actions == base.actions
    deep = generate("hetero-1f1b", pp=4, micro_batches=8, warmup=(6, 5, 2, 1))
    validate(deep)
    assert peak_in_flight(deep) == [6, 5, 2, 1]
    assert deep.knobs["warmup"] == (6, 5, 2, 1)


def test_hetero_rejects_increasing_depths() -> None:
    with pytest.raises(ValueError, match="non-increasing"):
        generate("hetero-1f1b", pp=3, micro_batches=8, warmup=(2, 3, 1))
    with pytest.raises(ValueError, match="one depth per stage"):
        generate("hetero-1f1b", pp=3, micro_batches=8, warmup=(3, 2))


def test_zb_h2_respects_memory_limit_and_costs() -> None:
    limited = generate("zb-h2", pp=4, micro_batches=12, memory_limit=(5, 5, 5, 5))
    validate(limited, activation_limit=[5, 5, 5, 5])
    assert max(peak_in_flight(limited)) <= 5
    assert limited.knobs["memory_limit"] == (5, 5, 5, 5)
    free = generate("zb-h2", pp=4, micro_batches=12)
    assert peak_in_flight(free)[0] == 7  # 2p-1 on stage 0
    slow = generate("zb-h2", pp=4, micro_batches=12, stage_costs=[(1, 1, 1), (3, 3, 3), (1, 1, 1), (1, 1, 1)])
    validate(slow)
    assert slow.actions != free.actions


def test_bidirectional_maps_up_pipeline_in_reverse() -> None:
    schedule = generate("bidirectional", pp=4, micro_batches=8, down_micro_batches=3)
    assert schedule.num_stages == 8
    assert schedule.stage_to_rank == (0, 1, 2, 3, 3, 2, 1, 0)
    assert schedule.micro_batch_stages[:3] == ((0, 3),) * 3
    assert schedule.micro_batch_stages[3:] == ((4, 7),) * 5
    assert schedule.knobs == {"down_micro_batches": 3}
    validate(schedule)
    first_stage_of_up = [a for a in schedule.actions[3] if a.stage == 4 and a.kind is Kind.F]
    assert [a.micro_batch for a in first_stage_of_up] == [3, 4, 5, 6, 7]


def test_unknown_family_and_knob_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="unknown schedule family 'pipedream'"):
        generate("pipedream", pp=2, micro_batches=4)
    with pytest.raises(ValueError, match="does not take knob"):
        generate("1f1b", pp=2, micro_batches=4, virtual_stages=2)
    with pytest.raises(ValueError, match="micro_batches must be >= 1"):
        generate("gpipe", pp=2, micro_batches=0)


def test_a_generated_program_is_reused_but_each_caller_owns_its_rows() -> None:
    """generate keeps what it made: a second call returns the same program, and a caller that
    edits its rows (the ZeRO pass builds new ones, but others may) changes no later answer."""
    first = generate("hetero-1f1b", pp=3, micro_batches=5, warmup=[4, 3, 1])
    text = first.to_text()
    first.actions[0].clear()
    first.knobs.clear()
    again = generate("hetero-1f1b", pp=3, micro_batches=5, warmup=[4, 3, 1])
    assert again.to_text() == text and again.knobs == {"warmup": (4, 3, 1)}
    assert generate("hetero-1f1b", pp=3, micro_batches=5, warmup=(4, 3, 1)).to_text() == text
