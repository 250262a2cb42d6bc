"""Model-stages of one stage on disjoint ranks run concurrently and exchange their results once."""

from __future__ import annotations

import torch
import torch.distributed as dist

from nereus_lightning.lightning.stages import RowsJob, run_stages, run_stages_rows
from tests.lightning.helpers import plan_of

# actor_infer on rank 0 only, ref_infer on rank 1 only (one replica each).
PLACEMENT = {"actor_infer": (0,), "ref_infer": (1,), "critic_infer": (2,), "reward_infer": (3,)}


def _waits_for_ref(slot):  # noqa: ANN001, ANN202
    # actor_infer (rank 0) cannot finish before ref_infer (rank 1) has started: a barrier between
    # the two model-stages would deadlock here.
    box = torch.zeros(1)
    dist.recv(box, src=1)
    return torch.full((slot.stop - slot.start, 2), float(box))


def _signals_actor(slot):  # noqa: ANN001, ANN202
    dist.send(torch.tensor([7.0]), dst=0)
    return torch.arange(slot.start, slot.stop, dtype=torch.float32).unsqueeze(-1).expand(-1, 2)


def _concurrent(rank: int, world: int) -> dict:
    plan = plan_of("ppo", PLACEMENT)
    jobs = [RowsJob("actor_infer", 2, _waits_for_ref), RowsJob("ref_infer", 2, _signals_actor)]
    rows = run_stages_rows(plan, jobs, rank, 5, torch.device("cpu"))
    lists = run_stages(
        plan,
        {"critic_infer": lambda s: [("c", i) for i in s.indices], "reward_infer": lambda s: list(s.indices)},
        rank,
        5,
    )
    return {"rows": {k: v.tolist() for k, v in rows.items()}, "lists": lists}


def test_model_stages_on_disjoint_ranks_run_concurrently(dist4) -> None:
    for out in dist4.run(_concurrent):
        assert out["rows"]["actor_infer"] == [[7.0, 7.0]] * 5
        assert out["rows"]["ref_infer"] == [[float(i)] * 2 for i in range(5)]
        assert out["lists"] == {"critic_infer": [("c", i) for i in range(5)], "reward_infer": list(range(5))}
