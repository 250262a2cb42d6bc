"""The process-group registry: every group this package creates, one per rank set, cached by rank tuple.

A rank set has one group on a rank (:data:`_GROUPS`, keyed by the sorted rank tuple), made on a cache
miss by one of two creation paths; the rule of each is stated here once:

- **World-collective** (:func:`group_for`, :func:`prepare_groups`, :func:`replica_groups`): a plain
  ``new_group``, which every rank of the world must enter for every group, in the same order, members
  or not (torch names the group by a world-wide counter). Use it where all ranks run the same code in
  step: building replicas, or before a schedule whose rank sets every rank computes alike. The keys
  the world has created (:data:`_BY_WORLD`) are the same on every rank, so every rank agrees on a miss.
- **Member-only** (:func:`member_group`): ``new_group(use_local_synchronization=True)``, entered by the
  members alone, because a rank outside may be busy with another model-stage. torch names such a group
  by its ranks AND the number of groups the calling process already holds, so members whose earlier
  groups differ disagree on the name and wait for each other forever: a caller that knows its rank
  sets beforehand creates them world-collectively with :func:`prepare_groups`, and the member-only
  path is only the fallback for groups no one prepared.

Either path hands out the group already held for a rank set (members that share one keep using it);
the world-collective path still enters ``new_group`` for a key the world has not created, so that
ranks holding a member-only group of that key stay in step with the ranks that do not.

Groups this registry does not hold, because their owner destroys them, are created world-collectively
too: vLLM's (:mod:`nereus_lightning.engines.vllm_engine` builds them on every rank before an engine
starts) and the checkpoint writer's gloo groups over the whole world.

A replica's ranks are given in ``Candidate`` order: pp-major then tp, i.e. replica rank index
``pp_rank * tp + tp_rank``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from nereus_lightning.plan.layout import Layout
from nereus_lightning.spec.errors import require

_GROUPS: dict[tuple[int, ...], dist.ProcessGroup] = {}
"""Every group this rank holds (a non-member's placeholder included), by sorted rank tuple."""
_BY_WORLD: set[tuple[int, ...]] = set()
"""The keys the whole world has created in step: the same set on every rank."""


def collective_timeout() -> timedelta | None:
    """Timeout for sub-groups from ``NEREUS_PG_TIMEOUT`` (seconds); None keeps torch's default.

    Tests set it low so that a rank that raised mid-schedule fails its peers fast instead of
    leaving them blocked for torch's 30-minute default.
    """
    value = os.environ.get("NEREUS_PG_TIMEOUT")
    return timedelta(seconds=float(value)) if value else None


def _key(ranks: Sequence[int]) -> tuple[int, ...]:
    """The registry key of ``ranks``: sorted, distinct and not empty."""
    key = tuple(sorted(ranks))
    require(len(key) > 0 and len(set(key)) == len(key), "ranks", f"need distinct ranks, got {tuple(ranks)}")
    return key


def group_for(ranks: Sequence[int]) -> dist.ProcessGroup:
    """The process group of ``ranks`` (any order), created world-collectively on a miss.

    ALL ranks must call it with the same arguments in the same order (see the module docstring).
    """
    key = _key(ranks)
    if key not in _BY_WORLD:
        group = dist.new_group(list(key), timeout=collective_timeout())
        _BY_WORLD.add(key)
        _GROUPS.setdefault(key, group)  # members that already share a member-only group keep it
    return _GROUPS[key]


def member_group(ranks: Sequence[int]) -> dist.ProcessGroup:
    """The process group of ``ranks`` (any order), created by the members only on a miss.

    Every member must call it (same ranks) before any member uses the group; non-members never call.
    """
    key = _key(ranks)
    me = dist.get_rank()
    require(me in key, "ranks", f"rank {me} asked for the group of {key} without being a member")
    if key not in _GROUPS:
        _GROUPS[key] = dist.new_group(list(key), use_local_synchronization=True, timeout=collective_timeout())
    return _GROUPS[key]


def prepare_groups(rank_sets: Sequence[Sequence[int]]) -> None:
    """Create world-collectively (ALL ranks, same ``rank_sets``) the groups of ``rank_sets`` of 2+ ranks.

    For a schedule whose primitives then ask :func:`member_group`, which only looks them up.
    """
    for ranks in rank_sets:
        key = tuple(sorted(set(ranks)))
        if len(key) > 1:  # a one-rank primitive communicates with no one
            group_for(key)


def cached_groups() -> tuple[tuple[int, ...], ...]:
    """The rank tuples whose groups exist on this rank (creation order)."""
    return tuple(_GROUPS)


def tp_ranks(replica: Sequence[int], layout: Layout, pp_rank: int) -> tuple[int, ...]:
    """Global ranks of the TP group of stage ``pp_rank`` (in tp-rank order)."""
    return tuple(replica[pp_rank * layout.tp : (pp_rank + 1) * layout.tp])


def tied_ranks(replica: Sequence[int], layout: Layout, tp_rank: int) -> tuple[int, int]:
    """The first- and last-stage ranks at ``tp_rank`` that both hold a tied embedding shard."""
    return replica[tp_rank], replica[(layout.pp - 1) * layout.tp + tp_rank]


def dp_ranks(replicas: Sequence[Sequence[int]], index: int) -> tuple[int, ...]:
    """Global ranks at replica position ``index`` across ``replicas`` (one DP group)."""
    return tuple(r[index] for r in replicas)


def replica_groups(replicas: Sequence[Sequence[int]], layout: Layout, tied: bool = False) -> None:
    """Create (collectively, on ALL ranks, same order) every group ``replicas`` of ``layout`` use.

    Per replica: the TP group of each stage, the tied-embedding pairs (pp > 1 and ``tied``) and
    the whole-replica group; then one DP group per replica position when there are several replicas.
    """
    for replica in replicas:
        require(
            len(replica) == layout.size,
            "replica",
            f"{len(replica)} ranks given for {layout} ({layout.size} needed)",
        )
        for pp_rank in range(layout.pp):
            group_for(tp_ranks(replica, layout, pp_rank))
        if tied and layout.pp > 1:
            for tp_rank in range(layout.tp):
                group_for(tied_ranks(replica, layout, tp_rank))
        group_for(tuple(replica))
    if len(replicas) > 1:
        for index in range(layout.size):
            group_for(dp_ranks(replicas, index))


def shard_ranks(replica: Sequence[int], layout: Layout, index: int) -> tuple[int, ...]:
    """The shard group of index ``index`` of a sharded ``replica`` (Candidate order): the ranks at its
    (pp, tp) position in each shard rank, in shard-rank order."""
    inner = layout.pp * layout.tp
    return tuple(replica[s * inner + index % inner] for s in range(layout.shard))


def zero_groups(replicas: Sequence[Sequence[int]], layout: Layout) -> None:
    """Create (collectively, on ALL ranks, same order) the groups a sharded model-stage's step uses: each
    replica's shard groups, then one DP group per replica index when there are several replicas; none
    when ``layout`` is unsharded (:func:`replica_groups` made its DP groups)."""
    if layout.shard == 1:
        return
    for replica in replicas:
        for index in range(layout.pp * layout.tp):
            group_for(shard_ranks(replica, layout, index))
    if len(replicas) > 1:
        for index in range(layout.size):
            group_for(dp_ranks(replicas, index))


@dataclass(frozen=True)
class ReplicaComm:
    """What one rank of a replica needs to communicate: its position, groups and pipeline peers."""

    layout: Layout
    ranks: tuple[int, ...]  # the replica's global ranks, pp-major then tp
    rank: int  # this global rank
    tp_group: dist.ProcessGroup | None  # None only for a single-rank replica (see ``single``)
    replica_group: dist.ProcessGroup | None
    tied_group: dist.ProcessGroup | None  # end stages at this tp rank (tied, pp > 1)
    dp_group: dist.ProcessGroup | None  # same position in every replica of the model-stage

    @classmethod
    def of(
        cls,
        ranks: Sequence[int],
        layout: Layout,
        rank: int | None = None,
        tied: bool = False,
        dp_ranks: Sequence[int] | None = None,
        group_factory: Callable[[Sequence[int]], dist.ProcessGroup] = group_for,
    ) -> ReplicaComm:
        """This rank's view of replica ``ranks`` (Candidate order) of ``layout``.

        Groups come from ``group_factory`` (default :func:`group_for`: create them first on all
        ranks with :func:`replica_groups`). :func:`member_group` also works when every rank of
        every replica (and of the DP group) calls ``of`` together: groups are asked for in the
        fixed order tied, DP, TP, replica.
        """
        ranks = tuple(ranks)
        rank = dist.get_rank() if rank is None else rank
        require(
            len(ranks) == layout.size,
            "replica",
            f"{len(ranks)} ranks given for {layout} ({layout.size} needed)",
        )
        require(rank in ranks, "rank", f"rank {rank} is not in replica {ranks}")
        index = ranks.index(rank)
        pp_rank, tp_rank = divmod(index, layout.tp)
        holds_tied = tied and layout.pp > 1 and pp_rank in (0, layout.pp - 1)
        tied_group = group_factory(tied_ranks(ranks, layout, tp_rank)) if holds_tied else None
        dp_group = None
        if dp_ranks is not None and len(dp_ranks) > 1:
            require(rank in dp_ranks, "dp_ranks", f"rank {rank} is not in DP group {tuple(dp_ranks)}")
            dp_group = group_factory(dp_ranks)
        return cls(
            layout=layout,
            ranks=ranks,
            rank=rank,
            tp_group=group_factory(tp_ranks(ranks, layout, pp_rank)),
            replica_group=group_factory(ranks),
            tied_group=tied_group,
            dp_group=dp_group,
        )

    @classmethod
    def single(cls, rank: int = 0) -> ReplicaComm:
        """A one-rank replica (``Layout(1, 1)``) that needs no process group, nor torch.distributed at all."""
        return cls(Layout(1, 1), (rank,), rank, None, None, None, None)

    @property
    def index(self) -> int:
        """This rank's index in the replica (``pp_rank * tp + tp_rank``)."""
        return self.ranks.index(self.rank)

    @property
    def pp_rank(self) -> int:
        """This rank's pipeline stage."""
        return self.index // self.layout.tp

    @property
    def tp_rank(self) -> int:
        """This rank's tensor-parallel rank."""
        return self.index % self.layout.tp

    @property
    def tp_ranks(self) -> tuple[int, ...]:
        """Global ranks of this rank's TP group, in tp-rank order."""
        return tp_ranks(self.ranks, self.layout, self.pp_rank)

    @property
    def tp_collectives(self) -> dist.ProcessGroup | None:
        """The group TP collectives run over; None at TP 1, where they are no-ops."""
        return self.tp_group if self.layout.tp > 1 else None

    @property
    def is_first_stage(self) -> bool:
        """Whether this rank holds the embedding."""
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        """Whether this rank holds the final norm and LM head."""
        return self.pp_rank == self.layout.pp - 1

    @property
    def prev_rank(self) -> int | None:
        """The rank of the previous stage at this tp rank (None on the first stage)."""
        return None if self.is_first_stage else self.ranks[self.index - self.layout.tp]

    @property
    def next_rank(self) -> int | None:
        """The rank of the next stage at this tp rank (None on the last stage)."""
        return None if self.is_last_stage else self.ranks[self.index + self.layout.tp]

    @property
    def last_stage_rank(self) -> int:
        """The rank of the last stage at this tp rank."""
        return self.ranks[(self.layout.pp - 1) * self.layout.tp + self.tp_rank]
