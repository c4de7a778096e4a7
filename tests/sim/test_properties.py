"""Invariants over generated schedules (hypothesis), homogeneous and with communication off unless
stated: the closed-form bubble fractions, ZB-H1's third, 1F1B's memory bound and monotonicity."""

from __future__ import annotations

from dataclasses import replace
from fractions import Fraction

from hypothesis import given, settings
from hypothesis import strategies as st
from sim_doubles import AlphaBetaComm, uniform_problem

from medley.schedule.generators import generate
from medley.sim import SimProblem, StageCost, simulate

durations = st.integers(min_value=1, max_value=6)  # integers keep the float sums exact


def bubbles(result) -> set[Fraction]:
    """Per-device bubble fraction 1 - busy/step, as exact fractions (no communication here)."""
    return {Fraction(d.step_time_s - d.busy_s) / Fraction(d.step_time_s) for d in result.devices}


@settings(max_examples=40, deadline=None)
@given(family=st.sampled_from(["gpipe", "1f1b"]), p=st.integers(1, 8), m=st.integers(1, 24),
       f=durations, b=durations, w=durations)
def test_gpipe_and_1f1b_bubble_is_p_minus_1_over_m_plus_p_minus_1(family, p, m, f, b, w):
    result = simulate(uniform_problem(generate(family, pp=p, micro_batches=m), f=f, b=b, w=w))
    assert bubbles(result) == {Fraction(p - 1, m + p - 1)}
    assert all(d.exposed_comm_s == 0 for d in result.devices)
    assert abs(result.bubble_fraction - (p - 1) / (m + p - 1)) < 1e-12


@settings(max_examples=30, deadline=None)
@given(p=st.integers(2, 6), rounds=st.integers(1, 4), v=st.integers(2, 4), f=durations, bw=durations)
def test_interleaved_bubble_is_p_minus_1_over_vm_plus_p_minus_1(p, rounds, v, f, bw):
    m = rounds * p
    schedule = generate("interleaved", pp=p, micro_batches=m, virtual_stages=v)
    # each chunk holds 1/v of the rank's layers: integer chunk times keep the check exact
    result = simulate(uniform_problem(schedule, f=f, b=bw, w=0))
    assert bubbles(result) == {Fraction(p - 1, v * m + p - 1)}


@settings(max_examples=30, deadline=None)
@given(p=st.integers(2, 8), extra=st.integers(0, 16), t=durations)
def test_zb_h1_bubble_is_at_most_a_third_of_1f1b_with_equal_f_b_w(p, extra, t):
    m = p + extra
    zb = simulate(uniform_problem(generate("zb-h1", pp=p, micro_batches=m), f=t, b=t, w=t))
    one = simulate(uniform_problem(generate("1f1b", pp=p, micro_batches=m), f=t, b=t, w=t))
    for zb_dev, one_dev in zip(zb.devices, one.devices, strict=True):
        assert zb_dev.busy_s == one_dev.busy_s
    assert 3 * (zb.step_time_s - zb.devices[0].busy_s) <= one.step_time_s - one.devices[0].busy_s


@settings(max_examples=30, deadline=None)
@given(p=st.integers(1, 8), m=st.integers(1, 24))
def test_1f1b_stage_s_holds_at_most_min_p_minus_s_m_micro_batches(p, m):
    problem = uniform_problem(generate("1f1b", pp=p, micro_batches=m), activation_bytes=1.0,
                              static_memory_bytes={d: 100.0 for d in range(p)})
    result = simulate(problem)
    for s, report in enumerate(result.devices):
        assert report.peak_memory_bytes == 100.0 + min(p - s, m)


def slowed(problem: SimProblem, replica: int, rank: int, factor: int) -> SimProblem:
    schedule = problem.schedules[replica]
    costs = [list(row) for row in problem.stage_costs]
    for s, owner in enumerate(schedule.stage_to_rank):
        if owner == rank:
            c = costs[replica][s]
            costs[replica][s] = replace(
                c, forward_s=c.forward_s * factor, backward_input_s=c.backward_input_s * factor,
                backward_weight_s=c.backward_weight_s * factor,
            )
    return replace(problem, stage_costs=costs)


families = st.sampled_from(
    [("gpipe", {}), ("1f1b", {}), ("zb-h1", {}), ("interleaved", {"virtual_stages": 2})]
)


@settings(max_examples=40, deadline=None)
@given(family=families, p=st.integers(2, 5), m=st.integers(1, 10), data=st.data(), with_comm=st.booleans())
def test_step_time_never_decreases_when_a_device_is_slower(family, p, m, data, with_comm):
    name, knobs = family
    if name == "interleaved":
        m = p * max(1, m // p)
    schedule = generate(name, pp=p, micro_batches=m, **knobs)
    costs = [StageCost(forward_s=data.draw(durations), backward_input_s=data.draw(durations),
                       backward_weight_s=data.draw(durations), send_bytes=float(data.draw(durations)))
             for _ in range(schedule.num_stages)]
    # per-pair links: a link only ever carries one sender's transfers, in that sender's fixed order
    comm = AlphaBetaComm(alpha=0.25, beta=2.0) if with_comm else None
    problem = SimProblem(schedules=[schedule], devices=[list(range(p))], stage_costs=[costs], comm=comm)
    base = simulate(problem).step_time_s
    rank = data.draw(st.integers(0, p - 1))
    factor = data.draw(st.integers(2, 4))
    assert simulate(slowed(problem, 0, rank, factor)).step_time_s >= base
