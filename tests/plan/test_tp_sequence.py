"""Sequence parallelism in plans: the optional plan-file field (old plans read as before), the
refusal of a sequence the degrees do not divide, which pipeline edges carry sequence shards, and
what the compiler books for it: the blocks' all-gathers and reduce-scatters in place of the
all-reduces, the stage edges' gathers, no gather at a sharded hop, and less activation memory."""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path

import pytest
import tomli_w

from medley.cost.estimator import CatalogCostSource
from medley.cost.formulas import DTYPE_BYTES
from medley.cost.interfaces import Collective
from medley.cost.tp_cost import tp_all_reduce_bytes
from medley.errors import MedleyInputError
from medley.lowering.compile import compile_problem
from medley.plan.inline import inline_layout
from medley.plan.layout import PlanLayout, check_tp, planned_sequence_parallel, sequence_sharded_edges
from medley.plan.plan import Plan, load_plan, save_plan
from medley.spec.cluster_load import parse_cluster_arg
from medley.spec.model_arg import get_model

CLUSTER = "4xA100-80GB"


def _layout(model: str = "llama-2-7b", **changes) -> tuple[PlanLayout, object]:
    cluster = parse_cluster_arg(CLUSTER)
    spec = get_model(model)
    layout = inline_layout(
        cluster=cluster, model=spec, cost=CatalogCostSource.for_cluster(spec, cluster), pp=2, dp=1,
        schedule="1f1b", micro_batches="8", micro_batch_size=1, seq_len=4096, zero="0,0", tp="2",
    )
    return dataclasses.replace(layout, **changes), cluster


def test_the_plan_file_carries_sequence_parallel_and_old_plans_read_without_it(tmp_path: Path) -> None:
    layout, cluster = _layout(sequence_parallel=True)
    save_plan(Plan(layout=layout, cluster=cluster), tmp_path / "plan.toml")
    raw = tomllib.loads((tmp_path / "plan.toml").read_text())
    assert raw["layout"]["sequence_parallel"] is True
    assert load_plan(tmp_path / "plan.toml").layout == layout
    del raw["layout"]["sequence_parallel"]  # a plan written before the field
    (tmp_path / "old.toml").write_text(tomli_w.dumps(raw))
    assert load_plan(tmp_path / "old.toml").layout == dataclasses.replace(layout, sequence_parallel=False)
    save_plan(Plan(layout=dataclasses.replace(layout, sequence_parallel=False), cluster=cluster),
              tmp_path / "off.toml")
    assert "sequence_parallel" not in tomllib.loads((tmp_path / "off.toml").read_text())["layout"]


def test_a_sequence_the_degree_does_not_divide_is_refused(tmp_path: Path) -> None:
    layout, cluster = _layout(sequence_parallel=True, seq_len=4095)
    with pytest.raises(MedleyInputError, match="sequence_parallel.*4095.*degree 2"):
        check_tp(layout, cluster)
    check_tp(dataclasses.replace(layout, sequence_parallel=False), cluster)  # plain TP runs it
    assert not planned_sequence_parallel(4095, (2, 2)) and planned_sequence_parallel(4096, (2, 1))
    assert not planned_sequence_parallel(4096, (1, 1))


def test_only_edges_between_blocks_on_groups_of_one_degree_carry_shards() -> None:
    layout, _ = _layout(sequence_parallel=True)
    assert sequence_sharded_edges(layout) == {0}
    assert sequence_sharded_edges(dataclasses.replace(layout, sequence_parallel=False)) == frozenset()
    assert sequence_sharded_edges(dataclasses.replace(layout, tp=(2, 1))) == frozenset()
    last = layout.model.num_layers - 1  # stage 1 holds the head only: its first layer is no block
    assert sequence_sharded_edges(dataclasses.replace(layout, stage_layers=(last, 1))) == frozenset()


def test_the_compiler_books_gathers_and_scatters_and_less_memory() -> None:
    layout, cluster = _layout(sequence_parallel=True)
    cost = CatalogCostSource.for_cluster(layout.model, cluster)
    on = compile_problem(layout, cluster, cost)
    off = compile_problem(dataclasses.replace(layout, sequence_parallel=False), cluster, cost)
    nbytes = tp_all_reduce_bytes(layout.model, micro_batch_size=1, seq_len=4096, dtype=layout.dtype)
    comm, group = on.comm, layout.group(0, 0)
    pair = comm.collective_time(Collective.ALL_GATHER, group, nbytes) + comm.collective_time(
        Collective.REDUCE_SCATTER, group, nbytes)
    assert pair == pytest.approx(comm.collective_time(Collective.ALL_REDUCE, group, nbytes))
    gather = comm.collective_time(Collective.ALL_GATHER, group, nbytes)
    first, second = on.stage_costs[0]
    first_off, second_off = off.stage_costs[0]
    # Stage 0 (embedding + blocks): the embedding's gradient all-gathered whole in B, where plain
    # TP all-gathers the scattered hop's gradient slices instead (one gather of the same bytes
    # either way); its output crosses as shards, with no gather on either side.
    assert first.backward_input_s + first.backward_weight_s == pytest.approx(
        first_off.backward_input_s + first_off.backward_weight_s)
    assert first.forward_s == pytest.approx(first_off.forward_s)
    # Stage 1 (blocks + head): its output gathered whole for the head in F, where plain TP
    # gathers the hop's slices of its input.
    assert second.forward_s == pytest.approx(second_off.forward_s)
    assert gather > 0
    assert first.send_bytes == first_off.send_bytes  # the shard: a scattered hop's slice
    d, h, s = DTYPE_BYTES[layout.dtype], layout.model.hidden_size, 4096
    blocks = layout.stage_layers[0] - 1
    saved = blocks * 2 * s * h * d * (1 - 1 / 2)  # block input and MLP-norm input, halved
    assert first_off.activation_bytes - first.activation_bytes == pytest.approx(saved)
    assert max(on.static_memory_bytes.values()) == max(off.static_memory_bytes.values())


def test_the_time_books_the_edges_the_runtime_pays() -> None:
    """pp 2 with tp 2 on the first rank only: no sharded edge, so the first stage all-gathers its
    output in F (for the hop to a group of another degree) and its input's gradient in B."""
    layout, cluster = _layout(sequence_parallel=True, tp=(2, 1))
    cost = CatalogCostSource.for_cluster(layout.model, cluster)
    on = compile_problem(layout, cluster, cost).stage_costs[0][0]
    plain = dataclasses.replace(layout, sequence_parallel=False)
    off = compile_problem(plain, cluster, cost).stage_costs[0][0]
    nbytes = tp_all_reduce_bytes(layout.model, micro_batch_size=1, seq_len=4096, dtype=layout.dtype)
    problem = compile_problem(layout, cluster, cost)
    gather = problem.comm.collective_time(Collective.ALL_GATHER, layout.group(0, 0), nbytes)
    assert on.forward_s == pytest.approx(off.forward_s + gather)
    assert on.backward_input_s + on.backward_weight_s == pytest.approx(
        off.backward_input_s + off.backward_weight_s + gather)
