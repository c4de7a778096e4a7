"""The device is checked, never assumed (issue 41, finding 2): a GPU plan on a machine without its
GPUs is one line and exit 2 before any rank starts; --emulate and --device cpu run it on the CPU on
purpose and say so first; CPU plans train without flags. ``medley doctor`` reports a node against a
plan. What a node has is injected (:class:`NodeDevices`) where this machine has no GPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from medley.cli.doctor_cmd import default_route_interface, interface, report, this_node
from medley.cli.main import app
from medley.cli.preflight import check_devices
from medley.errors import MedleyInputError
from medley.plan.plan import load_plan
from medley.runtime.device_check import LocalGpu, NodeDevices, device_problems, is_cpu_type
from medley.spec.catalog import get_device_type

runner = CliRunner()
A100 = LocalGpu(index=0, name="NVIDIA A100-SXM4-80GB", memory_bytes=85_899_345_920)
T4 = LocalGpu(index=1, name="Tesla T4", memory_bytes=15_655_829_504)
CPU_BUILD = NodeDevices(torch_version="2.13.0+cpu", cuda_version=None)
ROUTES = (
    "Iface\tDestination\tGateway\tFlags\tRefCnt\tUse\tMetric\tMask\n"
    "eth0\t000200C0\t00000000\t0001\t0\t0\t0\t00FFFFFF\n"
    "eth1\t00000000\t010200C0\t0003\t0\t0\t100\t00000000\n"
    "eth2\t00000000\t010300C0\t0003\t0\t0\t10\t00000000\n"
)


@pytest.fixture()
def gpu_plan(tmp_path: Path) -> Path:
    path = tmp_path / "p.toml"
    made = runner.invoke(
        app,
        [
            "plan",
            "--cluster",
            "2xA100-80GB",
            "--model",
            "tiny",
            "--global-batch",
            "8",
            "--seq-len",
            "64",
            "--out",
            str(path),
        ],
    )
    assert made.exit_code == 0, made.output
    return path


def test_cpu_types_are_told_from_gpu_types() -> None:
    assert is_cpu_type(get_device_type("CPU-8GB")) and is_cpu_type(get_device_type("CPU"))
    assert not is_cpu_type(get_device_type("A100-80GB")) and not is_cpu_type(get_device_type("T4-16GB"))


def test_each_problem_names_the_node_the_type_what_was_found_and_the_fix(gpu_plan: Path) -> None:
    plan = load_plan(gpu_plan)
    (line,) = device_problems(plan, CPU_BUILD, node=None)
    assert line.startswith(
        "this machine (playing every node): the plan puts 2 x A100-80GB (devices 0,1) here "
        "but found torch 2.13.0+cpu (a CPU build, no CUDA); install a CUDA build of torch: "
        "MEDLEY_TORCH=cu128 scripts/venv.sh"
    ), line
    one_gpu = NodeDevices(torch_version="2.13.0+cu128", cuda_version="12.8", gpus=(A100,))
    (short,) = device_problems(plan, one_gpu, node="node0")
    assert short.startswith("node 'node0': the plan puts 2 x A100-80GB") and "CUDA sees 1 GPU(s)" in short
    wrong = NodeDevices(torch_version="2.13.0+cu128", cuda_version="12.8", gpus=(A100, T4))
    (other,) = device_problems(plan, wrong, node="node0")
    assert other.startswith(
        "node 'node0': plan device 1 (A100-80GB) is local rank 1 but cuda:1 is 'Tesla T4'"
    )
    right = NodeDevices(
        torch_version="2.13.0+cu128",
        cuda_version="12.8",
        gpus=(A100, LocalGpu(index=1, name=A100.name, memory_bytes=A100.memory_bytes)),
    )
    assert device_problems(plan, right, node="node0") == []


def test_the_cpu_on_purpose_is_said_and_a_cpu_plan_needs_nothing(gpu_plan: Path, tmp_path: Path) -> None:
    plan = load_plan(gpu_plan)
    with pytest.raises(
        MedleyInputError,
        match=r"^train: this machine .* or run on the CPU on purpose with "
        r"--emulate or --device cpu$",
    ):
        check_devices(plan, device="auto", emulate=False, local_ranks=2, found=CPU_BUILD)
    note = check_devices(plan, device="cpu", emulate=False, local_ranks=2, found=CPU_BUILD)
    assert note == (
        "device: this machine (playing every node) runs the plan's 2 x A100-80GB (devices 0,1) on the "
        "CPU (gloo), on purpose (--device cpu)"
    )
    emulated = check_devices(plan, device="auto", emulate=True, local_ranks=2, found=CPU_BUILD)
    assert emulated is not None and emulated.endswith(
        "(--emulate: compute stretched to the plan's device speeds)"
    )
    cpu_plan = tmp_path / "cpu.toml"
    made = runner.invoke(
        app,
        [
            "plan",
            "--cluster",
            "2xCPU-8GB",
            "--model",
            "tiny",
            "--global-batch",
            "8",
            "--seq-len",
            "64",
            "--out",
            str(cpu_plan),
        ],
    )
    assert made.exit_code == 0, made.output
    assert (
        check_devices(load_plan(cpu_plan), device="auto", emulate=False, local_ranks=2, found=CPU_BUILD)
        is None
    )


@pytest.mark.timeout(300)
def test_a_gpu_plan_without_its_gpus_starts_no_rank_and_emulate_still_trains(gpu_plan: Path) -> None:
    """The reproduction of issue 41: one line, exit 2, before anything else is said or started (no
    rank started: no step record, nothing of torchelastic); --emulate and --device cpu train."""
    refused = runner.invoke(
        app, ["train", "--plan", str(gpu_plan), "--local-ranks", "2", "--steps", "2"], env={"COLUMNS": "400"}
    )
    assert refused.exit_code == 2, refused.output
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "error: train: this machine (playing every node): the plan puts 2 x A100-80GB"
    ), refused.stderr
    assert not refused.stdout.strip()
    for flags in (["--emulate"], ["--device", "cpu"]):
        done = runner.invoke(
            app, ["train", "--plan", str(gpu_plan), "--local-ranks", "2", "--steps", "1", "--json", *flags]
        )
        assert done.exit_code == 0, done.output
        assert done.stderr.splitlines()[0].startswith(
            "device: this machine (playing every node) runs the plan's"
        )
        assert [r["step"] for r in json.loads(done.stdout)["records"]] == [0]


def test_the_interfaces_nccl_and_gloo_would_use() -> None:
    assert default_route_interface(ROUTES) == "eth2"  # the lowest metric of the default routes
    assert default_route_interface(ROUTES.splitlines()[0]) is None
    env = {"NCCL_SOCKET_IFNAME": "ib0"}
    assert interface("NCCL_SOCKET_IFNAME", env=env, routes=ROUTES).name == "ib0"
    gloo = interface("GLOO_SOCKET_IFNAME", env=env, routes=ROUTES)
    assert (gloo.name, gloo.source) == ("eth2", "default route")


def test_doctor_reports_a_node_against_the_plan(gpu_plan: Path) -> None:
    plan = load_plan(gpu_plan)
    assert this_node(plan, "node0", env={}, hostname="h") == "node0"
    assert this_node(plan, None, env={"MEDLEY_NODE": "node0"}, hostname="h") == "node0"
    assert this_node(plan, None, env={}, hostname="h") is None
    with pytest.raises(MedleyInputError, match="--node gpu9: not a node the plan uses"):
        this_node(plan, "gpu9", env={}, hostname="h")
    found = NodeDevices(
        torch_version="2.13.0+cu128", cuda_version="12.8", gpus=(A100, T4), nccl_version="2.27.3"
    )
    data = report(plan, "node0", found, env={}, routes=ROUTES, hostname="h")
    assert [g["catalog"] for g in data["gpus"]] == ["A100-80GB", "T4-16GB"]
    assert data["planned"] == [{"device": 0, "type": "A100-80GB"}, {"device": 1, "type": "A100-80GB"}]
    assert data["nccl"] == "2.27.3" and data["network"]["nccl"] == {"name": "eth2", "source": "default route"}
    assert len(data["problems"]) == 1 and "'Tesla T4'" in data["problems"][0]
    assert report(plan, "node0", found, env={}, routes=ROUTES, hostname="h", device="cpu")["problems"] == []


def test_doctor_on_this_machine(gpu_plan: Path) -> None:
    """No plan: a report, exit 0. This CPU against the GPU plan: the report, then one line per
    problem and exit 2; --device cpu passes."""
    alone = runner.invoke(app, ["doctor", "--json"])
    assert alone.exit_code == 0, alone.output
    assert json.loads(alone.stdout)["torch"].startswith("2.")
    checked = runner.invoke(
        app, ["doctor", "--plan", str(gpu_plan), "--node", "node0"], env={"COLUMNS": "400"}
    )
    assert checked.exit_code == 2, checked.output
    assert "node 'node0': devices 0: A100-80GB, 1: A100-80GB; this node cannot run them" in checked.stdout
    (line,) = checked.stderr.strip().splitlines()
    assert line.startswith(
        "error: doctor: node 'node0': the plan puts 2 x A100-80GB (devices 0,1) here but found"
    )
    assert runner.invoke(app, ["doctor", "--plan", str(gpu_plan), "--device", "cpu"]).exit_code == 0
    bad = runner.invoke(app, ["doctor", "--node", "node0"])
    assert bad.exit_code == 2 and "give --plan PLAN too" in bad.stderr


def test_under_torchrun_each_rank_checks_its_own_node(
    gpu_plan: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A torchrun rank (RANK set, no --local-ranks) checks the node MEDLEY_NODE names; local rank 0
    says why in one line, the node's other ranks exit 2 without a word."""
    plan = load_plan(gpu_plan)
    for name, value in {
        "RANK": "1",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "2",
        "LOCAL_WORLD_SIZE": "2",
        "MEDLEY_NODE": "node0",
    }.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(MedleyInputError, match=r"^train: node 'node0': the plan puts 2 x A100-80GB"):
        check_devices(plan, device="auto", emulate=False, local_ranks=None, found=CPU_BUILD)
    quiet = runner.invoke(app, ["train", "--plan", str(gpu_plan), "--steps", "1"])
    assert quiet.exit_code == 2 and not quiet.output.strip(), quiet.output
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("RANK", "0")
    said = runner.invoke(app, ["train", "--plan", str(gpu_plan), "--steps", "1"], env={"COLUMNS": "400"})
    assert said.exit_code == 2, said.output
    (line,) = said.stderr.strip().splitlines()
    assert line.startswith(
        "error: train: node 'node0': the plan puts 2 x A100-80GB (devices 0,1) here but found"
    )
