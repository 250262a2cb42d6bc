"""Which link each process group of a candidate spans, and alpha-beta prices of collectives.

A group whose GPUs sit in one node uses the intra-node link (``intra_bw`` per GPU); a group that
crosses nodes is bounded by the node NIC, whose ``inter_bw`` is shared by every GPU of that node
that talks across nodes in the same collective phase (``share``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from nereus_lightning.plan.layout import Layout
from nereus_lightning.spec.cluster import ClusterSpec


@dataclass(frozen=True)
class GroupLink:
    """The link of one kind of group: ``inter`` (crosses nodes) and the NIC ``share`` (GPUs per NIC)."""

    inter: bool = False
    share: int = 1


@dataclass(frozen=True)
class Links:
    """Links of the TP groups, the worst PP boundary, the DP (gradient) groups across replicas and
    the shard groups inside a replica (ZeRO's reduce-scatters and all-gathers) of a candidate."""

    tp: GroupLink = GroupLink()
    pp: GroupLink = GroupLink()
    dp: GroupLink = GroupLink()
    shard: GroupLink = GroupLink()


def _group_link(groups: Sequence[Sequence[int]], gpn: int) -> GroupLink:
    """Link of a family of groups that communicate at the same time."""
    crossing: dict[int, int] = {}
    for group in groups:
        nodes = {g // gpn for g in group}
        if len(nodes) > 1:
            for g in group:
                crossing[g // gpn] = crossing.get(g // gpn, 0) + 1
    if not crossing:
        return GroupLink()
    return GroupLink(True, max(crossing.values()))


def links_of(gpus: Sequence[int], layout: Layout, dp: int, cluster: ClusterSpec) -> Links:
    """The links a candidate with these concrete ``gpus`` (replica, shard, pp, tp order) uses."""
    tp, pp, size, gpn = layout.tp, layout.pp, layout.size, cluster.gpus_per_node
    first = gpus[0] if len(gpus) else 0
    aligned = gpn % size == 0 if size <= gpn else size % gpn == 0
    if dp > 1 and aligned and first % size == 0 and tuple(gpus) == tuple(range(first, first + len(gpus))):
        return _aligned_range_links(first, len(gpus), layout, cluster)
    tp_groups = [gpus[b : b + tp] for b in range(0, len(gpus), tp)]
    pp_link = GroupLink()
    cut = layout.model_size
    for c in range(dp * layout.shard):  # every shard group's model cut
        for p in range(pp - 1):
            # The tp point-to-point pairs of one boundary send at once.
            pairs = [(gpus[c * cut + p * tp + i], gpus[c * cut + (p + 1) * tp + i]) for i in range(tp)]
            link = _group_link(pairs, gpn)
            if link.inter and link.share > pp_link.share:
                pp_link = link
    dp_groups = [[gpus[r * size + j] for r in range(dp)] for j in range(size)] if dp > 1 else []
    shard_groups = [
        [gpus[r * size + s * cut + j] for s in range(layout.shard)] for r in range(dp) for j in range(cut)
    ]
    return Links(
        _group_link(tp_groups, gpn),
        pp_link,
        _group_link(dp_groups, gpn),
        _group_link(shard_groups, gpn) if layout.shard > 1 else GroupLink(),
    )


@lru_cache(maxsize=1 << 14)
def canonical_links(layout: Layout, dp: int, cluster: ClusterSpec) -> Links:
    """Links of the candidate placed at GPU 0 (how the planner places it on power-of-two nodes).

    TP and PP links are those of one replica (replicas are aligned, so all look alike); the DP
    groups cross nodes exactly when the candidate is larger than a node, and then every GPU of
    a node takes part (arithmetic instead of a walk over thousands of GPUs).
    """
    one = links_of(range(layout.size), layout, 1, cluster) if dp == 1 else canonical_links(layout, 1, cluster)
    gpn = cluster.gpus_per_node
    total = dp * layout.size
    size = layout.size
    aligned = gpn % size == 0 if size <= gpn else size % gpn == 0
    if dp > 1 and total > gpn and aligned:
        return Links(one.tp, one.pp, GroupLink(True, gpn), one.shard)
    if dp > 1 and total > gpn:
        return links_of(range(total), layout, dp, cluster)
    return one


def _aligned_range_links(first: int, count: int, layout: Layout, cluster: ClusterSpec) -> Links:
    """Links of a candidate on GPUs ``first .. first+count-1`` with replicas aligned to node
    boundaries: every replica looks like one at GPU 0, and when the range crosses nodes every
    DP group does, so a node's NIC is shared by all the candidate's GPUs on it."""
    one = canonical_links(layout, 1, cluster)
    gpn = cluster.gpus_per_node
    last = first + count - 1
    if first // gpn == last // gpn:
        return Links(one.tp, one.pp, GroupLink(), one.shard)
    head = (first // gpn + 1) * gpn - first
    tail = last - (last // gpn) * gpn + 1
    share = max(head, tail, gpn if last // gpn - first // gpn >= 2 else 0)
    return Links(one.tp, one.pp, GroupLink(True, share), one.shard)


def link_bandwidth(link: GroupLink, cluster: ClusterSpec) -> tuple[float, float]:
    """(bytes/s per GPU, latency per message) of a group on ``link``."""
    if link.inter:
        return cluster.inter_bw / link.share, cluster.inter_latency
    return cluster.intra_bw, cluster.intra_latency


def allreduce_time(nbytes: float, n: int, link: GroupLink, cluster: ClusterSpec) -> float:
    """Ring all-reduce of ``nbytes`` over ``n`` GPUs: 2(n-1)/n of the data and 2(n-1) latencies."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    bw, lat = link_bandwidth(link, cluster)
    return 2 * (n - 1) / n * nbytes / bw + 2 * (n - 1) * lat


def allgather_time(nbytes: float, n: int, link: GroupLink, cluster: ClusterSpec) -> float:
    """Ring all-gather (or reduce-scatter) producing ``nbytes`` per GPU over ``n`` GPUs."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    bw, lat = link_bandwidth(link, cluster)
    return (n - 1) / n * nbytes / bw + (n - 1) * lat


def p2p_time(nbytes: float, link: GroupLink, cluster: ClusterSpec) -> float:
    """One point-to-point send of ``nbytes``."""
    if nbytes <= 0:
        return 0.0
    bw, lat = link_bandwidth(link, cluster)
    return nbytes / bw + lat
