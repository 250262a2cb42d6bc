"""``L_tran``: the critical path of a transition DAG, priced from its own transfer list.

Each node starts when its deps have finished. A node that moves bytes first sets up its
communicators (``cluster.comm_setup``, once: a node's groups are disjoint per GPU and are created
concurrently), then pushes its transfers through the links they use:

* same node: the sender's NVLink egress and the receiver's ingress (``intra_bw`` each),
* across nodes: the sender node's NIC egress and the receiver node's NIC ingress (``inter_bw``
  per node, shared by every GPU of the node),
* same GPU (a local copy): HBM, read and write (``hbm_bw``).

A link serves the nodes that use it one after another in the order they reach it (so concurrent
nodes on one NIC share its bandwidth: the later one waits), links serve one node in parallel,
and the node ends with its slowest link plus one message latency. Destroy costs nothing.
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from dataclasses import dataclass

from nereus_lightning.spec.cluster import ClusterSpec
from nereus_lightning.transition.dag import Node, TransitionDAG


@dataclass(frozen=True)
class Schedule:
    """Start and finish time of every node (seconds), the makespan and one critical path."""

    start: tuple[float, ...]
    finish: tuple[float, ...]
    makespan: float
    critical_path: tuple[int, ...]


_LINK = 1 << 24  # link ids: kind * _LINK + GPU or node index


def _loads(n: Node, cluster: ClusterSpec) -> tuple[dict[int, float], float]:
    """Bytes each link carries for node ``n`` (NVLink out/in per GPU, NIC out/in per node, HBM) and its
    latency.
    """
    busy: dict[int, float] = defaultdict(float)
    latency = 0.0
    gpn = cluster.gpus_per_node
    for s, d, size, _ in n.transfers:
        if size <= 0:
            continue
        if s == d:
            busy[4 * _LINK + s] += 2 * size
        elif s // gpn == d // gpn:
            busy[s] += size
            busy[_LINK + d] += size
            latency = cluster.intra_latency if latency < cluster.intra_latency else latency
        else:
            busy[2 * _LINK + s // gpn] += size
            busy[3 * _LINK + d // gpn] += size
            latency = cluster.inter_latency if latency < cluster.inter_latency else latency
    return busy, latency


def schedule(dag: TransitionDAG, cluster: ClusterSpec | None = None) -> Schedule:
    """Simulate the DAG on ``cluster`` (default: the one it was built for)."""
    cluster = cluster or dag.context.cluster
    nodes = dag.nodes
    start = [0.0] * len(nodes)
    finish = [0.0] * len(nodes)
    why = [-1] * len(nodes)  # the node whose end delayed this one (a dep or a link's previous user)
    free: dict[int, tuple[float, int]] = {}
    bandwidth = (cluster.intra_bw, cluster.intra_bw, cluster.inter_bw, cluster.inter_bw, cluster.hbm_bw)
    succs: list[list[int]] = [[] for _ in nodes]
    indeg = [len(n.deps) for n in nodes]
    ready_at = [0.0] * len(nodes)
    for n in nodes:
        for d in n.deps:
            succs[d].append(n.id)
    heap = [(0.0, n.id) for n in nodes if not n.deps]
    heapq.heapify(heap)
    while heap:
        t0, nid = heapq.heappop(heap)
        n = nodes[nid]
        start[nid] = t0
        busy, latency = _loads(n, cluster)
        end = t0
        if busy:
            begin = t0 + cluster.comm_setup
            for link, size in busy.items():
                secs = size / bandwidth[link // _LINK]
                prev_end, prev = free.get(link, (0.0, -1))
                b = max(begin, prev_end)
                if b + secs > end:
                    end = b + secs
                    if prev_end > begin:
                        why[nid] = prev
                free[link] = (b + secs, nid)
            end += latency
        finish[nid] = end
        for s in succs[nid]:
            if end >= ready_at[s]:
                ready_at[s] = end
                why[s] = nid
            indeg[s] -= 1
            if indeg[s] == 0:
                heapq.heappush(heap, (ready_at[s], s))
    makespan = max(finish, default=0.0)
    path: list[int] = []
    if nodes:
        cur = max(range(len(nodes)), key=finish.__getitem__)
        seen = set()
        while cur >= 0 and cur not in seen:
            seen.add(cur)
            path.append(cur)
            cur = why[cur]
    return Schedule(tuple(start), tuple(finish), makespan, tuple(reversed(path)))


def transition_cost(dag: TransitionDAG, cluster: ClusterSpec | None = None) -> float:
    """``L_tran`` in seconds: the makespan of :func:`schedule`."""
    return schedule(dag, cluster).makespan
