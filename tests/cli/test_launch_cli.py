"""``medley launch``'s command line: what it prints and writes, and its one-line refusals (exit 2),
all before anything is written or started."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from medley.cli.main import app
from medley.cost.estimator import CatalogCostSource
from medley.plan.inline import inline_layout
from medley.plan.plan import Plan, save_plan
from medley.spec.cluster_load import load_cluster
from medley.spec.model_arg import get_model

runner = CliRunner()
CLUSTER = ('name = "two"\n[[nodes]]\nname = "one"\ndevice = "CPU-8GB"\ncount = 1\n{host}'
           '[[nodes]]\nname = "three"\ndevice = "CPU-8GB"\ncount = 3\n'
           '[[tiers]]\nname = "net"\nbandwidth_gbps = 10\n')


def make_plan(directory: Path, *, host: str | None = "host-a") -> Path:
    """pp 2 x dp 2 of tiny on nodes of 1 and 3 CPU devices (the first one's host given or not)."""
    cluster_path = directory / "cluster.toml"
    cluster_path.write_text(CLUSTER.format(host=f'host = "{host}"\n' if host else ""))
    cluster, model = load_cluster(cluster_path), get_model("tiny")
    layout = inline_layout(
        cluster=cluster, model=model, cost=CatalogCostSource.for_cluster(model, cluster), pp=2, dp=2,
        schedule="1f1b", micro_batches="2", micro_batch_size=2, seq_len=32, split="2,2", zero="1,0")
    path = directory / "plan.toml"
    save_plan(Plan(layout=layout, cluster=cluster), path)
    return path


@pytest.fixture()
def plan(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    return make_plan(tmp_path)


def one_line_error(args: list[str]) -> str:
    result = runner.invoke(app, args, env={"COLUMNS": "200"})
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert "Traceback" not in result.output
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    return lines[0]


def checked(command: str) -> tuple[list[str], list[str]]:
    """A node's command as its two parts: ``medley doctor`` (the node's check) and, after ``&&``,
    the torchrun agent it guards."""
    words = shlex.split(command)
    assert words.count("&&") == 1, command
    at = words.index("&&")
    return words[:at], words[at + 1:]


def test_dry_run_json(plan: Path) -> None:
    args = ["launch", "plan.toml", "--dry-run", "--json", "--", "--steps", "3", "--json"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    nodes = json.loads(result.stdout)["nodes"]
    assert [(n["node"], n["host"], n["devices"]) for n in nodes] == [("one", "host-a", [0]),
                                                                     ("three", None, [1, 2, 3])]
    (check_one, one), (check_three, three) = (checked(n["command"]) for n in nodes)
    # Each node first checks itself against the plan (same environment): a failing node starts nothing.
    assert check_one == ["MEDLEY_NODE=one", "CUDA_VISIBLE_DEVICES=0", sys.executable, "-m", "medley.cli.main",
                         "doctor", "--plan", str(plan.resolve()), "--node", "one"]
    assert check_three[:2] == ["MEDLEY_NODE=three", "CUDA_VISIBLE_DEVICES=0,1,2"]
    assert check_three[-1] == "three"
    # This Python by its absolute path, torchrun and medley as modules: nothing needs the venv on PATH.
    assert one[:5] == ["MEDLEY_NODE=one", "CUDA_VISIBLE_DEVICES=0", sys.executable, "-m",
                       "torch.distributed.run"]
    assert three[:3] == ["MEDLEY_NODE=three", "CUDA_VISIBLE_DEVICES=0,1,2", sys.executable]
    assert "--nproc-per-node 1 " in nodes[0]["command"] and "--nproc-per-node 3 " in nodes[1]["command"]
    assert all("--rdzv-endpoint host-a:29500" in n["command"] for n in nodes)
    assert all(n["command"].endswith(f"-m medley.cli.main train --plan {plan.resolve()} --steps 3 --json")
               for n in nodes)


def test_python_log_dir_and_absolute_paths(plan: Path) -> None:
    Path("docs.jsonl").write_text("")
    result = runner.invoke(app, ["launch", "plan.toml", "--dry-run", "--json", "--python",
                                 "/opt/py/bin/python", "--log-dir", "/shared/logs", "--", "--data",
                                 "docs.jsonl", "--checkpoint-dir=ckpt", "--data-format", "chat",
                                 "--steps", "3"])
    assert result.exit_code == 0, result.output
    (check, one), (_, three) = (checked(n["command"]) for n in json.loads(result.stdout)["nodes"])
    assert one[2] == "/opt/py/bin/python" and check[2] == "/opt/py/bin/python"
    assert one[one.index("--log-dir") + 1] == "/shared/logs/one" and "--tee" in one and "--redirects" in one
    assert three[three.index("--log-dir") + 1] == "/shared/logs/three"
    # An existing file and a path flag become absolute; a word that names nothing stays as it is.
    assert one[one.index("--data") + 1] == str(Path("docs.jsonl").resolve())
    assert f"--checkpoint-dir={Path('ckpt').resolve()}" in one
    assert one[one.index("--data-format") + 1] == "chat" and one[-2:] == ["--steps", "3"]


def test_the_commands_for_people(plan: Path) -> None:
    result = runner.invoke(app, ["launch", "plan.toml", "--rdzv-endpoint", "10.0.0.1:1234"])
    assert result.exit_code == 0, result.output
    assert "2 nodes, 4 ranks" in result.stdout
    assert "# node three (host not given): devices 1,2,3" in result.stdout
    assert result.stdout.count("--rdzv-endpoint 10.0.0.1:1234") == 2
    # Each agent's line follows its node's check, which ends in && (the shell reads on).
    assert f"doctor --plan {plan.resolve()} --node three &&\nMEDLEY_NODE=three " in result.stdout


def test_a_run_on_the_cpu_on_purpose_checks_the_rest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPU plan: its nodes' checks want the GPUs, unless the run computes on the CPU on purpose
    (--emulate or --device cpu after --), and --local (no GPU visible) refuses it without, one line."""
    monkeypatch.chdir(tmp_path)
    made = runner.invoke(app, ["plan", "--cluster", "2xA100-80GB", "--model", "tiny", "--global-batch", "8",
                               "--seq-len", "64", "--out", "gpu.toml"])
    assert made.exit_code == 0, made.output
    for extra, wanted in (([], False), (["--emulate"], True), (["--device", "cpu"], True)):
        result = runner.invoke(app, ["launch", "gpu.toml", "--rdzv-endpoint", "h", "--dry-run", "--json",
                                     "--", *extra])
        assert result.exit_code == 0, result.output
        (check, _), = (checked(n["command"]) for n in json.loads(result.stdout)["nodes"])
        assert (check[-2:] == ["--device", "cpu"]) is wanted, check
    line = one_line_error(["launch", "gpu.toml", "--local", "--", "--steps", "1"])
    assert line.startswith("error: launch --local (every node's ranks on this CPU): this machine (playing "
                           "every node): the plan puts 2 x A100-80GB (devices 0,1) here but found "), line
    assert "MEDLEY_TORCH=cu128 scripts/venv.sh" in line and line.endswith("--emulate or --device cpu")


def test_slurm_writes_the_script(plan: Path) -> None:
    result = runner.invoke(app, ["launch", "plan.toml", "--slurm", "out/job.sbatch", "--", "--steps", "9"])
    assert result.exit_code == 0, result.output
    script = Path("out/job.sbatch").read_text()
    assert script.startswith("#!/bin/bash") and script.count("#SBATCH --nodes=1 --ntasks=1 --gres=gpu:") == 2
    assert script.count("srun ") == 2 and script.count(f"--plan {plan.resolve()} --steps 9") == 2


def test_local_dry_run_lists_this_machines_agents(plan: Path) -> None:
    result = runner.invoke(app, ["launch", "plan.toml", "--local", "--dry-run", "--json"])
    assert result.exit_code == 0, result.output
    for node in json.loads(result.stdout)["nodes"]:
        _, argv = checked(node["command"])
        assert "CUDA_VISIBLE_DEVICES=" in argv and argv[argv.index("-m") + 1] == "medley.launch.local_agent"
        assert argv[argv.index("--rdzv-endpoint") + 1].startswith("127.0.0.1:")
        assert argv[argv.index("--plan") + 1] == str(plan.resolve())


@pytest.mark.parametrize(("args", "match"), [
    (["launch", "missing.toml"], "missing.toml: cannot read the plan file"),
    (["launch", "plan.toml", "--", "--stpes", "3"], "flags after --: medley train: No such option: --stpes"),
    (["launch", "plan.toml", "--", "--steps", "x"], "after --: medley train: Invalid value for '--steps'"),
    (["launch", "plan.toml", "--", "--plan", "other.toml"], "--plan is set by medley launch"),
    (["launch", "plan.toml", "--", "--local-ranks", "4"], "--local-ranks is set by medley launch"),
    (["launch", "plan.toml", "--local", "--slurm", "job.sh"], "--local and --slurm: choose one"),
    (["launch", "plan.toml", "--local", "--json"], "put --json after --"),
    (["launch", "plan.toml", "--rdzv-endpoint", "a b:1"], "--rdzv-endpoint 'a b:1': not HOST:PORT"),
    (["launch", "plan.toml", "--rdzv-endpoint", "h:70000"], "--rdzv-endpoint 'h:70000': not HOST:PORT"),
    (["launch", "plan.toml", "--rdzv-id", "a;b"], "--rdzv-id 'a;b'"),
    (["launch", "plan.toml", "--rdzv-id", "job\n"], "--rdzv-id 'job\\n': use 1-64 letters"),
    (["launch", "plan.toml", "--rdzv-endpoint", "--help"], "--rdzv-endpoint '--help': not HOST:PORT"),
    (["launch", "plan.toml", "--rdzv-endpoint", "h:1\n"], "--rdzv-endpoint 'h:1\\n': not HOST:PORT"),
    (["launch", "plan.toml", "--slurm", "."], "--slurm .: is a directory"),
    (["launch", "plan.toml", "--bogus"], "No such option: --bogus"),
])
def test_bad_input_is_one_line(plan: Path, args: list[str], match: str) -> None:
    assert match in one_line_error(args)


def test_a_newline_plan_path_prints_escaped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The commands printed for people keep a hostile plan path on its line, escaped."""
    monkeypatch.chdir(tmp_path)
    name = "p\ntouch X\n#\x1b[2J.toml"
    make_plan(tmp_path).rename(tmp_path / name)
    result = runner.invoke(app, ["launch", name, "--slurm", "job.sbatch"])
    assert result.exit_code == 0, result.output
    assert "\x1b" not in result.stdout and "\ntouch X" not in result.stdout
    assert "p\\ntouch X\\n#\\x1b[2J.toml'" in result.stdout and "--plan $'/" in result.stdout
    assert "p\\ntouch X\\n#\\x1b[2J.toml: 2 nodes" in result.stdout


def test_nothing_is_written_when_a_flag_is_bad(plan: Path) -> None:
    one_line_error(["launch", "plan.toml", "--slurm", "job.sbatch", "--", "--steps", "-x"])
    assert not Path("job.sbatch").exists()


def test_no_host_and_no_endpoint_names_the_node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    make_plan(tmp_path, host=None)
    line = one_line_error(["launch", "plan.toml"])
    assert "plan.toml: node 'one'" in line and "has no host" in line and "--rdzv-endpoint" in line
    # An sbatch script takes the rendezvous from its allocation's first host instead.
    slurm = runner.invoke(app, ["launch", "plan.toml", "--slurm", "job.sbatch"])
    assert slurm.exit_code == 0, slurm.output
    assert 'MEDLEY_RDZV_ENDPOINT="${hosts[0]}:29500"' in Path("job.sbatch").read_text()
    assert "rendezvous ${MEDLEY_RDZV_ENDPOINT}" in slurm.stdout
    local = runner.invoke(app, ["launch", "plan.toml", "--local", "--dry-run"])  # --local needs no host
    assert local.exit_code == 0, local.output
