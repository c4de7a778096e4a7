"""An elastic ``medley launch --local`` whose rendezvous host is lost ends with one line that names
the node and says how to resume (issue 46, finding 8): run the same command again, from the last
checkpoint under the run's checkpoint directory."""

from __future__ import annotations

import pytest

from medley.launch.agents import rendezvous_lost_line, run_agents
from medley.launch.nodes import ELASTIC_DIR_ENV, NodeLaunch

CKPT = "/shared/ckpt"


def agent(node: str, script: str, *, host: bool) -> NodeLaunch:
    """A stand-in agent (a bash script) started as ``--local --elastic`` starts each node's torchrun:
    ``is_host`` in its ``--rdzv-conf``, the checkpoint directory in its environment."""
    conf = f"join_timeout=600,is_host={int(host)}"
    return NodeLaunch(node=node, host=None, devices=(0,), local_indices=(0,),
                      env={"MEDLEY_NODE": node, ELASTIC_DIR_ENV: CKPT},
                      argv=("bash", "-c", script, "bash", "--rdzv-conf", conf))


WANT = ("node a: its agent ended (killed by signal 9); it hosted the rendezvous (torchrun's store), so the "
        "other nodes could not go on and were stopped; run the same medley launch command again to resume "
        f"from the last checkpoint ({CKPT})")


def test_the_line_says_how_to_resume_and_from_where() -> None:
    line = rendezvous_lost_line(agent("a", "", host=True), -9)
    assert line == WANT
    bare = NodeLaunch(node="a", host=None, devices=(0,), local_indices=(0,), env={}, argv=())
    assert rendezvous_lost_line(bare, -15).endswith("again to resume from the last checkpoint")


def test_losing_the_rendezvous_host_ends_with_that_line(capsys: pytest.CaptureFixture[str]) -> None:
    """Node a (the host) is killed; b and c then fail on the lost store: the line is a's, with the
    resume, not 'its torchrun agent failed (exit code -9)'."""
    launches = [agent("a", "kill -9 $$", host=True), agent("b", "sleep 0.3; exit 1", host=False),
                agent("c", "sleep 0.3; exit 1", host=False)]
    assert run_agents(launches, debug=False, elastic=True) == (1, WANT)
    assert capsys.readouterr().err == ""


def test_a_host_that_failed_for_its_ranks_is_not_a_lost_rendezvous() -> None:
    launches = [agent("a", "exit 1", host=True), agent("b", "sleep 0.2; exit 1", host=False)]
    code, line = run_agents(launches, debug=False, elastic=True)
    assert code == 1 and line is not None and "rendezvous" not in line
