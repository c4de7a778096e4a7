"""How a tensor-parallel group loads the links it shares, as the compiler times it.

* DP collectives: each TP rank reduces (gathers) its 1/tp shard over its own DP group, the tp
  groups at once. Inside one node each device has its own links, so they do not slow each other;
  a DP group spanning nodes shares each node's network with the other tp groups, so the lead's
  collective is timed on tp times its bytes (:func:`dp_bytes_factor`).
* Pipeline transfers follow :func:`medley.plan.layout.tp_sources`: one per receiving TP rank, in
  parallel on distinct device links inside a node (a sender feeding several receivers sends them
  one after another), all through the one node network across nodes. The hop is timed as the
  leads' transfer of the bytes the busiest link carries (:func:`hop_bytes_factor`). Between
  groups of one degree t > 1 each transfer is a 1/t slice (:func:`medley.plan.layout.tp_scattered`)
  and the receiving group's all-gather of the slices is part of the compute action that uses
  the tensor (:func:`gather_time`), like the blocks' TP all-reduces. Under sequence parallelism
  an edge of :func:`medley.plan.layout.sequence_sharded_edges` carries the same slices (each
  rank's sequence shard) and needs no gather: the next stage's blocks take the shards.
"""

from __future__ import annotations

from collections.abc import Sequence

from medley.cost.interfaces import Collective, CommModel
from medley.plan.layout import PlanLayout, sequence_sharded_edges, tp_scattered
from medley.sim.problem import StageCost
from medley.spec.cluster import Cluster


def dp_bytes_factor(cluster: Cluster, group: tuple[int, ...], tp: int) -> int:
    """How many TP ranks' DP collectives of a stage of degree ``tp`` share the busiest link of the
    lead's DP ``group``: tp when the group spans nodes (one network per node), else 1 (own links)."""
    if tp == 1 or len({cluster.devices[d].node for d in group}) < 2:
        return 1
    return tp


def hop_bytes_factor(cluster: Cluster, senders: tuple[int, ...], receivers: tuple[int, ...]) -> float:
    """Tensors' worth of bytes the busiest link carries at a pipeline hop from TP group ``senders``
    to group ``receivers`` (:func:`medley.plan.layout.tp_sources`: one transfer per receiving
    rank): all of them through the node network across nodes; inside a node, those one sender
    sends. A scattered hop's transfers are slices of 1/t (:func:`medley.plan.layout.tp_scattered`)."""
    across = cluster.devices[senders[0]].node != cluster.devices[receivers[0]].node
    if tp_scattered(senders=len(senders), receivers=len(receivers)):
        return 1.0 if across else 1.0 / len(receivers)
    if across:
        return float(len(receivers))
    return float(-(-len(receivers) // len(senders)))


def gather_time(
    comm: CommModel, senders: tuple[int, ...], receivers: tuple[int, ...], nbytes: float
) -> float:
    """Seconds the receiving group of a scattered hop spends all-gathering a tensor of ``nbytes``
    from its slices (0 for a hop that is not scattered)."""
    if not tp_scattered(senders=len(senders), receivers=len(receivers)):
        return 0.0
    return comm.collective_time(Collective.ALL_GATHER, receivers, nbytes)


def scale_hops(
    layout: PlanLayout, cluster: Cluster, replica: int, s2r: Sequence[int], row: list[StageCost],
    comm: CommModel | None,
) -> None:
    """Each stage's pipeline transfers in ``replica`` at the bytes of the busiest link of the hop
    between TP groups (:func:`hop_bytes_factor`): forward to the next stage's group, and the
    gradient back from it. On ``comm`` (None: no communication timed), a scattered hop's
    all-gathers (:func:`gather_time`) join the next stage's forward (the activation) and this
    stage's backward (the gradient)."""
    if not layout.tp:
        return
    edges = sequence_sharded_edges(layout)
    for stage in range(len(row) - 1):
        if layout.layer_range(stage + 1).start == 0 or s2r[stage] == s2r[stage + 1]:
            continue  # a second pipeline starts afresh; a rank hands over in memory
        here, there = layout.group(replica, s2r[stage]), layout.group(replica, s2r[stage + 1])
        nbytes = row[stage].send_bytes
        row[stage].send_bytes = nbytes * hop_bytes_factor(cluster, here, there)
        row[stage].send_back_bytes = nbytes * hop_bytes_factor(cluster, there, here)
        if comm is not None and stage not in edges:
            row[stage + 1].forward_s += gather_time(comm, here, there, nbytes)
            row[stage].backward_input_s += gather_time(comm, there, here, nbytes)
