"""--explain's knob sentences (issue 30, item 9): no "(+0.0%)", and an alternative the search
left out that would be faster is said to be faster, not given a bare negative percentage."""

from __future__ import annotations

from medley.search.report.explain import Explanation, KnobEffect


def lines(*knobs: KnobEffect) -> list[str]:
    return Explanation(bottleneck_device=0, bottleneck_type="A100-80GB", bottleneck_busy=0.9,
                       tightest_device=1, tightest_type="T4-16GB", tightest_headroom_gb=1.0,
                       tightest_stage_option="ZeRO-1",
                       knobs=list(knobs), versus_baselines={}, aggregate_fraction=0.5,
                       precision="bf16: every device of the plan has it").lines()


def test_knob_sentences_say_same_slower_or_faster_in_words() -> None:
    same, slower, faster = (KnobEffect(knob=k, chosen="a", alternative="b", step_time_s=t, slowdown=r)
                            for k, t, r in (("placement", 6.846, 1.0001), ("schedule", 7.2, 1.052),
                                            ("recomputation", 33.45, 0.999)))
    out = lines(same, slower, faster)
    assert "placement: a; b gives the same step (6.846 s)." in out
    assert "schedule: a; with b the step takes 7.200 s (+5.2%)." in out
    assert "recomputation: a; with b the step would take 33.450 s, 0.1% less (a variant the search did not " \
           "simulate)." in out
    assert "Precision: bf16: every device of the plan has it." in out
    assert not any("+0.0%" in line or "(-" in line for line in out)
