"""An EMU's own tensors drive a ShardedCausalLM: training updates the EMU's parameters and AdamW state."""

from __future__ import annotations

import torch

from nereus_lightning.models import (
    ReplicaComm,
    ShardedCausalLM,
    bind_adamw,
    shard_state,
    split_micro_batches,
    train_step,
)
from nereus_lightning.plan.layout import Layout
from nereus_lightning.testing.tiny import VOCAB, rel_err, tiny_model


def _loss(lp: torch.Tensor, mb) -> torch.Tensor:
    return -lp.mean()


def _emu_step(rank: int, world: int) -> dict[str, float]:
    from nereus_lightning.emu import EMU, StateSchema, Unit
    from nereus_lightning.models.groups import member_group

    model = tiny_model("gqa_tied")
    layout = Layout(2, 2)
    unit = Unit(layout, tuple(range(world)))
    emu = EMU.from_model("actor_train", StateSchema.of(model.config, model), model, unit, rank, trains=True)
    comm = ReplicaComm.of(unit.gpus, layout, rank, tied=True, group_factory=member_group)
    sharded = ShardedCausalLM(model.config, comm, emu.params)
    opt = bind_adamw(sharded, emu.optim_state, lr=1e-3, eps=1e-4)
    ids = torch.randint(0, VOCAB, (4, 10), generator=torch.Generator().manual_seed(5))
    train_step(sharded, split_micro_batches(ids, 2), _loss, opt)
    # The same step on the unsharded model.
    ref_opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-4)
    lp = torch.log_softmax(model(ids).logits, -1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
    _loss(lp, None).backward()
    ref_opt.step()
    pos = unit.position(rank)
    expected = shard_state(model, model.config, layout, pos.pp_rank, pos.tp_rank)
    ref_state = {n: ref_opt.state[p]["exp_avg"] for n, p in model.named_parameters()}
    ref_state = shard_state(ref_state, model.config, layout, pos.pp_rank, pos.tp_rank)
    return {
        "param": max(rel_err(emu.params[n], expected[n]) for n in expected),
        "exp_avg": max(rel_err(emu.optim_state[n]["exp_avg"], ref_state[n]) for n in expected),
        "step": min(float(emu.optim_state[n]["step"]) for n in expected),
    }


def test_training_through_an_emu_updates_its_state(dist4) -> None:
    for rank, res in enumerate(dist4.run(_emu_step)):
        assert res["step"] == 1.0, f"rank {rank}: the EMU's AdamW step counter was not advanced"
        assert res["param"] <= 1e-5, f"rank {rank}: EMU parameters differ by {res['param']:.2e}"
        assert res["exp_avg"] <= 1e-5, f"rank {rank}: EMU exp_avg differs by {res['exp_avg']:.2e}"
