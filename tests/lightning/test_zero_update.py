"""A PPO actor update of one sharded replica (shard 2 x TP2, ZeRO-1/2/3) equals ZeRO-0 at DP2 x TP2.

Four gloo ranks, the same GPUs in both: ZeRO-0 replicas (0, 1) and (2, 3); the sharded replica's
shard rank 0 on (0, 1) and shard rank 1 on (2, 3), each running the rows of the ZeRO-0 replica at
its place. Two updates (so ZeRO-3 gathers stepped blocks), clipping active.
"""

from __future__ import annotations

import pytest
import torch

from nereus_lightning.testing.tiny import my_replica, rel_err, tiny_model
from tests.lightning.test_packed_update import _rollout

pytestmark = pytest.mark.distributed

MAX_NORM = 0.05  # below the norms of this batch: the clipping is part of what is compared


def _updates(module, step, gather, dp_rank: int) -> list[float]:  # noqa: ANN001
    from nereus_lightning.lightning.batches import replica_backward
    from nereus_lightning.rl.algorithm import RLConfig
    from nereus_lightning.rl.batch import dp_slice

    cfg = RLConfig(algorithm="ppo", entropy_coeff=0.01)
    norms = []
    for mini in _rollout(7).split(2):
        mask = mini.response_mask.float()
        gather()
        rows = dp_slice(len(mini), 2, dp_rank)  # this data rank's (a ZeRO-0 replica or a shard rank)
        replica_backward(module, mini.select(rows), 2, cfg, cfg.normalizer(mask), mask.sum(), True)
        norms.append(step().norm)
    gather()
    return norms


def _zero_vs_dp(rank: int, world: int, zero: int) -> dict[str, float]:
    from nereus_lightning.lightning.stage_step import step_stage
    from nereus_lightning.models import ReplicaComm, ShardedCausalLM, bind_adamw
    from nereus_lightning.models.groups import group_for
    from nereus_lightning.models.sharded import shard_state
    from nereus_lightning.models.zero import ShardGroup, ZeroShards, cut_rows
    from nereus_lightning.plan.layout import Layout
    from nereus_lightning.rl.update import ADAMW

    model = tiny_model("qwen2")
    layout = Layout(2, 1)
    replica, comm = my_replica(rank, world, layout, tied=False)
    ref = ShardedCausalLM.from_model(model, comm)
    opt = bind_adamw(ref, None, lr=1e-2, **ADAMW)
    ref_norms = _updates(ref, lambda: step_stage(ref, opt, MAX_NORM), lambda: None, replica)

    peers = (comm.index, comm.index + layout.size)  # this position in each half of the world
    shards = ShardGroup(zero, peers, rank, group_for(peers))  # (made by my_replica as the DP group)
    unit = ReplicaComm.of(comm.ranks, layout, rank)  # one replica: no DP group beyond the shard group
    full = shard_state(model, model.config, layout, 0, comm.tp_rank)
    blocks = None
    if zero == 3:  # the unit holds row blocks; the module's tensors are filled before each use
        blocks = {n: cut_rows(t, 2, shards.shard_rank).clone() for n, t in full.items()}
        full = {n: torch.empty_like(t) for n, t in full.items()}
    module = ShardedCausalLM(model.config, unit, full)
    zs = ZeroShards(module, shards, blocks, None, lr=1e-2, **ADAMW)
    zs.release()
    norms = _updates(module, lambda: step_stage(module, zs, MAX_NORM), zs.gather, shards.shard_rank)

    out = {"norm": max(abs(a - b) / b for a, b in zip(norms, ref_norms, strict=True))}
    out["clipped"] = float(min(ref_norms) > MAX_NORM)
    refs = dict(ref.named_parameters())
    out["params"] = max(rel_err(p, refs[n]) for n, p in module.named_parameters())
    out["moved"] = max(
        rel_err(refs[n], t) for n, t in shard_state(model, model.config, layout, 0, comm.tp_rank).items()
    )
    for key in ("exp_avg", "exp_avg_sq"):
        out[key] = max(
            rel_err(zs.optimizer.state[zs.blocks[n]][key], cut_rows(opt.state[p][key], 2, shards.shard_rank))
            for n, p in refs.items()
        )
    return out


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_a_sharded_replicas_update_is_zero0s(dist4, zero: int) -> None:
    for rank, out in enumerate(dist4.run(_zero_vs_dp, zero)):
        assert out["clipped"] == 1.0, f"rank {rank}: the norms did not exceed the clip; the test is too weak"
        assert out["moved"] > 1e-3, f"rank {rank}: the update changed nothing"
        for key in ("norm", "params", "exp_avg", "exp_avg_sq"):
            assert out[key] < 1e-5, f"rank {rank} ZeRO-{zero} {key}: {out[key]:.2e} from ZeRO-0"
