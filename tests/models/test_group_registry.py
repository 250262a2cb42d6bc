"""The process-group registry: one group per rank set, and world-collective creation stays in step."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from nereus_lightning.models.groups import group_for, member_group
from nereus_lightning.testing import WorkerPool


def _member_then_world(rank: int, world: int) -> tuple[bool, float]:
    mine = member_group([0, 1]) if rank < 2 else None
    shared = group_for([1, 0])  # every rank, members holding a member-only group included
    # Had a member skipped the world's new_group, the next world group would be named differently
    # on rank 2 than on ranks 0 and 1, and this all-reduce would time out.
    total = torch.ones(1)
    dist.all_reduce(total, group=group_for([0, 1, 2]))
    return (shared is mine) if rank < 2 else True, float(total)


def test_a_member_only_group_is_the_one_handed_out_and_world_creation_stays_in_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("NEREUS_PG_TIMEOUT", "20")  # a desynchronised world fails fast
    with WorkerPool(3) as pool:  # its own pool: the registry starts empty
        results = pool.run(_member_then_world)
    assert results == [(True, 3.0)] * 3
