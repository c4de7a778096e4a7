"""``python -m medley.launch.local_agent TORCHRUN-ARGS``: torchrun (``torch.distributed.run``) as an
agent of ``medley launch --local`` (tied to the launcher that started it) or of an elastic run.

Under ``--local`` the agent dies when the launcher does, however it ends (``kill -9``
included): Linux kills it when its parent dies (``PR_SET_PDEATHSIG``) and a thread watches the launcher's pid
(``MEDLEY_LAUNCHER_PID``), which also covers a launcher that died before the agent got this far.
Its ranks die with it the same way (:func:`medley.runtime.lifecycle.die_with_parent`, in every rank).

An elastic agent (``MEDLEY_ELASTIC_CHECKPOINT_DIR`` set) that finds its run training already (a
live heartbeat of the same rendezvous id) is a node that joins: it asks to be admitted and starts
torchrun only once the ranks answer, right after their next checkpoint, so that the restart that
its arrival causes redoes no step (:mod:`medley.launch.elastic_dir`).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from medley.fileio import remove_path
from medley.launch import elastic_dir
from medley.launch.nodes import ELASTIC_DIR_ENV, LAUNCHER_PID_ENV
from medley.runtime.lifecycle import die_with_parent
from medley.runtime.placement import NODE_ENV

_POLL_S = 0.2


def wait_for_admission(checkpoint_dir: Path, *, node: str, run_id: str) -> bool:
    """Block until the running job admits ``node``, or no longer runs; True when it was admitted,
    False when there was nothing to wait for (no live run of ``run_id``)."""
    directory = checkpoint_dir / elastic_dir.SUBDIR
    beat = elastic_dir.live_heartbeat(directory)
    if beat is None or beat.get("run_id") != run_id:
        return False
    elastic_dir.write_json(elastic_dir.join_file(directory, node), {"time": time.time(), "pid": os.getpid()})
    print(f"elastic: node {node} asks to join the running job; it is admitted at its next checkpoint",
          file=sys.stderr, flush=True)
    while not elastic_dir.admit_file(directory, node).is_file():
        if elastic_dir.live_heartbeat(directory) is None:  # the run ended or died: start as usual
            remove_path(elastic_dir.join_file(directory, node))
            return False
        time.sleep(_POLL_S)
    return True


def _rdzv_id(argv: list[str]) -> str:
    for index, arg in enumerate(argv[:-1]):
        if arg == "--rdzv-id":
            return argv[index + 1]
    return next((a.partition("=")[2] for a in argv if a.startswith("--rdzv-id=")), "none")


def main(argv: list[str]) -> None:
    launcher = os.environ.get(LAUNCHER_PID_ENV)
    if launcher:  # started by medley launch --local; on a real node it lives as torchrun would
        die_with_parent(int(launcher))
    directory = os.environ.get(ELASTIC_DIR_ENV)
    if directory:
        wait_for_admission(Path(directory), node=os.environ.get(NODE_ENV, "node"), run_id=_rdzv_id(argv))
    from torch.distributed.run import main as torchrun

    torchrun(argv)


if __name__ == "__main__":
    main(sys.argv[1:])
