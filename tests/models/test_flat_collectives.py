"""The flat collectives move their tensors in buckets of bounded bytes: the sums, row blocks and gathered
tensors equal those of one collective per tensor exactly, and no flat buffer exceeds the bucket."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.distributed

#: Uneven row counts (padded row blocks), a 1-D tensor, one larger than a bucket, an empty one, one with
#: fewer rows than ranks.
SHAPES = ((7, 3), (5,), (12, 5), (0, 3), (2, 2))
#: 64 bytes: 16 fp32 elements, a table of 4 columns on 4 ranks; every call needs several buckets.
BUCKET = 64


def _tensors(seed: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """Integer-valued tensors: their sums are exact in any order, so any reduction order gives one result."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(-8, 9, shape, generator=gen).to(dtype) for shape in SHAPES]


def _bucketed(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from nereus_lightning.models import sharded, zero

    shards = zero.ShardGroup(2, tuple(range(world)), rank, dist.group.WORLD)
    sizes: list[int] = []

    def recorded(collective):
        def run(out, *args, **kwargs):
            sizes.append(max(out.numel() * out.element_size(), args[0].numel() * args[0].element_size()))
            return collective(out, *args, **kwargs) if args else collective(out, **kwargs)

        return run

    mixed = _tensors(rank, torch.float32) + _tensors(10 + rank, torch.bfloat16)
    summed = [t.clone() for t in mixed]
    for t in summed:  # the reference: one all-reduce per tensor
        dist.all_reduce(t)
    full = _tensors(rank, torch.float32)
    whole = [t.clone() for t in full]
    for t in whole:
        dist.all_reduce(t)
    blocks = [torch.empty_like(zero.cut_rows(t, world, rank)) for t in full]
    gathered = [torch.full_like(t, float("nan")) for t in full]
    kept = (
        sharded.FLAT_BUCKET_BYTES,
        zero.FLAT_BUCKET_BYTES,
        dist.all_reduce,
        zero._reduce_scatter,
        zero._all_gather,
    )
    sharded.FLAT_BUCKET_BYTES = zero.FLAT_BUCKET_BYTES = BUCKET
    dist.all_reduce = lambda t, **kw: (sizes.append(t.numel() * t.element_size()), kept[2](t, **kw))[1]
    zero._reduce_scatter, zero._all_gather = recorded(kept[3]), recorded(kept[4])
    try:
        averaged = [t.clone() for t in mixed]
        sharded.all_reduce_flat(mixed, dist.group.WORLD)
        sharded.all_reduce_flat(averaged, dist.group.WORLD, average=True)
        reduces = len(sizes)
        zero.reduce_scatter_rows(full, blocks, shards)
        zero.all_gather_rows(blocks, gathered, shards)
    finally:
        (
            sharded.FLAT_BUCKET_BYTES,
            zero.FLAT_BUCKET_BYTES,
            dist.all_reduce,
            zero._reduce_scatter,
            zero._all_gather,
        ) = kept
    return {
        "all_reduce": all(torch.equal(a, b) for a, b in zip(mixed, summed, strict=True)),
        "average": all(torch.equal(a, b / world) for a, b in zip(averaged, summed, strict=True)),
        "rows": all(
            torch.equal(b, zero.cut_rows(t, world, rank)) for b, t in zip(blocks, whole, strict=True)
        ),
        "gathered": all(torch.equal(g, t) for g, t in zip(gathered, whole, strict=True)),
        "sizes": sizes,
        "reduces": reduces,
    }


def test_bucketed_collectives_equal_one_collective_per_tensor_within_the_bucket(dist4):
    for rank, out in enumerate(dist4.run(_bucketed)):
        assert out["all_reduce"] and out["average"], f"rank {rank}: a bucketed sum differs"
        assert out["rows"], f"rank {rank}: a reduce-scattered row block differs"
        assert out["gathered"], f"rank {rank}: an all-gathered tensor differs"
        assert max(out["sizes"]) <= BUCKET, f"rank {rank}: a flat buffer of {max(out['sizes'])} bytes"
        # sum and average of 90 elements a dtype, 16 fp32 or 32 bf16 a bucket: 6 + 3 buckets each
        assert out["reduces"] == 2 * (6 + 3)
        assert len(out["sizes"]) - out["reduces"] == 2 * 7  # 25 table columns of 4: 7 buckets each way


def _out_of_order(rank: int, world: int) -> dict:
    """Reduce-scatter and all-gather in a shard group listed against rank order (3, 1, 0, 2)."""
    import torch.distributed as dist

    from nereus_lightning.models import zero

    order = (3, 1, 0, 2)[:world]
    shards = zero.ShardGroup(3, order, rank, dist.group.WORLD)
    full = _tensors(rank, torch.float32)
    whole = [t.clone() for t in full]
    for t in whole:
        dist.all_reduce(t)
    blocks = [torch.empty_like(zero.cut_rows(t, world, shards.shard_rank)) for t in full]
    gathered = [torch.full_like(t, float("nan")) for t in full]
    zero.reduce_scatter_rows(full, blocks, shards)
    zero.all_gather_rows(blocks, gathered, shards)
    return {
        "shard_rank": shards.shard_rank,
        "rows": all(
            torch.equal(b, zero.cut_rows(t, world, shards.shard_rank))
            for b, t in zip(blocks, whole, strict=True)
        ),
        "gathered": all(torch.equal(g, t) for g, t in zip(gathered, whole, strict=True)),
    }


def test_a_shard_group_in_any_order_holds_its_shard_ranks_rows(dist4):
    """A shard rank's block is the rows of its place in the shard group, not of its global rank's."""
    outs = dist4.run(_out_of_order)
    assert [out["shard_rank"] for out in outs] == [2, 1, 3, 0]
    for rank, out in enumerate(outs):
        assert out["rows"], f"rank {rank}: its row blocks are not its shard rank's rows"
        assert out["gathered"], f"rank {rank}: the gathered tensors differ"
