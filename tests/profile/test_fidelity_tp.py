"""Peak memory with tensor parallelism, predicted against the runtime's live-tensor count (CPU,
gloo, the repository's tiny profile): tp2 alone and the first stage of tp2 x pp2 within 5% on
every device, and a tp2 last stage off by no more than the same stage without TP.

The last stage of a pipeline is predicted low with or without TP (tiny, pp2, tp1: -5.1%), by
two hidden-state tensors per micro-batch already done (measured: 47 KB, 310 KB and 572 KB short
with 2, 4 and 6 micro-batches): the executor waits on its sends once per step, so each sent
input gradient (and one more tensor of its size) stays alive until the step's end, which the
simulator does not book. TP must add nothing to that: the bytes missing on a tp2
last stage equal those missing on the tp1 one, to within one hidden-state tensor (whether the
last send has completed when the peak is sampled varies by rank), in steps of half of one: a hop
between the two tp2 stages is scattered, so each pending send keeps a half-size slice
(:func:`medley.plan.layout.tp_scattered`).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from medley.cost.profile_format import load_profile
from medley.fidelity.cases import default_cases
from medley.fidelity.loop import run_case
from medley.fidelity.results import FidelityResult

PROFILE = Path(__file__).parents[2] / "bench" / "results" / "profile-cpu-tiny.json"
BOUND = 0.05
HIDDEN = 2 * 128 * 64 * 4  # one fp32 hidden-state tensor of the cases' micro-batch (2 x 128 tokens)
SLACK = 4096  # bytes: small tensors (RoPE tables, norm statistics)


def _run(name: str, directory: Path) -> FidelityResult:
    case = next(c for c in default_cases() if c.name == name)
    return run_case(case, load_profile(PROFILE), profile_name=PROFILE.name, directory=directory, steps=2,
                    warmup_steps=1)


def _error(result: FidelityResult, device: int) -> float:
    return result.predicted_memory[device] - result.measured_memory[device]


@pytest.mark.timeout(600)
def test_tp_memory_matches_the_runtime(tmp_path: Path) -> None:
    tp2 = _run("tiny-tp2", tmp_path)
    assert sorted(tp2.measured_memory) == [0, 1]
    assert all(abs(_error(tp2, d)) <= BOUND * tp2.measured_memory[d] for d in (0, 1)), tp2
    piped = _run("tiny-tp2-pp2", tmp_path)
    assert all(abs(_error(piped, d)) <= BOUND * piped.measured_memory[d] for d in (0, 1)), piped
    # The same pipeline without TP (the planner-regime case's shapes): its last stage's shortfall.
    plain = _run("tiny-pp2-1f1b", tmp_path)
    for device in (2, 3):
        extra = _error(piped, device) - _error(plain, 1)
        # 0, or up to one hidden-state send buffer more or less, in half-size slices; scaling a
        # measured block's bytes by the formulas' tp ratio was 53 KB short here (26 KB per block).
        assert min(abs(extra - k * HIDDEN / 2) for k in (-2, -1, 0, 1, 2)) <= SLACK, (device, extra)
