"""Ranks run on the plan's devices (issue #12, placement): identities -> rank table without
processes, then `medley train` itself: the placement the ranks report, equality with the row-major
run, and a missing rank, an extra rank or a mismatched GPU as exit 2 with one line."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from launch_plans import cluster_file, node_toml, plan_file, tiny_plan
from typer.testing import CliRunner

from medley.cli.main import app
from medley.errors import MedleyInputError
from medley.launch.nodes import free_port
from medley.runtime.placement import RankIdentity, find_node, rank_table

MEDLEY = str(Path(sys.executable).with_name("medley"))
ONE_AND_THREE = (node_toml("one", 1, host="host-a"), node_toml("three", 3, host="host-b"))
A100_BYTES = 85_899_345_920  # what torch reports for an A100-SXM4-80GB


def on_one_machine(world: int) -> list[RankIdentity]:
    return [RankIdentity(rank=r, node=None, local_rank=r, local_world=world) for r in range(world)]


def two_node_plan(tmp_path: Path, assignment: tuple[tuple[int, ...], ...] = ((3, 0), (1, 2))):  # noqa: ANN201
    return tiny_plan(cluster_file(tmp_path, *ONE_AND_THREE), pp=2, dp=2, assignment=assignment, split="2,2")


def node_identities(order: list[tuple[str, int]], local_world: dict[str, int]) -> list[RankIdentity]:
    """Global rank i is (node, local rank) ``order[i]``: the order torchrun happened to give."""
    return [RankIdentity(rank=r, node=node, local_rank=local, local_world=local_world[node])
            for r, (node, local) in enumerate(order)]


def test_one_machine_rank_i_is_plan_device_i(tmp_path: Path) -> None:
    plan = two_node_plan(tmp_path)
    assert rank_table(plan, on_one_machine(4)) == (((3,), (0,)), ((1,), (2,)))


def test_two_nodes_in_any_rank_order(tmp_path: Path) -> None:
    """Node 'three' holds devices 1, 2, 3 (its local ranks 0, 1, 2), node 'one' device 0."""
    plan = two_node_plan(tmp_path)
    order = [("three", 2), ("one", 0), ("three", 0), ("three", 1)]  # ranks 0..3
    # device 3 = rank 0, device 0 = rank 1, device 1 = rank 2, device 2 = rank 3
    assert rank_table(plan, node_identities(order, {"one": 1, "three": 3})) == (((0,), (1,)), ((2,), (3,)))


@settings(max_examples=25, deadline=None)
@given(st.permutations([("one", 0), ("three", 0), ("three", 1), ("three", 2)]))
def test_every_position_gets_the_rank_on_its_planned_device(tmp_path_factory, order) -> None:  # noqa: ANN001
    plan = two_node_plan(tmp_path_factory.mktemp("p"))
    table = rank_table(plan, node_identities(list(order), {"one": 1, "three": 3}))
    device_of = {"one": [0], "three": [1, 2, 3]}
    for r, row in enumerate(plan.layout.assignment):
        for p, device in enumerate(row):
            node, local = order[table[r][p][0]]
            assert device_of[node][local] == device


def test_tp_groups_take_every_device_of_their_group(tmp_path: Path) -> None:
    """tp (2, 1): pipeline rank 0 runs on devices 2 and 3 (its group from assignment 2), pipeline
    rank 1 on device 0; on one machine rank i is the i-th plan device (0, 2, 3)."""
    path = cluster_file(tmp_path, node_toml("four", 4))
    plan = tiny_plan(path, pp=2, dp=1, assignment=((2, 0),), split="2,2", tp=(2, 1))
    assert rank_table(plan, on_one_machine(3)) == (((1, 2), (0,)),)
    order = [("four", 2), ("four", 1), ("four", 0)]  # local rank i is the node's i-th plan device
    assert rank_table(plan, node_identities(order, {"four": 3})) == (((1, 0), (2,)),)
    with pytest.raises(MedleyInputError, match=r"plan device 3 .*pipeline rank 0 of replica 0\) has no rank"):
        rank_table(plan, on_one_machine(2))


def one_line(err: pytest.ExceptionInfo) -> str:
    text = str(err.value)
    assert "\n" not in text
    return text


def test_missing_rank(tmp_path: Path) -> None:
    with pytest.raises(MedleyInputError) as err:
        rank_table(two_node_plan(tmp_path), node_identities([("one", 0), ("three", 0), ("three", 1)],
                                                            {"one": 1, "three": 2}))
    assert one_line(err) == (
        "plan device 3 (CPU-8GB on node 'three', local rank 2: pipeline rank 0 of replica 0) has no rank: "
        "2 rank(s) started on node 'three'; start 3 there (torchrun --nproc-per-node 3, or medley launch)")


def test_extra_rank(tmp_path: Path) -> None:
    order = [("one", 0), ("one", 1), ("three", 0), ("three", 1), ("three", 2)]
    with pytest.raises(MedleyInputError) as err:
        rank_table(two_node_plan(tmp_path), node_identities(order, {"one": 2, "three": 3}))
    assert one_line(err) == (
        "rank 1 (node 'one', local rank 1) has no plan device: the plan uses 1 device(s) on node 'one' "
        "(ids 0) but 2 rank(s) started there; start 1 (torchrun --nproc-per-node 1, or medley launch)")


def test_two_agents_for_one_node(tmp_path: Path) -> None:
    order = [("three", 0), ("three", 1), ("three", 0), ("three", 1)]
    with pytest.raises(MedleyInputError, match=r"rank 2 \(node 'three', local rank 0\) and rank 0 .* are "
                                                 r"both plan device 1"):
        rank_table(two_node_plan(tmp_path), node_identities(order, {"three": 2}))


def test_a_gpu_not_of_the_planned_type(tmp_path: Path) -> None:
    """Injected CUDA identities: the plan puts an A100-80GB where a T4 is."""
    path = cluster_file(tmp_path, node_toml("gpus", 2, device="A100-80GB"))
    plan = tiny_plan(path, pp=2, dp=1, assignment=((1, 0),), split="2,2")
    found = [("NVIDIA A100-SXM4-80GB", A100_BYTES), ("Tesla T4", 15_655_829_504)]
    identities = [RankIdentity(rank=r, node="gpus", local_rank=r, local_world=2, gpu_name=name,
                               gpu_memory_bytes=memory) for r, (name, memory) in enumerate(found)]
    with pytest.raises(MedleyInputError) as err:
        rank_table(plan, identities)
    line = one_line(err)
    assert line.startswith("rank 1 (node 'gpus', local rank 1): the plan puts device 1 (A100-80GB, pipeline "
                           "rank 0 of replica 0) here but cuda:1 is 'Tesla T4' with 15.7 GB: ")
    identities[1] = identities[0].__class__(**{**identities[1].__dict__, "gpu_name": "NVIDIA A100-SXM4-80GB",
                                               "gpu_memory_bytes": A100_BYTES})
    assert rank_table(plan, identities) == (((1,), (0,)),)


def test_which_node_this_machine_is(tmp_path: Path) -> None:
    plan = two_node_plan(tmp_path)
    find = lambda env, host, local: find_node(plan.cluster, env=env, hostname=host,  # noqa: E731
                                              local_world=local, world=4)
    assert find({"MEDLEY_NODE": "three"}, "x", 3) == "three"
    assert find({}, "host-b.example.org", 3) == "three"
    assert find({}, "host-b", 4) is None  # every rank here: this machine plays every node
    with pytest.raises(MedleyInputError, match="MEDLEY_NODE='four' is not a node of cluster 'launch-test'"):
        find({"MEDLEY_NODE": "four"}, "x", 3)
    with pytest.raises(MedleyInputError, match=r"cannot tell which node .*\(host 'elsewhere'\)"):
        find({}, "elsewhere", 3)


def test_a_rank_that_cannot_tell_its_node_fails_every_rank(tmp_path: Path) -> None:
    identities = on_one_machine(4)
    identities[2] = RankIdentity(rank=2, node=None, local_rank=0, local_world=1, error="cannot tell")
    with pytest.raises(MedleyInputError, match="^rank 2: cannot tell$"):
        rank_table(two_node_plan(tmp_path), identities)


TINY = ["--model", "tiny", "--pp", "2", "--dp", "2", "--split", "2,2", "--micro-batches", "3,1", "--zero",
        "3,1", "--seq-len", "32", "--steps", "3", "--clip-norm", "0", "--json"]


def train_json(*args: str) -> dict:
    result = CliRunner().invoke(app, ["train", "--local-ranks", "4", *TINY, *args])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout[result.stdout.index("{"):])


@pytest.mark.timeout(240)
def test_train_reports_the_planned_placement_and_equals_the_row_major_run() -> None:
    """The issue's pp2 x dp2 with 3,0;1,2: each rank reports the plan's device, replica, pipeline
    rank and stages, and the run equals the default (row-major) placement to 1e-5."""
    placed = train_json("--assignment", "3,0;1,2")
    assert [(e["rank"], e["node"], e["device"], e["replica"], e["pipeline_rank"], e["stages"])
            for e in placed["placement"]] == [(0, "node0", 0, 0, 1, [1]), (1, "node0", 1, 1, 0, [0]),
                                              (2, "node0", 2, 1, 1, [1]), (3, "node0", 3, 0, 0, [0])]
    row_major = train_json("--assignment", "0,1;2,3")
    for a, b in zip(placed["records"], row_major["records"], strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 and abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5


@pytest.mark.timeout(240)
def test_pp4_reports_2_0_3_1() -> None:
    result = CliRunner().invoke(app, ["train", "--local-ranks", "4", "--model", "tiny", "--pp", "4",
                                      "--split", "1,1,1,1", "--micro-batches", "4", "--seq-len", "32",
                                      "--steps", "2", "--assignment", "2,0,3,1", "--json"])
    assert result.exit_code == 0, result.output
    placement = json.loads(result.stdout[result.stdout.index("{"):])["placement"]
    assert {e["device"]: (e["replica"], e["pipeline_rank"]) for e in placement} == {
        2: (0, 0), 0: (0, 1), 3: (0, 2), 1: (0, 3)}
    assert all(e["device"] == e["rank"] for e in placement)  # one machine: rank i is device i


def start_ranks(plan: Path, ranks: list[tuple[str, int, int]]) -> list[subprocess.CompletedProcess]:
    """``medley train --plan`` once per (MEDLEY_NODE, LOCAL_RANK, LOCAL_WORLD_SIZE), with the
    environment torchrun would give each rank (global rank = position in ``ranks``)."""
    port, world = free_port(), len(ranks)
    procs = []
    for rank, (node, local, local_world) in enumerate(ranks):
        env = {**os.environ, "MEDLEY_NODE": node, "RANK": str(rank), "WORLD_SIZE": str(world),
               "LOCAL_RANK": str(local), "LOCAL_WORLD_SIZE": str(local_world), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port)}
        procs.append(subprocess.Popen([MEDLEY, "train", "--plan", str(plan), "--steps", "1"], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return [subprocess.CompletedProcess(p.args, p.wait(timeout=180), *p.communicate()) for p in procs]


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("ranks", "line"), [
    ([("one", 0, 1), ("three", 0, 2), ("three", 1, 2)],
     "error: plan device 3 (CPU-8GB on node 'three', local rank 2: pipeline rank 0 of replica 0) has no "
     "rank: 2 rank(s) started on node 'three'; start 3 there (torchrun --nproc-per-node 3, or medley "
     "launch)"),
    ([("three", 0, 3), ("one", 0, 2), ("three", 1, 3), ("one", 1, 2), ("three", 2, 3)],
     "error: rank 3 (node 'one', local rank 1) has no plan device: the plan uses 1 device(s) on node 'one' "
     "(ids 0) but 2 rank(s) started there; start 1 (torchrun --nproc-per-node 1, or medley launch)"),
], ids=["missing-rank", "extra-rank"])
def test_medley_train_exits_2_with_one_line(tmp_path: Path, ranks: list, line: str) -> None:
    plan = two_node_plan(tmp_path)
    plan = dataclasses.replace(plan, layout=dataclasses.replace(plan.layout, dtype="fp32"))  # what CPUs run
    done = start_ranks(plan_file(tmp_path, plan), ranks)
    assert [d.returncode for d in done] == [2] * len(ranks), [d.stderr for d in done]
    assert done[0].stderr.strip().splitlines() == [line]
    assert all(not d.stderr.strip() for d in done[1:]), [d.stderr for d in done[1:]]


def test_simulate_follows_the_assignment() -> None:
    """The same pp3 plan on the demo cluster: T4 -> V100 -> A100 instead of A100 -> V100 -> T4; the
    split follows the devices (the slowest stage gets the fewest layers)."""
    def simulate(assignment: str) -> dict:
        result = CliRunner().invoke(app, ["simulate", "--cluster", "examples/demo.toml", "--model",
                                          "llama-2-7b", "--pp", "3", "--micro-batches", "4", "--assignment",
                                          assignment, "--json"])
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)

    forward, backward = simulate("0,4,8"), simulate("8,4,0")
    assert forward["split"] == list(reversed(backward["split"]))
    assert forward["split"][0] > forward["split"][2]


@pytest.mark.parametrize(("text", "says"), [
    ("3,0;0,2", "--assignment '3,0;0,2' uses device 0 twice"),
    ("3,0;1,4", "--assignment '3,0;1,4': device 4 is not in cluster"),
    ("3,0", "--assignment '3,0': give 2 replica row(s) (--dp)"),
])
def test_a_bad_assignment_is_one_line(text: str, says: str) -> None:
    result = CliRunner().invoke(app, ["train", "--local-ranks", "4", "--pp", "2", "--dp", "2", "--cluster",
                                      "4xA100-80GB", "--assignment", text])
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 2 and len(lines) == 1 and says in lines[0], result.output
