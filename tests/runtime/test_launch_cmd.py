"""The per-node commands of ``medley launch`` (pure text: nothing starts): one torchrun agent per node
the plan uses, its own --nproc-per-node, the node's plan devices only, the rendezvous, the SLURM script."""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from launch_plans import cluster_file, node_toml, plan_file, tiny_plan

from medley.errors import MedleyInputError
from medley.launch.agents import GRACE_S, run_agents
from medley.launch.nodes import (
    LaunchSettings,
    NodeLaunch,
    node_launches,
    parse_endpoint,
    shell_quote,
    slurm_script,
    used_nodes,
)
from medley.plan.plan import Plan, load_plan
from medley.runtime.lock import acquire
from medley.runtime.reference import reference_losses
from medley.runtime.train import TrainConfig

ONE_AND_THREE = (node_toml("one", 1, host="host-a"), node_toml("three", 3, host="host-b"))


def one_and_three(directory: Path) -> Plan:
    """pp 2 x dp 2 on nodes of 1 and 3 devices, not row-major: replica 0 on devices 3 and 0."""
    cluster = cluster_file(directory, *ONE_AND_THREE)
    return tiny_plan(cluster, pp=2, dp=2, assignment=((3, 0), (1, 2)), split="2,2")


def flag(argv: tuple[str, ...], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_two_nodes_of_one_and_three_devices(tmp_path: Path) -> None:
    plan = one_and_three(tmp_path)
    settings = LaunchSettings(plan_path="plan.toml", train_args=("--steps", "5", "--json"), rdzv_id="job-1")
    one, three = node_launches(plan, settings)
    assert (one.node, one.host, one.devices, one.local_indices) == ("one", "host-a", (0,), (0,))
    assert (three.node, three.host, three.devices) == ("three", "host-b", (1, 2, 3))
    assert three.local_indices == (0, 1, 2)
    assert one.env == {"MEDLEY_NODE": "one", "CUDA_VISIBLE_DEVICES": "0"}
    assert three.env == {"MEDLEY_NODE": "three", "CUDA_VISIBLE_DEVICES": "0,1,2"}
    for launch, nproc in ((one, "1"), (three, "3")):
        assert launch.argv[0] == "torchrun"
        assert flag(launch.argv, "--nnodes") == "2" and flag(launch.argv, "--nproc-per-node") == nproc
        assert flag(launch.argv, "--rdzv-backend") == "c10d"
        assert flag(launch.argv, "--rdzv-endpoint") == "host-a:29500"  # the first used node's host
        assert flag(launch.argv, "--rdzv-id") == "job-1"
        assert launch.argv[-7:] == ("medley", "train", "--plan", "plan.toml", "--steps", "5", "--json")
    assert shlex.split(three.command) == [
        "MEDLEY_NODE=three", "CUDA_VISIBLE_DEVICES=0,1,2", *three.argv]


def test_unused_devices_and_nodes_start_nothing(tmp_path: Path) -> None:
    """A plan on devices 1 and 3 of a 4-device node (and none of another node): one agent, two
    ranks, CUDA_VISIBLE_DEVICES lists those two in ascending id order."""
    cluster = cluster_file(tmp_path, node_toml("big", 4, host="h0"), node_toml("idle", 2, host="h1"))
    plan = tiny_plan(cluster, pp=2, dp=1, assignment=((3, 1),), split="2,2")
    (only,) = node_launches(plan, LaunchSettings(plan_path="p.toml"))
    assert (only.node, only.devices, only.env["CUDA_VISIBLE_DEVICES"]) == ("big", (1, 3), "1,3")
    assert flag(only.argv, "--nnodes") == "1" and flag(only.argv, "--nproc-per-node") == "2"


def test_repeated_nodes_take_their_hosts_in_order(tmp_path: Path) -> None:
    cluster = cluster_file(tmp_path, node_toml("gpu", 2, hosts=["g0", "g1"]))
    plan = tiny_plan(cluster, pp=2, dp=2, assignment=((2, 0), (3, 1)), split="2,2")
    launches = node_launches(plan, LaunchSettings(plan_path="p.toml"))
    want = [("gpu-0", "g0", (0, 1)), ("gpu-1", "g1", (2, 3))]
    assert [(n.node, n.host, n.devices) for n in launches] == want
    assert {flag(n.argv, "--rdzv-endpoint") for n in launches} == {"g0:29500"}


def test_no_host_for_the_rendezvous_names_the_node_and_the_fix(tmp_path: Path) -> None:
    cluster = cluster_file(tmp_path, node_toml("one", 1), node_toml("three", 3, host="host-b"))
    plan = tiny_plan(cluster, pp=2, dp=2, assignment=((3, 0), (1, 2)), split="2,2")
    with pytest.raises(MedleyInputError, match=r"node 'one' .* has no host; add host = .* --rdzv-endpoint"):
        node_launches(plan, LaunchSettings(plan_path="plan.toml"))
    launches = node_launches(plan, LaunchSettings(plan_path="plan.toml", rdzv_endpoint="10.0.0.7"))
    assert {flag(n.argv, "--rdzv-endpoint") for n in launches} == {"10.0.0.7:29500"}
    assert [n.host for n in launches] == [None, "host-b"]


@pytest.mark.parametrize(("text", "want"), [
    ("h", "h:29500"), ("h.example.org:1234", "h.example.org:1234"), ("10.1.2.3:29400", "10.1.2.3:29400"),
    ("[fe80::1]:5", "[fe80::1]:5")])
def test_endpoints(text: str, want: str) -> None:
    assert parse_endpoint(text) == want


@given(st.text(max_size=30))
def test_an_endpoint_is_host_port_or_one_line_error(text: str) -> None:
    try:
        endpoint = parse_endpoint(text)
    except MedleyInputError as err:
        assert "\n" not in str(err).replace(text, "") and "--rdzv-endpoint" in str(err)
        return
    host, _, port = endpoint.rpartition(":")
    assert host and 1 <= int(port) <= 65535 and not any(c.isspace() or c in "$;'\"`" for c in endpoint)


def fake_tools(directory: Path) -> Path:
    """scontrol (two allocated hosts), srun (records its options, runs the rest) and torchrun (records
    its environment and arguments): the script runs here without SLURM."""
    bin_dir = directory / "bin"
    bin_dir.mkdir()
    tools = {
        # The whole allocation's hosts, or one heterogeneous component's (its variable holds its host).
        "scontrol": 'if [ "$3" = x ]; then echo alloc-0; echo alloc-1; else echo "$3"; fi\n',
        "srun": 'while [[ "$1" == --* ]]; do echo "srun $1" >> "$LOG"; shift; done\nexec "$@"\n',
        "torchrun": 'echo "torchrun MEDLEY_NODE=$MEDLEY_NODE CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES $*" '
                    '>> "$LOG"\n',
    }
    for name, body in tools.items():
        (bin_dir / name).write_text("#!/bin/bash\n" + body)
        (bin_dir / name).chmod(0o755)
    return bin_dir


def tool_env(bin_dir: Path, log: Path) -> dict[str, str]:
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "LOG": str(log),
            "SLURM_JOB_NODELIST": "x", "SLURM_JOB_NODELIST_HET_GROUP_0": "alloc-0",
            "SLURM_JOB_NODELIST_HET_GROUP_1": "alloc-1"}


def run_script(tmp_path: Path, script: str) -> list[str]:
    path, log = tmp_path / "job.sbatch", tmp_path / "log.txt"
    path.write_text(script)
    bin_dir = fake_tools(tmp_path)
    subprocess.run(["bash", str(path)], env=tool_env(bin_dir, log), check=True, timeout=30)
    return sorted(log.read_text().splitlines())


def test_slurm_script_runs_one_task_per_node_on_its_host(tmp_path: Path) -> None:
    plan = one_and_three(tmp_path)
    script = slurm_script(plan, LaunchSettings(plan_path="plan.toml", rdzv_id="j"), job_name="j")
    # The nodes use 1 and 3 GPUs: a heterogeneous job whose components ask for them.
    header = [line for line in script.splitlines() if line.startswith("#SBATCH")]
    assert header == ["#SBATCH --job-name=j", "#SBATCH --nodes=1 --ntasks=1 --gres=gpu:1 --nodelist=host-a",
                      "#SBATCH hetjob", "#SBATCH --nodes=1 --ntasks=1 --gres=gpu:3 --nodelist=host-b"]
    common = ("--rdzv-backend c10d --rdzv-endpoint host-a:29500 --rdzv-id j --no-python medley train "
              "--plan plan.toml")
    assert run_script(tmp_path, script) == sorted([
        "srun --het-group=0", "srun --het-group=1",
        "srun --nodes=1", "srun --ntasks=1", "srun --nodelist=host-a", "srun --gres=gpu:1", "srun --nodes=1",
        "srun --ntasks=1", "srun --nodelist=host-b", "srun --gres=gpu:3",  # each node's own GPU count
        f"torchrun MEDLEY_NODE=one CUDA_VISIBLE_DEVICES=0 --nnodes 2 --nproc-per-node 1 {common}",
        f"torchrun MEDLEY_NODE=three CUDA_VISIBLE_DEVICES=0,1,2 --nnodes 2 --nproc-per-node 3 {common}"])


def test_slurm_script_without_hosts_uses_the_allocation(tmp_path: Path) -> None:
    cluster = cluster_file(tmp_path, node_toml("one", 1), node_toml("three", 3))
    plan = tiny_plan(cluster, pp=2, dp=2, assignment=((3, 0), (1, 2)), split="2,2")
    script = slurm_script(plan, LaunchSettings(plan_path="plan.toml", rdzv_id="j"), job_name="j")
    assert "--nodelist=" not in script.split("set -u")[0]
    lines = run_script(tmp_path, script)
    assert "srun --nodelist=alloc-0" in lines and "srun --nodelist=alloc-1" in lines
    assert all("--rdzv-endpoint alloc-0:29500" in line for line in lines if line.startswith("torchrun"))


def test_slurm_script_of_nodes_alike_asks_for_their_gpus_once(tmp_path: Path) -> None:
    cluster = cluster_file(tmp_path, node_toml("a", 2, host="host-a"), node_toml("b", 2, host="host-b"))
    plan = tiny_plan(cluster, pp=2, dp=2, assignment=((0, 2), (1, 3)), split="2,2")
    script = slurm_script(plan, LaunchSettings(plan_path="plan.toml", rdzv_id="j"), job_name="j")
    header = [line for line in script.splitlines() if line.startswith("#SBATCH")]
    assert header == ["#SBATCH --job-name=j", "#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1",
                      "#SBATCH --gres=gpu:2", "#SBATCH --nodelist=host-a,host-b"]
    lines = run_script(tmp_path, script)
    assert lines.count("srun --gres=gpu:2") == 2 and not any("--het-group" in line for line in lines)


def test_slurm_script_stops_the_other_nodes_when_one_fails(tmp_path: Path) -> None:
    plan = one_and_three(tmp_path)
    script = slurm_script(plan, LaunchSettings(plan_path="plan.toml"), job_name="j")
    bin_dir = fake_tools(tmp_path)
    (bin_dir / "torchrun").write_text('#!/bin/bash\n[ "$MEDLEY_NODE" = one ] && exit 3\nexec sleep 60\n')
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    done = subprocess.run(["bash", str(path)], env=tool_env(bin_dir, tmp_path / "log"), timeout=30,
                          capture_output=True, text=True)
    assert done.returncode == 1 and "a node failed; stopping the others" in done.stderr


NEWLINE_PLAN = "p\ntouch X\n#.toml"  # the hostile probe's plan path


def test_slurm_script_runs_no_line_of_a_plan_path(tmp_path: Path) -> None:
    """A plan path with newlines (and an ESC) stays one quoted word on its line and a comment stays
    one line: the script has as many lines as for a plain path, and running it (fake srun and
    torchrun) creates no marker file and hands torchrun the path byte for byte."""
    plan = one_and_three(tmp_path)
    path = NEWLINE_PLAN + "\x1b[31m"
    script = slurm_script(plan, LaunchSettings(plan_path=path, rdzv_id="j", train_args=("--data", path)),
                          job_name="j")
    plain = slurm_script(plan, LaunchSettings(plan_path="p.toml", rdzv_id="j", train_args=("--data", "d")),
                         job_name="j")
    assert len(script.splitlines()) == len(plain.splitlines()) and "\x1b" not in script
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)
    bin_dir = fake_tools(tmp_path)
    (bin_dir / "torchrun").write_text('#!/bin/bash\nprintf "%s\\0" "$@" > "$LOG.$MEDLEY_NODE"\n')
    job, log = tmp_path / "job.sbatch", tmp_path / "log"
    job.write_text(script)
    subprocess.run(["bash", str(job)], env=tool_env(bin_dir, log), cwd=tmp_path, check=True, timeout=30)
    assert not (tmp_path / "X").exists()
    for node in ("one", "three"):
        argv = Path(f"{log}.{node}").read_text().split("\0")[:-1]
        assert flag(tuple(argv), "--plan") == path and flag(tuple(argv), "--data") == path


@given(st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\0"), max_size=12))
def test_a_quoted_word_is_one_line_and_the_same_string_to_bash(text: str) -> None:
    word = shell_quote(text)
    assert word.isprintable()
    done = subprocess.run(["bash", "-c", f"printf %s {word}"], capture_output=True, check=True, timeout=10)
    assert done.stdout == text.encode()


def test_a_plan_file_round_trip_keeps_the_nodes(tmp_path: Path) -> None:
    plan = one_and_three(tmp_path)
    loaded = load_plan(plan_file(tmp_path, plan))
    assert [(n.name, n.host, d) for n, d in used_nodes(loaded)] == [("one", "host-a", (0,)),
                                                                    ("three", "host-b", (1, 2, 3))]


# `medley launch --local`: every node's torchrun agent on this machine (gloo, CPU), rank 0's JSON on stdout.
MEDLEY = str(Path(sys.executable).with_name("medley"))
TRAIN = ("--steps", "3", "--seed", "3", "--warmup-steps", "2", "--lr", "3e-3", "--min-lr", "3e-4",
         "--clip-norm", "1.0", "--weight-decay", "0.1", "--dtype", "fp32", "--json")
TOL = 1e-5


def launch_local(plan: Path, *train: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([MEDLEY, "launch", str(plan), "--local", "--", *train], capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("nodes", [("one", "three"), ("three", "one")])
def test_local_launch_of_unlike_nodes_equals_the_reference(tmp_path: Path, nodes: tuple[str, str]) -> None:
    """Nodes of 1 and 3 devices (agents with --nproc-per-node 1 and 3), in both orders; replica 0 on
    devices 3 and 0, replica 1 on 1 and 2: the losses equal the single-process reference and every
    rank reports the device, node, replica and pipeline rank the plan gives it."""
    counts = {"one": 1, "three": 3}
    cluster = cluster_file(tmp_path, *(node_toml(name, counts[name]) for name in nodes))
    plan = tiny_plan(cluster, pp=2, dp=2, assignment=((3, 0), (1, 2)), split="2,2")
    done = launch_local(plan_file(tmp_path, plan), *TRAIN)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    want = reference_losses(plan.layout, TrainConfig.of(steps=3, seed=3, warmup_steps=2, lr=3e-3, min_lr=3e-4,
                                                     clip_norm=1.0, weight_decay=0.1))
    losses = [r["loss"] for r in out["records"]]
    assert len(losses) == 3 and max(abs(a - b) for a, b in zip(losses, want, strict=True)) <= TOL
    placement = out["placement"]
    assert sorted(p["rank"] for p in placement) == [0, 1, 2, 3]
    for p in placement:
        assert p["device"] == plan.layout.assignment[p["replica"]][p["pipeline_rank"]], p
        assert p["node"] == plan.cluster.devices[p["device"]].node, p


@pytest.mark.timeout(300)
def test_local_launch_a_ranks_input_error_is_one_line(tmp_path: Path) -> None:
    """Every rank refuses --data; the launcher shows the error once, exit 2, no torchrun report."""
    cluster = cluster_file(tmp_path, node_toml("one", 1), node_toml("three", 3))
    plan = plan_file(tmp_path, tiny_plan(cluster, pp=2, dp=2, assignment=((3, 0), (1, 2)), split="2,2"))
    done = launch_local(plan, "--steps", "1", "--data", str(tmp_path / "missing.txt"))
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "missing.txt" in lines[0], done.stderr


def children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


@pytest.mark.timeout(120)
def test_local_launch_ctrl_c_stops_every_agent_and_rank(tmp_path: Path) -> None:
    cluster = cluster_file(tmp_path, node_toml("one", 1), node_toml("three", 3))
    plan = plan_file(tmp_path, tiny_plan(cluster, pp=2, dp=2, assignment=((3, 0), (1, 2)), split="2,2"))
    process = subprocess.Popen([MEDLEY, "launch", str(plan), "--local", "--", "--steps", "1000"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        agents = children(process.pid)
        ranks = [r for a in agents for r in children(a)]
        if len(agents) == 2 and len(ranks) == 4:
            break
        time.sleep(0.2)
    assert len(agents) == 2 and len(ranks) == 4
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 130, stderr
    assert stderr.strip().splitlines()[-1] == "error: interrupted (Ctrl-C)"
    # They are told at once; a rank still writing under a loaded machine may take a few seconds.
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and [pid for pid in agents + ranks if running(pid)]:
        time.sleep(0.2)
    assert not [pid for pid in agents + ranks if running(pid)]


def running(pid: int) -> bool:
    """Whether ``pid`` exists and is no zombie (an orphan's zombie waits for PID 1 to reap it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


@pytest.mark.timeout(180)
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_a_killed_local_launch_leaves_no_agent_or_rank(tmp_path: Path, sig: signal.Signals) -> None:
    """`kill -9` (or SIGTERM) of `medley launch --local`, in its own session, while its ranks train:
    within 5 s no agent or rank is left (they were re-parented to PID 1 and trained on) and the
    checkpoint directory's lock is free for the next run."""
    cluster = cluster_file(tmp_path, node_toml("one", 1), node_toml("two", 1))
    plan = plan_file(tmp_path, tiny_plan(cluster, pp=2, dp=1, assignment=((0, 1),), split="2,2"))
    checkpoints = tmp_path / "ck"
    train = ("--steps", "100000", "--checkpoint-dir", str(checkpoints))
    process = subprocess.Popen(
        [MEDLEY, "launch", str(plan), "--local", "--", *train],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 120
    agents: list[int] = []
    ranks: list[int] = []
    while time.monotonic() < deadline and process.poll() is None:
        agents = children(process.pid)
        ranks = [r for a in agents for r in children(a)]
        if len(agents) == 2 and len(ranks) == 2 and (checkpoints / ".medley.lock").exists():
            break
        time.sleep(0.2)
    assert len(agents) == 2 and len(ranks) == 2, process.stderr.read() if process.poll() is not None else ""
    time.sleep(1)  # rank 0 holds the lock
    with pytest.raises(MedleyInputError, match="another run"):
        acquire(checkpoints)
    process.send_signal(sig)
    _, stderr = process.communicate(timeout=30)
    assert process.returncode == (-signal.SIGKILL if sig == signal.SIGKILL else 128 + sig), stderr
    if sig == signal.SIGTERM:
        assert stderr.strip().splitlines()[-1].startswith("error: stopped (SIGTERM): the agents and ranks")
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(map(running, agents + ranks)):
        time.sleep(0.1)
    left = [pid for pid in agents + ranks if running(pid)]
    for pid in left:  # leave no orphan behind when this fails
        os.kill(pid, signal.SIGKILL)
    assert not left
    while True:  # a killed rank's other threads may hold its files a moment after it shows as a zombie
        try:
            acquire(checkpoints).release()
            break
        except MedleyInputError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def stand_in(node: str, script: str) -> NodeLaunch:
    """An 'agent' that is a bash script (what run_agents sees of torchrun: output and an exit status)."""
    return NodeLaunch(node=node, host=None, devices=(0,), local_indices=(0,), env={"MEDLEY_NODE": node},
                      argv=("bash", "-c", script))


CPP_WARNING = ("echo '[W1201 00:16:21.800928595 TCPStore.cpp:138] [c10d] recvValueWithTimeout failed' >&2; "
               "echo 'Exception raised from recvBytes at Utils.hpp:787 (most recent call first):' >&2; "
               "echo 'frame #0: c10::Error::Error() + 0x9d (0x7f in libc10.so)' >&2; "
               "echo '<omitting python frames>' >&2; echo >&2; "
               "echo 'E1201 00:08:51.436000 21892 torch/distributed/elastic/api.py:1002] failed' >&2; ")
REPORT = ("echo 'Traceback (most recent call last):' >&2; echo '  File run.py' >&2; "
          "echo 'Root Cause (first observed failure):' >&2; echo '  rank      : {rank} (local_rank: 1)' >&2; "
          "echo '  exitcode  : {code} (pid: 5)' >&2; exit 1")


def test_a_killed_rank_is_one_line_naming_its_node(capsys: pytest.CaptureFixture[str]) -> None:
    """torch's C++ warnings and torchrun's report stay hidden; the line names the node of the rank
    that was killed, not the node whose agent lost the rendezvous store first."""
    launches = [stand_in("one", CPP_WARNING + "exit 1"), stand_in("three", "sleep 0.3; " + REPORT.format(
        rank=2, code=-9))]
    want = ("node three: rank 2 was killed by signal 9; the other nodes were stopped "
            "(--debug shows torchrun's report)")
    assert run_agents(launches, debug=False) == (1, want)
    assert capsys.readouterr().err == ""


def test_rank_output_passes_through_and_an_error_line_shows_once(capsys: pytest.CaptureFixture[str]) -> None:
    rank = "echo '[{\"step\": 0}]'; echo 'error: --data x.txt: no such file' >&2; echo 'note: kept' >&2; "
    other = "echo 'error: --data x.txt: no such file' >&2; "
    launches = [stand_in("one", rank + REPORT.format(rank=0, code=2)),
                stand_in("three", other + REPORT.format(rank=1, code=2))]
    assert run_agents(launches, debug=False) == (2, None)
    out = capsys.readouterr()
    assert out.out == '[{"step": 0}]\n'
    assert sorted(out.err.splitlines()) == ["error: --data x.txt: no such file", "note: kept"]


def test_the_others_are_stopped_after_a_grace(capsys: pytest.CaptureFixture[str]) -> None:
    started = time.monotonic()
    code, line = run_agents([stand_in("one", "exit 1"), stand_in("three", "exec sleep 60")], debug=False)
    assert (code, line) == (1, "node one: its torchrun agent failed (exit code 1); the other nodes were "
                               "stopped (--debug shows torchrun's report)")
    assert time.monotonic() - started < GRACE_S + 5


@pytest.mark.timeout(400)
def test_local_launch_of_an_asymmetric_plan_equals_the_reference(tmp_path: Path) -> None:
    """Replica groups of their own shape across nodes of 1 and 3 devices: group 0 a pp-2 replica
    on devices 3 and 0 (across the nodes), group 1 a replica of the whole model on device 1 and
    group 2 one on device 2: the launch starts every group's ranks where the plan puts them, and
    the losses equal the single-process reference."""
    cluster = cluster_file(tmp_path, node_toml("one", 1), node_toml("three", 3))
    split_two = tiny_plan(cluster, pp=2, dp=1, assignment=((3, 0),), split="2,2", micro_batches="3")
    whole = tiny_plan(cluster, pp=1, dp=2, assignment=((1,), (2,)), split="4", micro_batches="2,1")
    plan = Plan(groups=[split_two.layout, whole.layout], cluster=split_two.cluster)
    done = launch_local(plan_file(tmp_path, plan), *TRAIN)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    reference = dataclasses.replace(split_two.layout, dp=3, micro_batches=plan.micro_batches, sync_dp=0,
                                    assignment=((0, 1), (2, 3), (4, 5)))
    want = reference_losses(reference, TrainConfig.of(steps=3, seed=3, warmup_steps=2, lr=3e-3, min_lr=3e-4,
                                                   clip_norm=1.0, weight_decay=0.1))
    losses = [r["loss"] for r in out["records"]]
    assert len(losses) == 3 and max(abs(a - b) for a, b in zip(losses, want, strict=True)) <= TOL
    placed = {p["rank"]: (p["device"], p["replica"], p["pipeline_rank"]) for p in out["placement"]}
    assert sorted(placed) == [0, 1, 2, 3]
    expected = {(3, 0, 0), (0, 0, 1), (1, 1, 0), (2, 2, 0)}
    assert set(placed.values()) == expected
