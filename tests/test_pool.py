import pytest

from nereus_lightning.testing import WorkerError


def _allreduce(rank, world_size, value):
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(rank + value)])
    dist.all_reduce(t)
    return t.item()


def _fail_on_rank_one(rank, world_size):
    if rank == 1:
        raise ValueError("boom on one")
    return rank


def test_pool_runs_collectives_and_survives_errors(dist4):
    assert dist4.run(_allreduce, 10) == [46.0] * 4
    with pytest.raises(WorkerError, match="boom on one"):
        dist4.run(_fail_on_rank_one)
    assert dist4.run(_allreduce, 0) == [6.0] * 4
