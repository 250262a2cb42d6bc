"""Resource providers, trigger clocks and the cheap plan variants."""

from __future__ import annotations

import json
import os

import pytest

from nereus_lightning.control import (
    CrossingClock,
    DeviceInventoryError,
    DriftTrigger,
    NvmlResources,
    PoolTrigger,
    SchedulerFileResources,
    StaticResources,
    StepSignals,
    TraceResources,
    follow_pool,
    relief_variants,
    scale_count,
)
from nereus_lightning.plan.layout import Candidate, Layout, Plan
from nereus_lightning.spec.errors import NereusConfigError


def test_static_and_trace_resources():
    assert StaticResources(4).pool(7) == (0, 1, 2, 3)
    assert StaticResources((3, 1)).pool(0) == (1, 3)
    trace = TraceResources((16, 8, 0, 12), min_gpus=8, max_gpus=32, ticks_per_step=0.5, granularity=4)
    assert [trace.num_gpus(s) for s in range(6)] == [32, 32, 20, 20, 8, 8]
    assert trace.num_gpus(6) == 24  # 8 + 24 * 12/16 = 26 -> whole nodes of 4
    assert trace.tick(8) == 0  # wraps around
    assert scale_count(0, 16, 64, 1024, 8) == 64 and scale_count(16, 16, 64, 1024, 8) == 1024
    with pytest.raises(NereusConfigError, match="ticks_per_step"):
        TraceResources((1,), 1, 2, ticks_per_step=0)


def test_scheduler_file_announces_revocations(tmp_path):
    path = tmp_path / "pool.json"
    path.write_text(json.dumps({"gpus": [0, 1, 2, 3]}))
    res = SchedulerFileResources(path)
    assert res.pool(0) == (0, 1, 2, 3)
    path.write_text(json.dumps({"gpus": [0, 1, 3]}))
    os.utime(path, ns=(1, 10**18))  # a new mtime even on coarse clocks
    assert res.pool(1) == (0, 1, 3)
    path.write_text(json.dumps({"nodes": 3}))
    os.utime(path, ns=(1, 2 * 10**18))
    with pytest.raises(NereusConfigError, match="num_gpus"):
        res.pool(2)
    with pytest.raises(NereusConfigError, match="missing"):
        SchedulerFileResources(tmp_path / "nope.json").pool(0)


def test_nvml_inventory_never_crashes():
    try:
        res = NvmlResources()
    except DeviceInventoryError as exc:
        assert "no GPU inventory available" in str(exc) and "NVML" in str(exc) or "nvidia-ml-py" in str(exc)
    else:
        assert all(isinstance(g, int) for g in res.pool(0))


def test_crossing_clock_and_triggers():
    clock = CrossingClock(alpha=0.5)
    assert clock.horizon == 1.0
    clock.cross(4)
    assert clock.horizon == 1.0  # one crossing = no interval yet
    clock.cross(10)
    clock.cross(12)
    assert clock.horizon == pytest.approx(0.5 * 2 + 0.5 * 6)
    drift = DriftTrigger("response_len", delta=0.3)
    assert drift.check(0, 100.0) is None and drift.check(1, 129.0) is None
    assert drift.check(2, 69.0) is not None  # relative drops count too
    pool = PoolTrigger()
    assert pool.check(0, (0, 1, 2, 3), frozenset({0, 1})) is None
    assert pool.check(1, (0, 1, 2), frozenset({0, 1})).kind == "pool"
    assert pool.check(2, (0, 2), frozenset({0, 1})).urgent


def test_signals_validate():
    with pytest.raises(NereusConfigError, match="response_len_p95"):
        StepSignals(0, 1000, 900, 10, (0,))
    assert StepSignals(0, 1000, 1000, 10, 3).gpus == (0, 1, 2)


def _ppo_plan():
    def c(tp, dp, start):
        return Candidate(Layout(tp, 1), dp, tuple(range(start, start + tp * dp)))

    return Plan.of(
        {
            "actor_gen": c(2, 4, 0),
            "actor_infer": c(1, 2, 0),
            "ref_infer": c(1, 2, 2),
            "critic_infer": c(1, 2, 4),
            "reward_infer": c(1, 2, 6),
            "actor_train": c(2, 2, 0),
            "critic_train": c(2, 2, 4),
        }
    )


def test_follow_pool_keeps_layouts_and_fills_the_pool():
    plan = _ppo_plan()
    grown = follow_pool(plan, "ppo", 16, batch=256)
    assert grown is not None
    for name, cand in grown.items():
        assert cand.layout == plan[name].layout
    assert grown["actor_gen"].dp == 8
    assert grown["actor_train"].dp + grown["critic_train"].dp == 8
    assert sum(grown[n].num_gpus for n in ("actor_infer", "ref_infer", "critic_infer", "reward_infer")) == 16
    train = set(grown["actor_train"].gpus) | set(grown["critic_train"].gpus)
    assert len(train) == 16 and max(train) == 15  # disjoint, inside the pool
    assert follow_pool(plan, "ppo", 3, batch=256) is None  # four inference replicas need 4 GPUs
    variants = relief_variants(plan, set(plan))
    # micro-batch 1 cannot halve
    assert all(c.recompute for _, c in variants[0].items()) and len(variants) == 1


def test_relief_touches_only_the_named_model_stages():
    plan = _ppo_plan().replace("actor_gen", Candidate(Layout(2, 1), 4, tuple(range(8)), 32))
    plan = plan.replace("critic_train", Candidate(Layout(2, 1), 2, tuple(range(4, 8)), 4))
    recompute, halved, both = relief_variants(plan, {"critic_train"})
    for variant in (recompute, halved, both):
        assert all(variant[n] == plan[n] for n in plan if n != "critic_train")
    assert recompute["critic_train"].recompute and recompute["critic_train"].micro_batch == 4
    assert not halved["critic_train"].recompute and halved["critic_train"].micro_batch == 2
    assert both["critic_train"].recompute and both["critic_train"].micro_batch == 2
    assert relief_variants(plan, set()) == []


def test_place_near_and_keep_layouts():
    from nereus_lightning.control import keep_layouts, place_near

    def c(tp, pp, dp, start):
        return Candidate(Layout(tp, pp), dp, tuple(range(start, start + tp * pp * dp)))

    current = _ppo_plan()
    # A target whose training blocks are swapped relative to the current plan (critic first).
    target = current.replace("critic_train", c(1, 1, 4, 0)).replace("actor_train", c(4, 2, 1, 4))
    near = place_near(target, current, "ppo")
    assert min(near["actor_train"].gpus) == 0 and min(near["critic_train"].gpus) == 8
    assert near["actor_train"].layout == Layout(4, 2)  # only the placement moves
    kept = keep_layouts(near, current)
    assert kept["actor_train"].layout == Layout(2, 1) and kept["actor_train"].dp == 4  # 8 GPUs / TP2 replicas
    assert kept["critic_train"].layout == Layout(2, 1) and kept["critic_train"].dp == 2
    assert kept["actor_gen"] == near["actor_gen"]  # same layout: untouched
