"""A sharded replica's checkpoint holds logical names at any degree: saved at shard 2 x TP2 (ZeRO-3) after
one update, resumed at shard 4 x TP1 and unsharded (one rank, ZeRO-0), the next two updates' losses and
gradient norms are those of the run that went on at shard 2."""

from __future__ import annotations

import pytest
import torch

from nereus_lightning.rl.update import ADAMW
from tests.lightning.test_packed_update import _rollout

pytestmark = pytest.mark.distributed

MAX_NORM = 0.05


def _update(module, step, gather, dp_rank: int, dp: int) -> tuple[float, float]:  # noqa: ANN001
    """One PPO actor update over the whole rollout; (this rank's reported pg_loss share, norm)."""
    from nereus_lightning.lightning.batches import replica_backward
    from nereus_lightning.rl.algorithm import RLConfig
    from nereus_lightning.rl.batch import dp_slice

    cfg = RLConfig(algorithm="ppo", entropy_coeff=0.01)
    batch = _rollout(7)
    mask = batch.response_mask.float()
    gather()
    part = batch.select(dp_slice(len(batch), dp, dp_rank))
    metrics = replica_backward(module, part, 2, cfg, cfg.normalizer(mask), mask.sum(), True)
    reports = module.comm.is_last_stage and module.comm.tp_rank == 0
    loss = float(metrics["actor/pg_loss"]) if reports else 0.0
    return loss, step().norm


def _zero_unit(rank: int, model, layout, peers: tuple[int, ...], full: dict | None):  # noqa: ANN001, ANN202
    """This rank's ZeRO-3 replica (compute layout ``layout``, shard group ``peers``): from ``full`` (this
    rank's whole TP shard) or empty, to be loaded."""
    from nereus_lightning.models import ReplicaComm, ShardedCausalLM
    from nereus_lightning.models.groups import group_for
    from nereus_lightning.models.optim import fresh_adamw_state
    from nereus_lightning.models.sharded import shard_state
    from nereus_lightning.models.zero import ShardGroup, ZeroShards, cut_rows

    comm = ReplicaComm.of(tuple(r for r in range(4) if r // layout.size == rank // layout.size), layout, rank)
    shards = ShardGroup(3, peers, rank, group_for(peers))
    state = full if full is not None else shard_state(model, model.config, layout, 0, comm.tp_rank)
    blocks = {n: cut_rows(t, shards.shard, shards.shard_rank).clone() for n, t in state.items()}
    if full is None:
        blocks = {n: torch.zeros_like(b) for n, b in blocks.items()}
    module = ShardedCausalLM(model.config, comm, {n: torch.empty_like(t) for n, t in state.items()})
    optim = {n: fresh_adamw_state(b) for n, b in blocks.items()}
    zs = ZeroShards(module, shards, blocks, optim, lr=1e-2, **ADAMW)
    zs.release()
    return zs


def _sum(value: float) -> float:
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t)


def _next_two(module, step, gather, dp_rank: int, dp: int, alone: bool) -> list[float]:  # noqa: ANN001
    """Two more updates: their pg_loss (summed over the data ranks unless ``alone``) and norms."""
    out = []
    for _ in range(2):
        loss, norm = _update(module, step, gather, dp_rank, dp)
        out += [loss if alone else _sum(loss), norm]
    return out


def _resume(rank: int, world: int, path: str) -> dict[str, list[float]]:
    import torch.distributed.checkpoint as dcp

    from nereus_lightning.emu.dcp_state import zero_state_dict
    from nereus_lightning.lightning.stage_step import step_stage
    from nereus_lightning.models import ReplicaComm, ShardedCausalLM, bind_adamw
    from nereus_lightning.models.groups import group_for, replica_groups
    from nereus_lightning.models.optim import fresh_adamw_state
    from nereus_lightning.models.sharded import shard_state
    from nereus_lightning.plan.layout import Layout
    from nereus_lightning.testing.tiny import tiny_model

    model = tiny_model("qwen2")
    tp2 = Layout(2, 1)
    replica_groups([(0, 1), (2, 3)], tp2)  # every rank, same order: TP groups and the shard groups
    group_for((0, 1, 2, 3))
    out: dict[str, list[float]] = {}
    # shard 2 x TP2: shard rank s on ranks (2s, 2s + 1); one shard group per TP rank
    two = _zero_unit(
        rank, model, tp2, (rank % 2, rank % 2 + 2), shard_state(model, model.config, tp2, 0, rank % 2)
    )
    run = (two.module, lambda: step_stage(two.module, two, MAX_NORM), two.gather)
    _update(*run, rank // 2, 2)
    dcp.save(zero_state_dict(two, torch.tensor([[0, 2], [1, 3]])), checkpoint_id=path)
    out["shard2"] = _next_two(*run, rank // 2, 2, alone=False)

    four = _zero_unit(rank, model, Layout(), (0, 1, 2, 3), None)
    dcp.load(zero_state_dict(four, torch.tensor([[0, 1, 2, 3]])), checkpoint_id=path)
    out["shard4"] = _next_two(
        four.module, lambda: step_stage(four.module, four, MAX_NORM), four.gather, rank, 4, alone=False
    )

    # unsharded: every rank alone holds the whole state (ZeRO-0, one rank) and computes the whole batch
    names = [n for n, _ in model.named_parameters()]
    state = {f"param/{n}": p.detach().clone() for n, p in model.named_parameters()}
    optim = {n: fresh_adamw_state(state[f"param/{n}"]) for n in names}
    state |= {f"{k}/{n}": t for n in names for k, t in optim[n].items()}
    dcp.load(state, checkpoint_id=path)
    module = ShardedCausalLM(model.config, ReplicaComm.single(rank), {n: state[f"param/{n}"] for n in names})
    opt = bind_adamw(module, optim, lr=1e-2, **ADAMW)
    out["unsharded"] = _next_two(
        module, lambda: step_stage(module, opt, MAX_NORM), lambda: None, 0, 1, alone=True
    )
    return out


def test_save_at_shard_2_resume_at_shard_4_and_unsharded(dist4, tmp_path) -> None:
    results = dist4.run(_resume, str(tmp_path / "ckpt"))
    for rank, out in enumerate(results):
        want = out["shard2"]
        assert want[1] > MAX_NORM and want[0] != 0.0, want  # clipped, and a loss to compare
        for resumed in ("shard4", "unsharded"):
            for a, b in zip(out[resumed], want, strict=True):
                assert abs(a - b) <= 1e-5 * max(1.0, abs(b)), (rank, resumed, out[resumed], want)
