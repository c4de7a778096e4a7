"""Each node's agent started over ssh (``medley launch PLAN --ssh``), as DeepSpeed's launcher
starts its hostfile's nodes.

Every node the plan uses needs its ``host`` in the cluster file. Its command (the node's
``medley doctor`` check, then its torchrun agent: what ``--dry-run`` prints) runs in ``bash``
on that host through ``ssh -o BatchMode=yes`` (keys, no password prompt), the plan and data at
the same paths there. The remote shell runs the agent in the background and waits for it while
reading the session's stdin: when the session closes (this launcher stopped it after another
node failed, on Ctrl-C, or died), the read ends and the agent gets SIGTERM, which stops its
ranks; nothing is left running on the node. The launcher (:func:`medley.launch.agents.run_agents`)
streams the nodes' stderr with their names and stops every node when one fails.
"""

from __future__ import annotations

import dataclasses

from medley.errors import MedleyInputError
from medley.launch.nodes import NodeLaunch, shell_quote
from medley.spec.cluster_schema import printable

SSH_OPTIONS = ("-o", "BatchMode=yes")

# $1: the node's command. It runs as a background job in a process group of its own (set -m); a
# reader of the session's stdin sends that group SIGTERM (torchrun and its ranks) when the session
# closes; the script's status is the command's.
_WATCHED = ('set -m; bash -c "$1" & agent=$!; (cat >/dev/null; kill -TERM -- -"$agent" 2>/dev/null) & '
            'reader=$!; wait "$agent"; status=$?; kill "$reader" 2>/dev/null; exit "$status"')


def remote_command(command: str) -> str:
    """The line ssh runs on the node: ``command`` watched as the module docstring says."""
    return f"exec bash -c {shell_quote(_WATCHED)} medley-node {shell_quote(command)}"


def over_ssh(launch: NodeLaunch, command: str, *, ssh: str = "ssh") -> NodeLaunch:
    """``launch`` started on its host by ``ssh`` running ``command`` (its environment is in it)."""
    if launch.host is None:
        raise MedleyInputError(f"--ssh: node {printable(launch.node)} has no host in the cluster file; add "
                               "host = \"NAME\" to its [[nodes]] entry, or run its command there yourself "
                               "(--dry-run prints it)")
    argv = (ssh, *SSH_OPTIONS, launch.host, remote_command(command))
    return dataclasses.replace(launch, argv=argv, env={})
