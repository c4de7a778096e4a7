"""LoRA in the planner and the simulator: a frozen base keeps its weights but no gradient or
optimizer state, its weight gradients are not computed, and reductions and optimizer steps carry
the adapters only; the planner's estimates and the compiler book the same, and the search finds
LoRA plans where full training does not fit."""

from __future__ import annotations

import pytest

from medley.cost import formulas
from medley.cost.estimator import CatalogCostSource
from medley.cost.tp_cost import TensorPricing
from medley.cost.zero_memory import adapted_state_bytes, state_bytes_per_param
from medley.errors import MedleyInputError
from medley.lowering.compile import compile_problem
from medley.plan.layout import PlanLayout
from medley.schedule.zero import split_evenly
from medley.schedule.zero_settings import StageZero
from medley.search.estimate.bounds import Flight, memory_prefix, option_bytes_per_param, stage_memory
from medley.search.estimate.layer_table import layer_table
from medley.search.planner import search
from medley.search.report.explain import explain
from medley.search.space import Constraints, memory_option
from medley.spec.adapter import LoraSpec
from medley.spec.cluster_load import parse_cluster_arg
from medley.spec.model_arg import get_model

MODEL = get_model("llama-2-7b")
LORA = LoraSpec(rank=16, alpha=32.0)
CLUSTER = parse_cluster_arg("2xA100-80GB")
COST = CatalogCostSource.for_cluster(MODEL, CLUSTER)


def _table(adapter: LoraSpec | None):
    return layer_table(MODEL, COST, device_type="A100-80GB", micro_batch_size=1, seq_len=1024, dtype="bf16",
                       tensor=TensorPricing(MODEL, COST, CLUSTER).of("bf16"), adapter=adapter)


def test_the_adapter_counts_its_parameters_and_drops_the_base_weight_gradients() -> None:
    full, lora = _table(None), _table(LORA)
    # Per block r (in + out) for q, k, v, o, gate, up, down (Llama-2-7B: MHA, ffn 11008).
    per_block = 16 * (4 * (4096 + 4096) + 3 * (4096 + 11008))
    assert LORA.block_params(MODEL) == per_block
    assert lora.trained[-1] == per_block * MODEL.num_blocks
    assert lora.params[-1] == full.params[-1] + lora.trained[-1]
    assert full.trained == full.params
    head, block = MODEL.num_layers - 1, 1
    assert lora.weight[head + 1] - lora.weight[head] == 0.0  # the frozen head's W is gone
    assert lora.weight[1] - lora.weight[0] == 0.0  # and the embedding's
    share = per_block / (formulas.layer_held_params(MODEL, block) + per_block)
    assert lora.weight[block + 1] - lora.weight[block] == pytest.approx(
        (full.weight[block + 1] - full.weight[block]) * share)
    assert lora.forward == full.forward and lora.backward == full.backward


@pytest.mark.parametrize("level", [0, 1, 3])
def test_the_estimates_and_the_compiler_book_one_lora_state(level: int) -> None:
    table = _table(LORA)
    option, dp = memory_option(level), 2
    for i, j in [(0, 5), (3, 17), (20, MODEL.num_layers)]:
        params, trained = table.params[j] - table.params[i], table.trained[j] - table.trained[i]
        state = adapted_state_bytes(params, trained=trained, level=level, dp=dp,
                                    per_param=state_bytes_per_param("bf16"),
                                    bucket_fraction=max(split_evenly(j - i, option.buckets)) / (j - i)).peak
        exact = stage_memory(table, i, j, option=option, dp=dp, in_flight=0.0)
        assert exact == pytest.approx(state, rel=1e-6)
        prefix = memory_prefix(table, option=option, dp=dp, flight=Flight(full=0.0))
        assert prefix[j] - prefix[i] == pytest.approx(
            (params - trained) * option_bytes_per_param(option, dp, dtype="bf16", frozen=True)
            + trained * option_bytes_per_param(option, dp, dtype="bf16"))
    layout = PlanLayout(model=MODEL, pp=1, dp=dp, assignment=((0,), (1,)), stage_layers=(MODEL.num_layers,),
                        schedule="1f1b", micro_batches=(2, 2), micro_batch_size=1, seq_len=1024,
                        zero=(StageZero(level=level, buckets=1),), dtype="bf16", adapter=LORA)
    problem = compile_problem(layout, CLUSTER, COST)
    resident = adapted_state_bytes(table.params[-1], trained=table.trained[-1], level=level, dp=dp,
                                   per_param=state_bytes_per_param("bf16")).resident
    assert problem.static_memory_bytes[0] == pytest.approx(resident)
    full = compile_problem(PlanLayout(**{**layout.__dict__, "adapter": None}), CLUSTER, COST)
    # The base is held in bf16 (2 B per parameter, FSDP2's shard beside the gathered weights at
    # ZeRO-1), not 16-18 B of training state.
    assert problem.static_memory_bytes[0] <= 0.4 * full.static_memory_bytes[0]
    lora_cost, full_cost = problem.stage_costs[0][0], full.stage_costs[0][0]
    assert lora_cost.backward_weight_s < 0.05 * full_cost.backward_weight_s
    assert lora_cost.forward_s == pytest.approx(full_cost.forward_s)


@pytest.mark.timeout(300)
def test_the_search_plans_lora_where_full_training_does_not_fit() -> None:
    cluster = parse_cluster_arg("4xRTX3090-24GB")
    model = get_model("llama-3-8b")
    settings = dict(global_batch=16, seq_len=1024, baselines=False)
    with pytest.raises(MedleyInputError):
        search(cluster, model, constraints=Constraints(asymmetric=False), **settings)
    result = search(cluster, model, constraints=Constraints(asymmetric=False, adapter=LORA), **settings)
    best = result.best.plan
    assert best.shared.adapter == LORA and result.best.fits
    assert all(report.peak_memory_bytes <= 24e9 for report in result.best.result.devices)
    said = [line for line in explain(result).lines() if line.startswith("adapter: ")]
    assert said and "LoRA rank 16" in said[0] and "with full training (does not fit in memory)" in said[0]
