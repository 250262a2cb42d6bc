"""Small pools: PPO, GRPO and ReMax train through the planner on 1, 2 and 3 gloo ranks.

With fewer ranks than a stage has model-stages, the planner colocates them (they share ranks and
run one after another); the run then goes through the real controller, the transition DAG and
the EMU executor as on any pool. That a colocated and a disjoint plan give the same update is
``test_layout_equivalence`` (layout A is fully colocated, layout B mostly disjoint).
"""

from __future__ import annotations

import json

import pytest

from nereus_lightning.cli.train import train_config
from nereus_lightning.plan.layout import Candidate, Layout, Plan
from nereus_lightning.plan.overlap import stage_groups
from nereus_lightning.spec.workload import stages_of

pytestmark = pytest.mark.distributed


def _gpus(ranges: str) -> tuple[int, ...]:
    """GPU ids from the decision log's form, e.g. ``"0-2,5"``."""
    out: list[int] = []
    for part in ranges.split(","):
        lo, _, hi = part.partition("-")
        out += range(int(lo), int(hi or lo) + 1)
    return tuple(out)


def _first_plan(out) -> Plan:
    """The first decision's target plan from the run's decision log."""
    with open(out / "decisions.jsonl") as f:
        target = json.loads(f.readline())["target_plan"]
    return Plan.of(
        {
            name: Candidate(
                Layout(c["tp"], c["pp"], c["shard"], c["zero"]),
                c["dp"],
                _gpus(c["gpus"]),
                c["micro_batch"],
                c["recompute"],
            )
            for name, c in target.items()
        }
    )


@pytest.mark.parametrize("devices", [1, 2, 3])
@pytest.mark.parametrize("algorithm", ["ppo", "grpo", "remax"])
def test_small_pools_train_through_the_planner(tmp_path, algorithm, devices):
    from nereus_lightning.cli.train import run

    cfg = train_config(
        [
            f"algorithm={algorithm}",
            f"trainer.devices={devices}",
            "trainer.max_steps=5",
            "algorithm.prompts_per_step=4",
            "task.max_len=6",
            "task.supply=null",
            "task.gpu_memory=null",  # the preset's memory: the pool alone decides
            f"output_dir={tmp_path}",
            "plot=false",
        ]
    )
    summary = run(cfg)
    assert summary["steps"] == 5
    plan = _first_plan(tmp_path)
    assert all(g < devices for _, c in plan.items() for g in c.gpus)
    # Every stage with more model-stages than ranks runs (some of) them in turn on shared ranks.
    for stage, members in stages_of(algorithm).items():
        names = [m.name for m in members if m.name in plan]
        groups = stage_groups(plan, names)
        assert len(groups) <= devices, (stage, groups)
        if len(names) > devices:
            assert any(len(g) > 1 for g in groups), (stage, groups)
