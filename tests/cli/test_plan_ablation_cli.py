"""``medley plan``'s baselines carry their shapes and names, and ``--ablation`` prints one line
per constrained search with the figures its JSON holds."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from medley.cli.main import app
from medley.search.rank.baselines import NAMES
from medley.search.report.ablation import STEPS

ARGS = ["plan", "--cluster", "4xA100-80GB+4xV100-32GB", "--model", "tiny", "--global-batch", "32",
        "--seq-len", "128", "--top", "1", "--ablation"]


def _run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, list(args), env={"COLUMNS": "200"})
    return result.exit_code, result.output


def test_plan_json_names_the_baselines_and_holds_the_ablation() -> None:
    code, out = _run(*ARGS, "--json")
    assert code == 0, out
    data = json.loads(out)
    assert tuple(data["baselines"]) == NAMES
    assert not any(name in ("metis", "megatron") for name in data["baselines"])
    one_type = data["baselines"]["megatron-lm-style-one-type"]
    assert len(one_type["device_types"]) == 1 and set(one_type["tp"]) == {1}
    assert set(one_type["zero"]) == {1 if one_type["dp"] > 1 else 0}
    assert data["baselines"]["metis-style"]["schedule"] == "1f1b"
    ablation = data["ablation"]
    assert [s["without"] for s in ablation["steps"]] == list(STEPS)
    best = data["plans"][0]["step_time_s"]
    assert ablation["best_step_time_s"] == best
    assert all(s["step_time_s"] >= best * (1 - 1e-9) for s in ablation["steps"])


def test_plan_table_prints_an_ablation_line_per_step() -> None:
    code, out = _run(*ARGS)
    assert code == 0, out
    for name in NAMES:
        assert f"baseline {name}:" in out
    assert "ablation: best plan" in out
    for step in STEPS:
        assert f"without {step} (" in out


def test_shares_outside_0_to_1_are_said_in_words() -> None:
    from medley.cli.plan_report import share_words

    assert share_words(0.42, 1.2, 1.0, "metis-style") == ", 42% of the gain"
    # Without the freedom, 3x the best step while the baseline is 1.1x: not "939% of the gain".
    assert share_words(9.39, 3.0, 1.0, "metis-style") == \
        ", 3.00x the best plan's step: slower than metis-style without it"
    assert share_words(-0.05, 0.98, 1.0, "metis-style") == \
        ", 2.0% faster than the best plan: a plan the planner's pruning missed"
    assert share_words(None, None, 1.0, None) == ""
