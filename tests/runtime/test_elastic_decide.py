"""What an elastic run's leading rank decides from who is present (no ranks start): the plan in force,
re-plans for lost, returning and slowed devices, the events, the files beside the checkpoints, and
the commands and refusals of ``medley launch --elastic``."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
from launch_plans import TIERS, cluster_file, node_toml
from typer.testing import CliRunner

from medley.cli.main import app
from medley.elastic.decide import Member, decide, pool_devices
from medley.elastic.replan import global_batch, with_slowed
from medley.errors import MedleyInputError
from medley.launch import elastic_dir
from medley.launch.local_agent import wait_for_admission
from medley.launch.nodes import ElasticSettings, LaunchSettings, node_launches
from medley.plan.plan import Plan, load_plan, save_plan
from medley.search.planner import search
from medley.spec.cluster_load import load_cluster
from medley.spec.model_arg import get_model


def three(directory: Path, *, memory_gb: float | None = None) -> Path:
    memory = "" if memory_gb is None else f"memory_gb = {memory_gb}\n"
    path = directory / "cluster.toml"
    path.write_text('name = "three"\n' + "".join(
        f'[[nodes]]\nname = "{n}"\ndevice = "CPU-8GB"\ncount = 1\n{memory}' for n in "abc") + TIERS)
    return path


def launched(directory: Path, *, memory_gb: float | None = None) -> tuple[Plan, Path]:
    cluster = load_cluster(three(directory, memory_gb=memory_gb))
    plan = search(cluster, get_model("tiny"), global_batch=12, seq_len=32, top=1, baselines=False).best.plan
    path = directory / "plan.toml"
    save_plan(plan, path)
    return plan, path


def members(*nodes: str) -> list[Member]:
    return [Member(rank=r, node=n, local_rank=0) for r, n in enumerate(nodes)]


def test_lost_then_returning_node_re_plan_and_keep_the_global_batch(tmp_path: Path) -> None:
    plan, path = launched(tmp_path)
    ckpt = tmp_path / "ckpt"
    first = decide(plan, path, ckpt, members("a", "b", "c"), run_id="r", restarted=False)
    assert (first.plan, first.trainers) == (str(path.resolve()), [0, 1, 2])
    assert first.event is None and first.error is None
    lost = decide(plan, path, ckpt, members("a", "b"), run_id="r", restarted=True)
    assert lost.error is None and Path(lost.plan).name == "plan-0001.toml"
    assert lost.event is not None and lost.event["event"] == "node lost" and lost.event["nodes"] == ["c"]
    new = load_plan(Path(lost.plan))
    assert sorted(new.devices) == [0, 1] and global_batch(new) == global_batch(plan) == 12
    assert new.shared.seq_len == plan.shared.seq_len and new.shared.dtype == plan.shared.dtype
    state = json.loads((ckpt / "elastic" / "state.json").read_text())
    assert state == {"run_id": "r", "plan": "plan-0001.toml", "present": [0, 1]}
    again = decide(plan, path, ckpt, members("b", "a"), run_id="r", restarted=True)  # same devices: kept
    assert again.plan == lost.plan and again.event is not None and again.event["event"] == "restart"
    assert again.device == {0: 1, 1: 0} and again.trainers == [0, 1]
    back = decide(plan, path, ckpt, members("a", "b", "c"), run_id="r", restarted=True)
    assert back.event is not None and back.event["event"] == "node joined" and back.event["nodes"] == ["c"]
    assert Path(back.plan).name == "plan-0002.toml"
    assert sorted(load_plan(Path(back.plan)).devices) == [0, 1, 2]
    fresh = decide(plan, path, ckpt, members("a", "b", "c"), run_id="another", restarted=False)
    assert fresh.plan == str(path.resolve()) and fresh.event is None  # a new launch starts from its plan


def test_a_straggler_is_planned_at_its_measured_speed_and_the_plan_file_keeps_it(tmp_path: Path) -> None:
    plan, path = launched(tmp_path)
    slow = decide(plan, path, tmp_path / "ckpt", members("a", "b", "c"), run_id="r", restarted=False,
                  slower={2: 4.0})
    assert slow.event is not None and slow.event["event"] == "straggler"
    assert slow.event["slower"] == {"2": 4.0}
    new = load_plan(Path(slow.plan))
    fast, slowed = new.cluster.devices[0].type, new.cluster.devices[2].type
    assert slowed.peak_tflops_half == pytest.approx(fast.peak_tflops_half / 4)


def test_too_few_devices_for_any_plan_is_one_line_and_no_plan_file(tmp_path: Path) -> None:
    plan, path = launched(tmp_path, memory_gb=0.002)  # the tiny model needs two of these
    decision = decide(plan, path, tmp_path / "ckpt", members("a"), run_id="r", restarted=True)
    assert decision.error is not None and "\n" not in decision.error
    assert decision.error.startswith("re-plan for the 1 device(s) left (0): no plan fits")
    assert "bring nodes back" in decision.error
    assert list((tmp_path / "ckpt" / "elastic" / "plans").iterdir()) == []


def test_a_rank_beyond_its_nodes_devices_and_a_crafted_state_are_refused(tmp_path: Path) -> None:
    plan, path = launched(tmp_path)
    with pytest.raises(MedleyInputError, match=r"rank 1 \(node 'a', local rank 1\) has no device"):
        pool_devices(plan, [Member(rank=0, node="a", local_rank=0), Member(rank=1, node="a", local_rank=1)])
    directory = elastic_dir.elastic_dir(tmp_path / "ckpt")
    outside = tmp_path / "outside.toml"
    save_plan(plan, outside)
    elastic_dir.write_json(directory / "state.json", {"run_id": "r", "plan": "../../outside.toml",
                                                       "present": [0, 1, 2]})
    decision = decide(plan, path, tmp_path / "ckpt", members("a", "b", "c"), run_id="r", restarted=False)
    assert decision.plan == str(path.resolve())  # the state's path outside plans/ is not read


def test_an_elastic_dir_that_is_a_link_is_refused(tmp_path: Path) -> None:
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "ckpt" / "elastic").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(MedleyInputError, match="is a symbolic link"):
        elastic_dir.elastic_dir(tmp_path / "ckpt")


def test_a_repeated_node_is_written_out_to_slow_one_copy(tmp_path: Path) -> None:
    path = cluster_file(tmp_path, node_toml("n", 2, hosts=["h0", "h1"]))
    cluster = load_cluster(path)
    slowed = with_slowed(cluster, {3: 2.0})
    assert [n.name for n in slowed.nodes] == ["n-0", "n-1"] and [n.host for n in slowed.nodes] == ["h0", "h1"]
    types = [d.type.peak_tflops_half for d in slowed.devices]
    assert types[:3] == [cluster.devices[0].type.peak_tflops_half] * 3
    assert types[3] == pytest.approx(types[0] / 2)


def test_a_joining_agent_waits_for_its_admission(tmp_path: Path) -> None:
    directory = elastic_dir.elastic_dir(tmp_path)
    assert wait_for_admission(tmp_path, node="c", run_id="r") is False  # no run: start at once
    elastic_dir.write_json(directory / "heartbeat.json", {"time": time.time(), "step": 7, "run_id": "other"})
    assert wait_for_admission(tmp_path, node="c", run_id="r") is False  # another run's heartbeat
    elastic_dir.write_json(directory / "heartbeat.json", {"time": time.time(), "step": 7, "run_id": "r"})

    def admit() -> None:
        while not elastic_dir.join_file(directory, "c").is_file():
            time.sleep(0.01)
        elastic_dir.write_json(elastic_dir.admit_file(directory, "c"), {"time": time.time()})

    thread = threading.Thread(target=admit)
    thread.start()
    assert wait_for_admission(tmp_path, node="c", run_id="r") is True
    thread.join()
    assert elastic_dir.join_requests(directory) == ["c"]


def test_elastic_agents_meet_at_an_elastic_rendezvous(tmp_path: Path) -> None:
    plan, _ = launched(tmp_path)
    settings = LaunchSettings(plan_path="plan.toml", train_args=("--steps", "5"), rdzv_endpoint="h:1",
                              elastic=ElasticSettings(min_nodes=2, max_restarts=4, checkpoint_dir="/ck",
                                                      first_hosts=True))
    launches = node_launches(plan, settings)
    assert len(launches) == 3
    for index, launch in enumerate(launches):
        argv = launch.argv
        assert argv[argv.index("--nnodes") + 1] == "2:3" and argv[argv.index("--max-restarts") + 1] == "4"
        assert f"is_host={int(index == 0)}" in argv[argv.index("--rdzv-conf") + 1]
        assert argv[-4:] == ("plan.toml", "--elastic", "--steps", "5")
        assert launch.env["MEDLEY_ELASTIC_CHECKPOINT_DIR"] == "/ck"
        assert launch.env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"


@pytest.mark.parametrize(("args", "message"), [
    (["--elastic", "--", "--steps", "5"], "--elastic: give the training flags --checkpoint-dir DIR"),
    (["--elastic", "--slurm", "job.sh", "--", "--checkpoint-dir", "c", "--checkpoint-every", "2"],
     "--elastic --slurm: the sbatch script stops every node"),
    (["--elastic", "--node", "c", "--", "--checkpoint-dir", "c", "--checkpoint-every", "2"],
     "--node starts one node's agent here: use it with --local"),
    (["--elastic", "--local", "--node", "z", "--", "--checkpoint-dir", "c", "--checkpoint-every", "2"],
     "--node z: not a node the plan uses"),
])
def test_bad_elastic_launch_flags_are_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                args: list[str], message: str) -> None:
    _, path = launched(tmp_path)
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["launch", str(path), *args])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0], result.output
    assert not (tmp_path / "job.sh").exists()


def test_elastic_training_needs_its_agents_and_a_checkpoint_interval(tmp_path: Path) -> None:
    _, path = launched(tmp_path)
    runner = CliRunner()
    result = runner.invoke(app, ["train", "--plan", str(path), "--elastic", "--steps", "3"])
    assert result.exit_code == 2 and "--elastic needs --checkpoint-dir DIR" in result.output
    result = runner.invoke(app, ["train", "--plan", str(path), "--straggler-margin", "0", "--steps", "3"])
    assert result.exit_code == 2 and "--straggler-margin 0 must be > 0" in result.output
