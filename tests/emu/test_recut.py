"""A sharded training unit re-cut to another shard degree (``emu.recut``): Split shard 2 -> 4 then Merge
4 -> 2 gives back every tensor bit for bit, moves exactly half the row-cut state each way, and each rank
receives what the brain prices (``transition.pieces.recut_transfers``) plus the unpriced steps and
counters of a rank new to the unit."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from nereus_lightning.emu import EMU, StateSchema, Unit
from nereus_lightning.plan.layout import Layout
from nereus_lightning.plan.rows import grown_order, shrunk_order
from nereus_lightning.spec.model import ModelSpec
from nereus_lightning.transition.pieces import geometry, recut_transfers
from tests.emu.workers import COUNTERS, tiny

pytestmark = pytest.mark.distributed

STAGE = "actor_train"
TWO = (0, 1)
FOUR = grown_order(TWO, (2, 3))


def _sharded(schema: StateSchema, whole: EMU, layout: Layout, order: tuple[int, ...]) -> EMU:
    """``whole`` (an unsharded replica's EMU) as shard rank ``order.index(rank)`` of a ``layout`` unit on
    ``order``: what its ZeRO stage shards cut into dim-0 row blocks (FSDP2's cut), the rest whole."""
    from nereus_lightning.models.zero import cut_rows

    me = order.index(whole.rank)
    row_keys = {"param"} if layout.zero == 3 else set()
    row_keys |= {k for entry in whole.optim_state.values() for k in entry if k != "step"}

    def cut(key: str, t: torch.Tensor) -> torch.Tensor:
        return cut_rows(t, layout.shard, me).clone() if key in row_keys else t

    params = {n: cut("param", t) for n, t in whole.params.items()}
    optim = {n: {k: cut(k, t) for k, t in entry.items()} for n, entry in whole.optim_state.items()}
    emu = EMU(STAGE, schema, Unit(layout, order), whole.rank, params, optim, whole.counters, trains=True)
    emu.row_keys = frozenset(row_keys)
    return emu


def _tensors(emu: EMU | None) -> dict[tuple[str, str], torch.Tensor]:
    if emu is None:
        return {}
    params = {(n, "param"): t for n, t in emu.params.items()}
    return params | {(n, k): t for n, entry in emu.optim_state.items() for k, t in entry.items()}


def _same(got: EMU | None, want: EMU) -> bool:
    a, b = _tensors(got), _tensors(want)
    same = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in b)
    return same and got is not None and (got.counters, got.row_keys) == (want.counters, want.row_keys)


def _grow_and_shrink(rank: int, world: int, zero: int) -> dict:
    from nereus_lightning.emu.recut import recut

    config, model, optim = tiny("qwen2")
    schema = StateSchema.of(config, model)
    two, four = Layout(shard=2, zero=zero), Layout(shard=4, zero=zero)
    cpu = torch.device("cpu")
    whole = EMU.from_model(STAGE, schema, model, Unit(Layout(), (rank,)), rank, trains=True, full_optim=optim)
    whole.counters = COUNTERS
    start = _sharded(schema, whole, two, TWO) if rank in TWO else None
    grown, up = recut(STAGE, schema, start, Unit(two, TWO), Unit(four, FOUR), cpu)
    back, down = recut(STAGE, schema, grown, Unit(four, FOUR), Unit(two, shrunk_order(FOUR, 2)), cpu)
    return {
        "grown_exact": _same(grown, _sharded(schema, whole, four, FOUR)),
        "back_exact": back is None if start is None else _same(back, start),
        "received": [up.payload_received, down.payload_received],
        "sent": [up.payload_sent, down.payload_sent],
        "tensors": len(whole.params),
        "param_bytes": sum(t.numel() * t.element_size() for t in whole.params.values()),
        "row_state": sum(
            t.numel() * t.element_size()
            for (n, k), t in _tensors(whole).items()
            if k != "step" and (zero == 3 or k != "param")
        ),
    }


@pytest.mark.parametrize("zero", [1, 3])
def test_split_shard_2_to_4_then_merge_back_is_exact_moves_half_and_is_priced(dist4, zero: int) -> None:
    config, _, _ = tiny("qwen2")
    geo = geometry(replace(ModelSpec.from_hf_config(config), dtype="float32"), True)  # the tiny model's
    two, four = Layout(shard=2, zero=zero), Layout(shard=4, zero=zero)
    per_rank = dist4.run(_grow_and_shrink, zero)
    for rank, out in enumerate(per_rank):
        assert out["grown_exact"], f"rank {rank}: its shard-4 state is not the cut of the whole state"
        assert out["back_exact"], f"rank {rank}: merged back to shard 2, its state changed"
    up = recut_transfers(geo, two, four, TWO, FOUR)
    down = recut_transfers(geo, four, two, FOUR, shrunk_order(FOUR, 2))
    for i, transfers in enumerate((up, down)):
        for rank, out in enumerate(per_rank):
            # a rank new to the unit also gets a 4-byte AdamW step per tensor and 48 B of counters (unpriced)
            unpriced = 4 * out["tensors"] + 48 if i == 0 and rank not in TWO else 0
            into = sum(t.bytes for t in transfers if t.dst_gpu == rank)
            assert out["received"][i] == into + unpriced, (i, rank, out["received"][i], into, unpriced)
        assert sum(out["sent"][i] for out in per_rank) == sum(out["received"][i] for out in per_rank)
    # half the row-cut state each way; below ZeRO-3 each new rank also gets the whole parameters
    half, params = per_rank[0]["row_state"] / 2, per_rank[0]["param_bytes"]
    assert sum(t.bytes for t in up) == half + (2 * params if zero < 3 else 0)
    assert sum(t.bytes for t in down) == half
