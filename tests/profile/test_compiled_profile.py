"""`medley profile --compile`: the blocks are timed compiled (as `medley train --compile` runs
them) and the file says so; the planner reads it as any profile."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch._dynamo.utils
from typer.testing import CliRunner

from medley.cli.main import app
from medley.cost.profile_format import load_profile


@pytest.mark.timeout(300)
def test_profile_compile_times_compiled_blocks_and_records_it(tmp_path: Path) -> None:
    out = tmp_path / "tiny-compiled.json"
    args = ["profile", "--model", "tiny", "--micro-batch-sizes", "1", "--seq-len", "16", "--runs", "1",
            "--no-overhead", "--comm-ranks", "0", "--compile", "--out", str(out), "--json"]
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    # The plain block, the FSDP2-wrapped one and the TP one: each traced by dynamo.
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= graphs + 3
    profile = load_profile(out)
    assert profile.compiled and json.loads(result.output)["compiled"] is True
    block = next(m for m in profile.layers if m.kind == "block")
    assert min(block.forward_s, block.backward_input_s, block.backward_weight_s, block.backward_full_s) > 0
    assert block.fsdp_forward_s and block.tp_forward_s
    simulated = CliRunner().invoke(app, ["simulate", "--model", "tiny", "--cluster", "2xCPU-8GB", "--pp", "2",
                                         "--micro-batch-size", "1", "--seq-len", "16", "--profile", str(out),
                                         "--json"])
    assert simulated.exit_code == 0, simulated.output
    assert json.loads(simulated.output)["cost_sources"]["CPU-8GB"]["block"] == f"profile:{out.name}"


def test_profiles_written_before_compile_read_as_eager(tmp_path: Path, profile) -> None:  # noqa: ANN001
    path = tmp_path / "old.json"
    raw = profile.model_dump(mode="json")
    raw.pop("compiled")
    path.write_text(json.dumps(raw))
    assert load_profile(path).compiled is False
