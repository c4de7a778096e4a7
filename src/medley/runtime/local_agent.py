"""``python -m medley.runtime.local_agent TORCHRUN-ARGS``: torchrun (``torch.distributed.run``) as an
agent of ``medley launch --local``, tied to the launcher that started it.

The agent dies when the launcher does, however it ends (``kill -9`` included): Linux kills it when
its parent dies (``PR_SET_PDEATHSIG``) and a thread watches the launcher's pid
(``MEDLEY_LAUNCHER_PID``), which also covers a launcher that died before the agent got this far.
Its ranks die with it the same way (:func:`medley.runtime.lifecycle.die_with_parent`, in every rank).
"""

from __future__ import annotations

import os
import sys

from medley.runtime.lifecycle import die_with_parent
from medley.runtime.nodes import LAUNCHER_PID_ENV


def main(argv: list[str]) -> None:
    launcher = os.environ.get(LAUNCHER_PID_ENV)
    die_with_parent(int(launcher) if launcher else None)
    from torch.distributed.run import main as torchrun

    torchrun(argv)


if __name__ == "__main__":
    main(sys.argv[1:])
