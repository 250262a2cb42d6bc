"""A sharded unit's shard degree changes by re-cutting its row blocks: Split shard 2 -> 4 then Merge 4 -> 2
gives back every block bit for bit, and each direction moves exactly half the state."""

from __future__ import annotations

import pytest
import torch

from nereus_lightning.plan.rows import grown_order, shrunk_order

pytestmark = pytest.mark.distributed


def _state() -> dict[str, torch.Tensor]:
    """A ZeRO-3 training state of the tiny model: parameters (fp32) and AdamW moments, by key."""
    from nereus_lightning.testing.tiny import tiny_model

    gen = torch.Generator().manual_seed(5)
    out = {}
    for name, p in tiny_model("qwen2").named_parameters():
        out[f"{name}/param"] = p.detach().clone()
        out[f"{name}/exp_avg"] = torch.randn(p.shape, generator=gen)
        out[f"{name}/exp_avg_sq"] = torch.rand(p.shape, generator=gen)
    return out


def _split_then_merge(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from nereus_lightning.emu.transfer import recut_rows
    from nereus_lightning.models.zero import cut_rows

    full = _state()
    shapes = {k: (tuple(t.shape), t.dtype) for k, t in full.items()}
    two = (0, 1)
    four = grown_order(two, (2, 3))
    blocks = {k: cut_rows(t, 2, two.index(rank)).clone() for k, t in full.items()} if rank in two else {}
    grown, up = recut_rows(blocks, shapes, two, four, torch.device("cpu"))
    back, down = recut_rows(grown, shapes, four, shrunk_order(four, 2), torch.device("cpu"))
    sent = torch.tensor([up.payload_sent, down.payload_sent], dtype=torch.float64)
    dist.all_reduce(sent)
    return {
        "grown_exact": all(torch.equal(grown[k], cut_rows(t, 4, four.index(rank))) for k, t in full.items()),
        "back_exact": rank not in two or all(torch.equal(back[k], blocks[k]) for k in full),
        "divisible": all(t.shape[0] % 4 == 0 for t in full.values()),
        "state_bytes": sum(t.numel() * t.element_size() for t in full.values()),
        "sent": sent.tolist(),
    }


def test_split_2_to_4_then_merge_back_is_exact_and_moves_half(dist4) -> None:
    for rank, out in enumerate(dist4.run(_split_then_merge)):
        assert out["grown_exact"], f"rank {rank}: a shard-4 block is not the rows of the full state"
        assert out["back_exact"], f"rank {rank}: merged back, a shard-2 block changed"
        assert out["divisible"]  # so that half the state is a whole number of rows of every tensor
        half = out["state_bytes"] / 2
        assert out["sent"] == [half, half], (rank, out["sent"], half)
