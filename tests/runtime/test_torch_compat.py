"""The fallbacks of :mod:`medley.runtime.torch_adapter` (what torch 2.11 and 2.12 lack) behave as
torch 2.13's own APIs: on gloo, ``MEDLEY_TORCH_FALLBACKS=1`` takes them on the torch CI installs
and each figure equals the native one and the value it must have; two training cases of the
equality suite (a zero-bubble pipeline at ZeRO-3, and replicas with uneven micro-batch counts, whose
padded rounds reduce-scatter gradients they never computed) train as one process with every
fallback taken. bench/old_torch.py runs these (and more) on torch 2.11 itself."""

from __future__ import annotations

import inspect
import json
import multiprocessing
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from compat_worker import ORDER, WIDTH, WORLD, fresh_model, rank_input, run_case_with_fallbacks, uses_second
from compat_worker import worker as compat_rank
from test_equality import check, free_port, launch, two_rank_cases
from torch.distributed.fsdp import FSDPModule

from medley.runtime.torch_adapter import FALLBACKS_ENV, INTRODUCED, backward_input, backward_weight
from medley.runtime.transformer import Block, Decoder
from medley.spec.model_arg import get_model


def _expected_unused_param_shards(rank: int) -> dict[str, list]:
    """The reduce-scatter's result on ``rank``: every rank's gradient summed (a rank that skipped
    the second layer adds zeros), rows ``rank`` of ``WORLD`` (FSDP2's dim-0 shard)."""
    total: dict[str, torch.Tensor] = {}
    for r in range(WORLD):
        model = fresh_model()
        model(rank_input(r), uses_second(r)).square().sum().backward()
        for name, p in model.named_parameters():
            grad = torch.zeros_like(p) if p.grad is None else p.grad
            total[name] = total.get(name, 0) + grad
    rows = WIDTH // WORLD
    return {name: grad[rank * rows:(rank + 1) * rows].tolist() for name, grad in total.items()}


@pytest.mark.timeout(300)
def test_each_fallback_gives_what_torchs_own_api_gives(tmp_path) -> None:
    out = tmp_path / "compat.json"
    multiprocessing.set_forkserver_preload(["torch", "compat_worker"])
    mp.start_processes(compat_rank, args=(WORLD, free_port(), str(out)), nprocs=WORLD, join=True,
                       start_method="forkserver")
    ranks = json.loads(out.read_text())
    for rank, got in enumerate(ranks):
        assert "error" not in got, got["error"]
        assert got["fallback"] == got["native"], rank
        position = ORDER.index(rank)
        assert got["fallback"]["groups"] == {
            "group_rank": position, "group_ranks": ORDER, "all_gather": [float(r) for r in ORDER],
            "mesh_coordinate": [position], "dtensor_full": [float(r) for r in ORDER]}
        assert got["fallback"]["collectives"] == {
            "all_gather_single": [float(v) for r in ORDER for v in (10 * r, 10 * r + 1)],
            "reduce_scatter_single": [float(3 * i + 3) for i in (2 * position, 2 * position + 1)]}
        want = _expected_unused_param_shards(rank)
        for name, shard in got["fallback"]["unused_params"].items():
            torch.testing.assert_close(torch.tensor(shard), torch.tensor(want[name]), rtol=1e-6, atol=1e-6)


@pytest.mark.timeout(400)
def test_training_with_every_fallback_equals_one_process(tmp_path) -> None:
    cases = [case for case in two_rank_cases() if case.name in ("pp2-zbh1-zero3", "dp2-zero3-uneven-mb")]
    assert len(cases) == 2
    check(launch(2, cases, tmp_path, body=run_case_with_fallbacks), cases)


def _recomputing_stage() -> Decoder:
    return Decoder(get_model("tiny"), first_layer=1, last_layer=5, recompute=True, seed=3)


def test_split_backward_fallback_equals_torchs(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch before 2.13 neither clamps the saved gradients nor keeps a node's outputs apart in the
    weight pass (2.11's weight gradients of a recomputing stage were wrong); the fallback's are
    torch 2.13's. An input that needs no gradient gets None (2.11 leaves it out)."""
    spec = get_model("tiny")
    x = torch.randn(2, 16, spec.hidden_size, generator=torch.Generator().manual_seed(1))
    grads = {}
    for mode in ("0", "1"):
        monkeypatch.setenv(FALLBACKS_ENV, mode)
        stage = _recomputing_stage()
        assert any(isinstance(m, Block) for m in stage.modules())
        inp, constant = x.clone().requires_grad_(True), torch.zeros(1)
        out = stage(inp)
        grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
        dinputs, saved = backward_input([out], [grad], [inp, constant], list(stage.parameters()))
        assert dinputs[1] is None and dinputs[0] is not None
        backward_weight(list(stage.parameters()), saved)
        grads[mode] = [dinputs[0], *(p.grad for p in stage.parameters())]
    for native, fallback in zip(grads["0"], grads["1"], strict=True):
        torch.testing.assert_close(fallback, native, rtol=0, atol=1e-6)


def test_the_table_of_introduced_apis_matches_this_torch() -> None:
    """What :data:`INTRODUCED` says the running torch has, it has (and what it lacks, it lacks)."""
    unused = "set_reduce_scatter_unused_params"
    has = {"dist.new_group(sort_ranks=False)": "sort_ranks" in inspect.signature(dist.new_group).parameters,
           "dist.all_gather_single": hasattr(dist, "all_gather_single"),
           f"FSDPModule.{unused}": hasattr(FSDPModule, unused)}
    for feature, present in has.items():
        (since,) = [version for name, version in INTRODUCED.items() if name.startswith(feature)]
        wanted = torch.__version__ >= tuple(map(int, since.split(".")))
        assert present == wanted, (feature, torch.__version__)


# What differs across the supported torch range; only torch_adapter may spell it.
DIFFERING = ("dist.all_gather_single(", "dist.reduce_scatter_single(", "sort_ranks=",
             ".set_reduce_scatter_unused_params(", "_fsdp_param_groups", "stage_backward_input(",
             "stage_backward_weight(")
# Files whose switch to torch_adapter is pending in another change (each must still need it).
PENDING: set[str] = set()


def test_only_torch_adapter_calls_what_differs_across_torch_versions() -> None:
    src = Path(__file__).parents[2] / "src" / "medley"
    spelled = {str(path.relative_to(src)) for path in src.rglob("*.py")
               if path.name != "torch_adapter.py" and any(name in path.read_text() for name in DIFFERING)}
    assert spelled == {p for p in PENDING if (src / p).exists()}, spelled
