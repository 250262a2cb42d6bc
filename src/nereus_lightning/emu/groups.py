"""Member-only process groups for the primitives, cached by rank tuple.

A primitive must be collective over exactly the ranks it involves: a rank outside it may be busy
with another model-stage. So these groups are created with ``use_local_synchronization=True``
(only members call ``new_group``; the name is a hash of the ranks, so no world-wide counter
changes). Each rank caches its groups by sorted rank tuple, so every later call is a lookup.
These are separate from :func:`nereus_lightning.models.groups.group_for`, whose groups are created
by the whole world; the two caches never hand out each other's groups.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.distributed as dist

from nereus_lightning.models.groups import collective_timeout
from nereus_lightning.spec.errors import require

_GROUPS: dict[tuple[int, ...], dist.ProcessGroup] = {}


def member_group(ranks: Sequence[int]) -> dist.ProcessGroup:
    """The process group of ``ranks`` (any order), created on a cache miss by the members only.

    Every member must call it (same ranks) before any member uses the group; non-members never call.
    """
    key = tuple(sorted(ranks))
    require(len(key) > 0 and len(set(key)) == len(key), "ranks", f"need distinct ranks, got {tuple(ranks)}")
    me = dist.get_rank()
    require(me in key, "ranks", f"rank {me} asked for the group of {key} without being a member")
    group = _GROUPS.get(key)
    if group is None:
        group = dist.new_group(list(key), use_local_synchronization=True, timeout=collective_timeout())
        _GROUPS[key] = group
    return group


def cached_member_groups() -> tuple[tuple[int, ...], ...]:
    """The rank tuples whose member groups exist on this rank (creation order)."""
    return tuple(_GROUPS)


def prepare_member_groups(rank_sets: Sequence[Sequence[int]]) -> None:
    """Create, on EVERY rank in the same order, the groups of ``rank_sets`` that are not cached yet.

    ``dist.new_group(use_local_synchronization=True)`` names a group by its ranks AND the number of
    groups the calling process already has, so members that took part in different earlier groups
    disagree on the name and wait for each other forever. A caller that knows the rank sets its
    next primitives use (every rank computing the same list) creates them here world-collectively
    instead; :func:`member_group` then only looks them up.
    """
    from nereus_lightning.models.groups import group_for

    for ranks in rank_sets:
        key = tuple(sorted(set(ranks)))
        if len(key) < 2:
            continue
        # Every rank calls group_for for every key (its cache is the same on every rank); skipping
        # keys cached HERE would desynchronise non-members, who never cache a member group.
        group = group_for(key)
        if dist.get_rank() in key:
            _GROUPS.setdefault(key, group)  # members that already share a group keep using it
