"""A PPO run resumed from 2 onto 4 ranks takes the added ranks into use from its first step.

After a relaunch the pool is the launch's for the rest of the run (H_x = the steps left to
``trainer.max_steps``) and the checkpoint loads into any plan, so moving costs no transition
(``Controller._relaunch``): the planner's best pays back at once, and the decision log says so.
"""

from __future__ import annotations

import csv
import json

import pytest

from tests.helpers import nereus_train

# PPO on the embedded task with fixed answer lengths and memory to spare: the pool is the only drift.
JOB = (
    "algorithm=ppo",
    "task.grow_every=1000",
    "cluster_gpu_memory=8e9",
    "plot=false",
    "export_hf=false",
)


def _ids(ranges: str) -> set[int]:
    out: set[int] = set()
    for part in ranges.split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def _gpus(plan: dict) -> set[int]:
    return {g for c in plan.values() for g in _ids(c["gpus"])}


@pytest.mark.distributed
def test_resume_from_two_onto_four_ranks_uses_the_added_ranks(tmp_path):
    two = tmp_path / "two"
    nereus_train(two, *JOB, "trainer.devices=2", "trainer.max_steps=2", "checkpoint_every=2")
    first = json.loads((two / "decisions.jsonl").read_text().splitlines()[0])
    assert _gpus(first["target_plan"]) == {0, 1}

    four = tmp_path / "four"
    ckpt = two / "checkpoints" / "step2.ckpt"
    nereus_train(four, f"ckpt_path={ckpt}", "trainer.devices=4", "trainer.max_steps=5")
    decisions = [json.loads(line) for line in (four / "decisions.jsonl").read_text().splitlines()]
    resumed = next(d for d in decisions if d["step"] == 2)  # the first decision after the relaunch
    assert resumed["decision"] == "transition", resumed["reason"]
    assert {2, 3} <= _gpus(resumed["target_plan"]), resumed["target_plan"]
    assert not resumed["urgent"]  # taken because it pays, not because the old plan broke
    # The log says why: the relaunch horizon (3 steps left) and a move that costs nothing.
    assert "relaunched on this pool: H = 3 steps left" in json.dumps(resumed["trigger"])
    assert resumed["L_tran"] == 0.0 and resumed["dL"] > 0
    assert "pays back in 0.00 steps <= gamma*H_x = 0.5*3.00" in resumed["reason"], resumed["reason"]
    metrics = csv.DictReader(open(four / "logs" / "version_0" / "metrics.csv"))
    rows = [r for r in metrics if r.get("plan/num_gpus")]
    assert [float(r["plan/num_gpus"]) for r in rows] == [4.0, 4.0, 4.0]  # steps 2, 3, 4 on all 4 ranks
