"""Nereus' target choice: net benefit, DAG budget, pinned training layouts, forecast, restart horizon."""

from __future__ import annotations

from dataclasses import replace

import pytest

from nereus_lightning.control import ControllerConfig, LengthForecast
from nereus_lightning.control.candidates import Option, layout_changes, same_cut
from nereus_lightning.control.search import Replan, TargetSearch
from nereus_lightning.control.triggers import Trigger
from nereus_lightning.plan import job_models, plan_job
from nereus_lightning.plan.layout import Candidate, Layout, Plan
from nereus_lightning.spec import CLUSTER_PRESETS, MODEL_PRESETS, Workload
from nereus_lightning.spec.errors import InfeasiblePlanError, NereusConfigError
from tests.control.fakes import CLUSTER, FakeBackend, FakeEstimate, controller, gen_plan, sig

A, B, C, D = gen_plan(1, 4), gen_plan(2, 4), gen_plan(4, 2), gen_plan(8, 1)


def test_net_benefit_prefers_a_cheaper_slightly_slower_target():
    # H = 1, gamma = 1: B gains 5 s for 4 s of transition (net 1), C gains 4.5 s for 0.5 s (net 4).
    backend = FakeBackend([A, B, C], {A: 10.0, B: 5.0, C: 5.5}, tran={B: 4.0, C: 0.5})
    ctl = controller(backend, gamma=1.0)
    ctl.step(sig(0))
    d = ctl.step(sig(1, length=2000))
    assert d.kind == "transition" and d.target == C and d.transition_cost == 0.5
    nets = {c["source"]: c.get("net_benefit") for c in d.considered}
    assert nets == {"planner best": 1.0, "planner alternative 1": 4.0}
    assert "net benefit" in d.reason
    # The baselines' "first" selection admits the first target that pays back: B.
    first = controller(
        FakeBackend([A, B, C], {A: 10.0, B: 5.0, C: 5.5}, tran={B: 4.0, C: 0.5}), gamma=1.0, selection="first"
    )
    first.step(sig(0))
    assert first.step(sig(1, length=2000)).target == B


def test_targets_that_cannot_beat_the_incumbent_are_not_priced():
    # B: net 0.5 * (10 - 5) - 0 = 2.5; C even free gives 0.5 * (10 - 9) = 0.5 < 2.5.
    backend = FakeBackend([A, B, C], {A: 10.0, B: 5.0, C: 9.0}, tran={B: 0.0, C: 0.0})
    ctl = controller(backend)
    ctl.step(sig(0))
    d = ctl.step(sig(1, length=2000))
    assert d.target == B and backend.calls["transition_cost"] == 1
    assert d.considered[1]["verdict"].startswith("not priced: even free")


def test_dag_budget_bounds_pricing_per_round():
    plans = [gen_plan(tp, dp) for tp, dp in ((2, 4), (4, 2), (8, 1), (2, 2), (4, 1))]
    latency = {A: 10.0, **{p: 5.0 + 0.1 * i for i, p in enumerate(plans)}}
    backend = FakeBackend([A, *plans], latency, tran={p: None for p in plans})  # every DAG infeasible
    ctl = controller(backend, dag_budget_gpus=2 * CLUSTER.with_gpus(8).num_gpus)  # 2 DAGs per round at 8 GPUs
    ctl.step(sig(0))
    d = ctl.step(sig(1, length=2000))
    assert backend.calls["transition_cost"] == 2
    assert sum(c["verdict"].startswith("not priced") for c in d.considered) == len(plans) - 2
    with pytest.raises(NereusConfigError, match="dag_budget_gpus"):
        ControllerConfig(dag_budget_gpus=0)


def test_the_target_changing_fewest_layouts_is_priced_right_after_the_best():
    keep = gen_plan(1, 8)  # A's layout, more replicas: Extend only
    backend = FakeBackend(
        [A, B, C, keep], {A: 10.0, B: 5.0, C: 5.1, keep: 6.0}, tran={B: None, C: None, keep: 1.0}
    )
    ctl = controller(backend, dag_budget_gpus=2 * 8)
    ctl.step(sig(0))
    d = ctl.step(sig(1, length=2000, gpus=8))
    assert [c["source"] for c in d.considered][:2] == ["planner best", "planner best, current layouts kept"]
    assert d.target == keep and layout_changes(keep, A) == 0 and layout_changes(B, A) == 1
    # The baselines' "first" selection keeps plain latency order (and has no DAG budget).
    backend = FakeBackend(
        [A, B, C, keep], {A: 10.0, B: 5.0, C: 5.1, keep: 6.0}, tran={B: None, C: None, keep: 1.0}
    )
    ctl = controller(backend, dag_budget_gpus=2 * 8, selection="first")
    ctl.step(sig(0))
    d = ctl.step(sig(1, length=2000, gpus=8))
    assert [c["latency"] for c in d.considered] == [5.0, 5.1, 6.0] and d.target == keep


class PinningBackend(FakeBackend):
    """A fake whose ``plan_pinned`` returns scripted plans (and records the layouts asked for)."""

    def __init__(self, *args, pinned_plans=(), **kw):
        super().__init__(*args, **kw)
        self.pinned_plans = list(pinned_plans)
        self.pinned_calls = []

    def plan_pinned(self, cluster, workload, calibration, layouts, memory=None):
        self.pinned_calls.append(dict(layouts))
        return [(p, self._est(p, workload)) for p in self.pinned_plans]


def train_plan(tp: int, pp: int, dp: int, micro_batch: int = 1) -> Plan:
    """A one-training-model-stage plan (actor_train) on GPUs 0 .. tp*pp*dp-1."""
    return Plan.of(
        {"actor_train": Candidate(Layout(tp, pp), dp, tuple(range(tp * pp * dp)), micro_batch, False)}
    )


def test_pinned_training_layouts_are_tried_only_when_the_best_target_fails():
    # (The pinned plan differs from "best with the current layouts kept" in its micro-batch.)
    cur, best, pinned = train_plan(1, 4, 1), train_plan(4, 1, 2), train_plan(1, 4, 2, micro_batch=2)
    backend = PinningBackend(
        [best], {cur: 20.0, best: 8.0, pinned: 10.0}, tran={best: None, pinned: 1.0}, pinned_plans=[pinned]
    )
    ctl = controller(backend, plan=cur)
    ctl.step(sig(0))
    d = ctl.step(sig(1, length=2000))  # best has no safe DAG: the pinned plan is reachable
    assert d.kind == "transition" and d.target == pinned
    assert backend.pinned_calls == [{"actor_train": frozenset({Layout(1, 4)})}]
    assert d.considered[-1]["source"].startswith("training layouts kept")
    # When the best target is admitted, no pinned planner call is made.
    backend = PinningBackend([best], {cur: 20.0, best: 8.0}, tran={best: 1.0}, pinned_plans=[pinned])
    ctl = controller(backend, plan=cur)
    ctl.step(sig(0))
    assert ctl.step(sig(1, length=2000)).target == best and backend.pinned_calls == []
    # Switched off: the best target fails and nothing else is tried.
    backend = PinningBackend(
        [best], {cur: 20.0, best: 8.0, pinned: 10.0}, tran={best: None, pinned: 1.0}, pinned_plans=[pinned]
    )
    ctl = controller(backend, plan=cur, pin_training=False)
    ctl.step(sig(0))
    assert ctl.step(sig(1, length=2000)).kind == "keep" and backend.pinned_calls == []


def test_retune_takes_free_micro_batch_changes_between_triggers():
    # The current layouts and GPUs with another micro-batch: nothing moves, so at a boundary
    # without triggers the controller takes it when faster, without moving the drift references.
    cur = train_plan(1, 4, 1)
    tuned, other = train_plan(1, 4, 1, micro_batch=2), train_plan(4, 1, 1, micro_batch=2)

    def run(pinned, tran, latency=None, **cfg):
        lat = {cur: 20.0, tuned: 18.0, other: 9.0, **(latency or {})}
        backend = PinningBackend([cur], lat, tran=tran, pinned_plans=[pinned])
        ctl = controller(backend, plan=cur, **{"retune": True, **cfg})
        return ctl, ctl.step(sig(0))  # a plan handed in: the first boundary has no trigger

    ctl, d = run(tuned, {tuned: 0.0})
    assert d.kind == "transition" and d.target == tuned and d.transition_cost == 0.0
    assert "retune" in d.reason and [t.kind for t in d.triggers] == ["retune"]
    assert ctl.plan == tuned and ctl.step(sig(1, length=1100)).kind == "none"  # nothing faster now
    assert ctl.drift["response_len"].reference == 1000.0  # references stay: no crossing
    assert ctl.step(sig(2, length=1400)).triggers[0].kind == "drift:response_len"
    # The planner's pick with another layout is not a retune: only micro-batch and recompute are taken.
    assert run(other, {other: 0.0})[1].kind == "none"
    # Not faster, or switched off: nothing happens. No transition DAG is priced (nothing moves).
    assert run(tuned, {tuned: 0.0}, latency={tuned: 21.0})[1].kind == "none"
    ctl, d = run(tuned, {tuned: None})  # a DAG, were one priced, would be refused
    assert d.target == tuned and ctl.backend.calls["transition_cost"] == 0
    assert run(tuned, {tuned: 0.0}, retune=False)[1].kind == "none"


def test_planner_pins_layouts():
    models = job_models(MODEL_PRESETS["llama3_8b"])
    cluster = CLUSTER_PRESETS["paper_cluster2"].with_gpus(16)
    free = plan_job(models, cluster, Workload())
    other = Layout(1, 4) if free.plan["actor_train"].layout != Layout(1, 4) else Layout(2, 2)
    pinned = plan_job(models, cluster, Workload(), pinned={"actor_train": other})
    assert pinned.plan["actor_train"].layout == other
    assert all(p["actor_train"].layout == other for p, _ in pinned.alternatives)
    assert pinned.estimate.step_latency >= free.estimate.step_latency - 1e-9
    with pytest.raises(NereusConfigError, match="unknown model-stages"):
        plan_job(models, cluster, Workload(), pinned={"nope": other})
    with pytest.raises(InfeasiblePlanError, match="pinned to"):
        plan_job(models, cluster, Workload(), pinned={"actor_train": Layout(1, 1)})  # 8B + Adam on one GPU
    with pytest.raises(NereusConfigError, match="no layout given for"):
        plan_job(models, cluster, Workload(), pinned={"actor_train": frozenset()})


def test_a_sharded_training_pin_keeps_the_model_cut_and_lets_the_shard_degree_follow_the_pool():
    # An 8B actor trained as one replica of TP2 x ZeRO-2 over 4 shard groups (8 GPUs) loses two GPUs:
    # its own layout needs 8, but the same TP x PP cut and ZeRO stage with fewer shards fits 6, and
    # a replica on a subset of its GPUs re-cuts its rows in place (no Split of its state).
    sharded = Layout(2, 1, shard=4, zero=2)
    assert same_cut(sharded, 6) == {replace(sharded, shard=s) for s in (2, 3, 4)}
    assert same_cut(Layout(2, 2), 64) == {Layout(2, 2)}  # unsharded: no ZeRO stage to keep
    models = job_models(MODEL_PRESETS["llama3_8b"])
    cluster = CLUSTER_PRESETS["b200x8"].with_gpus(6)
    with pytest.raises(InfeasiblePlanError, match="no candidate of that layout fits 6 GPUs"):
        plan_job(models, cluster, Workload("grpo"), pinned={"actor_train": sharded})
    result = plan_job(models, cluster, Workload("grpo"), pinned={"actor_train": same_cut(sharded, 6)})
    for plan in (result.plan, *(p for p, _ in result.alternatives)):
        kept = plan["actor_train"].layout
        assert (kept.tp, kept.pp, kept.zero) == (2, 1, 2) and kept.shard in (2, 3)
    with pytest.raises(InfeasiblePlanError, match="no candidate of those layouts fits 1 GPUs"):
        plan_job(models, cluster.with_gpus(1), Workload("grpo"), pinned={"actor_train": same_cut(sharded, 1)})


def test_length_forecast_extrapolates_the_trend_and_clamps():
    f = LengthForecast(window=3, clamp=0.3)
    f.observe(sig(0, length=1000))
    assert f.ahead(1) is None  # one measurement: no trend yet
    f.observe(sig(1, length=1100))
    f.observe(sig(2, length=1200))
    ahead = f.ahead(1)
    assert ahead["response_len"] == pytest.approx(1300) and ahead["response_len_p95"] == pytest.approx(1430)
    f.observe(sig(3, length=3000))  # a jump: the trend stays the steady one before it ...
    assert f.ahead(1)["response_len"] == pytest.approx(3100)
    assert f.next_step()["response_len"] == pytest.approx(3900)  # ... the next step's check: +30% at most
    f.observe(sig(4, length=2950))  # a level shift, not a trend: nothing is extrapolated onward
    assert f.ahead(9)["response_len"] == pytest.approx(2950)
    assert f.next_step()["response_len"] == pytest.approx(2950)
    g = LengthForecast()
    g.load_state_dict(f.state_dict())
    assert g.ahead(1) == f.ahead(1)


def test_controller_plans_for_the_forecast_and_warns_of_memory_before_it_breaks():
    seen = []

    class Recording(FakeBackend):
        def estimate(self, plan, cluster, workload, calibration, memory=None):
            seen.append(workload.response_len)
            est = super().estimate(plan, cluster, workload, calibration)
            est.feasible = workload.response_len < 1350  # A runs out of memory from 1,350 tokens
            return est

    backend = Recording([A, B], {A: 10.0, B: 12.0}, tran={B: 1.0})
    ctl = controller(backend, forecast_steps=1.0)
    for step, length in enumerate((1000, 1100, 1200)):
        assert ctl.step(sig(step, length=length)).kind == "none"
    d = ctl.step(sig(3, length=1290))  # measured 1,290 still fits; the next step (~1,380) does not
    assert any(t.kind == "memory" for t in d.triggers) and d.urgent and d.target == B
    assert any(x == pytest.approx(1380) for x in seen)  # the memory check reads the next step
    # Planning for the measured lengths, the memory check still reads the next step's forecast:
    # the violation is caught before the step runs, not after it broke.
    backend = Recording([A, B], {A: 10.0, B: 12.0}, tran={B: 1.0})
    ctl = controller(backend, forecast_steps=0.0)
    kinds = [ctl.step(sig(s, length=n)).kind for s, n in enumerate((1000, 1100, 1200, 1290))]
    assert kinds == ["none"] * 3 + ["transition"]


def test_restart_horizon_uses_the_pool_clock_when_it_is_longer():
    # Urgent memory: B (5 s/step) has no safe DAG, the recompute variant (15 s/step) has one.
    # Restart pays iff 10 * 0.5 * H >= 300, i.e. H >= 60: the memory clock says 1, the pool 80.
    relief = gen_plan(1, 4, recompute=True)
    outcomes = {}
    for pool_h in (1.0, 80.0):
        backend = FakeBackend(
            [B], {A: 10.0, B: 5.0, relief: 15.0}, tran={B: None, relief: 0.0}, feasible={A: False}
        )
        ctl = controller(backend, restart_s=300.0)
        ctl.pool.clock.ema, ctl.pool.clock.last_crossing = (None if pool_h == 1.0 else pool_h), None
        assert ctl.restart_horizon(1.0) == pool_h
        outcomes[pool_h] = ctl.step(sig(0)).kind
    assert outcomes == {1.0: "transition", 80.0: "restart"}


def test_no_restart_is_judged_past_the_last_step():
    # The same choice with the pool clock at 80 steps, but 20 steps left: 10 * 0.5 * 20 < 300.
    relief = gen_plan(1, 4, recompute=True)
    latency = {A: 10.0, B: 5.0, relief: 15.0}
    backend = FakeBackend([B], latency, tran={B: None, relief: 0.0}, feasible={A: False})
    ctl = controller(backend, restart_s=300.0, max_steps=20)
    ctl.pool.clock.ema, ctl.pool.clock.last_crossing = 80.0, None
    assert ctl.restart_horizon(1.0, 0) == 20.0 and ctl.restart_horizon(1.0) == 80.0
    assert ctl.step(sig(0)).kind == "transition"


def test_urgent_choice_weighs_latency_against_transition_cost():
    # Lost GPUs: B is fast but its DAG is slow, C a bit slower and cheap; w = max(0.5 * 1, 1) = 1.
    backend = FakeBackend([B, C], {A: 10.0, B: 5.0, C: 5.5}, tran={B: 30.0, C: 1.0})
    ctl = controller(backend)
    ctl.step(sig(0))
    d = ctl.step(sig(1, gpus=2))
    assert d.urgent and d.kind == "transition" and d.target == C


def test_targets_with_the_layouts_of_a_failed_dag_are_tried_last():
    same = gen_plan(2, 3)  # B's layout (TP2): its DAG would fail the same way
    backend = FakeBackend(
        [A, B, same, C], {A: 10.0, B: 5.0, same: 5.1, C: 5.2}, tran={B: None, same: None, C: 1.0}
    )
    ctl = controller(backend, dag_budget_gpus=2 * 8)  # 2 DAGs per round at 8 GPUs
    ctl.step(sig(0))
    d = ctl.step(sig(1, length=2000))
    assert d.kind == "transition" and d.target == C
    verdicts = {c["latency"]: c["verdict"] for c in d.considered}
    assert verdicts[5.1].startswith("not priced") and backend.calls["transition_cost"] == 2


def test_no_pinned_planner_call_without_a_faster_target():
    cur, pinned = train_plan(1, 4, 1), train_plan(1, 4, 2, micro_batch=2)
    backend = PinningBackend([cur], {cur: 10.0, pinned: 9.0}, pinned_plans=[pinned])
    ctl = controller(backend, plan=cur)
    ctl.step(sig(0))
    d = ctl.step(sig(1, length=2000))  # drift; the planner's best is the current plan
    assert d.kind == "keep" and backend.pinned_calls == []


def test_variants_keep_colocated_groups_together():
    """follow_pool and place_near move a colocated group as one block (its members share GPUs)."""
    from nereus_lightning.control.variants import follow_pool, place_near
    from nereus_lightning.plan import Candidate, Layout, Plan
    from nereus_lightning.plan.overlap import colocated
    from nereus_lightning.spec.workload import workflow

    stage_of = {m.name: m.stage for m in workflow("grpo")}
    one = Layout(1, 1)
    plan = Plan.of({
        "actor_gen": Candidate(one, 2, (0, 1)),
        "actor_infer": Candidate(one, 2, (0, 1)), "ref_infer": Candidate(one, 1, (0,)),
        "reward_infer": Candidate(one, 1, (2,)),
        "actor_train": Candidate(one, 2, (0, 1)),
    })  # fmt: skip
    grown = follow_pool(plan, "grpo", 4, batch=8)
    assert grown is not None and colocated(grown, stage_of) == (("actor_infer", "ref_infer"),)
    assert all(g < 4 for _, c in grown.items() for g in c.gpus)
    # Two concurrent inference groups need two GPUs; the colocated pair needs only one of them.
    assert follow_pool(plan, "grpo", 2, batch=8) is not None
    assert follow_pool(plan, "grpo", 1, batch=8) is None
    now = plan.replace("reward_infer", Candidate(one, 1, (0,))).replace(
        "actor_infer", Candidate(one, 2, (2, 3))
    )
    now = now.replace("ref_infer", Candidate(one, 1, (2,)))
    moved = place_near(plan, now, "grpo")  # the colocated pair is at GPU 2 now, reward_infer at 0
    assert moved["reward_infer"].gpus == (0,) and moved["actor_infer"].gpus == (1, 2)
    assert moved["ref_infer"].gpus == (1,)
    assert colocated(moved, stage_of) == (("actor_infer", "ref_infer"),)


def _last_of_a_rise(relieved_latency: float):  # noqa: ANN202
    """The current plan A runs out of memory at the next step's length; the planner's best B (5 s)
    fits now but not at the forecast; B with recomputation lasts. The urgent decision."""
    a_rc, b_rc = gen_plan(1, 4, recompute=True), gen_plan(2, 4, recompute=True)

    class Growing(FakeBackend):
        def estimate(self, plan, cluster, workload, calibration, memory=None):
            est = super().estimate(plan, cluster, workload, calibration)
            est.feasible = est.feasible and (plan.items()[0][1].recompute or workload.response_len < 1350)
            return est

    latency = {A: 10.0, B: 5.0, a_rc: 20.0, b_rc: relieved_latency}
    ctl = controller(Growing([B], latency, tran={B: 1.0, b_rc: 1.0, a_rc: 0.0}))
    for step, length in enumerate((1000, 1100, 1200)):
        assert ctl.step(sig(step, length=length)).kind == "none"
    return ctl.step(sig(3, length=1290)), b_rc


def test_a_target_that_does_not_last_is_also_tried_relieved():
    # B relieved, a little slower, lasts: it beats B (whose 5 s/step gain counts for one step, and
    # which pays for two moves) and the current plan relieved (A with recomputation, slower still).
    d, b_rc = _last_of_a_rise(5.5)
    assert d.urgent and d.kind == "transition" and d.target == b_rc
    verdicts = {c["source"]: c.get("lasts", True) for c in d.considered}
    assert verdicts["planner best"] is False and verdicts["planner best, relieved"] is True


def test_a_target_that_does_not_last_is_priced_not_ruled_out():
    # Urgent, H = 4 (weight gamma * H = 2) from a 10 s/step plan, 1 s per move. A lasting target
    # earns 2 x its gain; one that does not last earns its gain once and pays for two moves; one
    # that does not even fit the next step also loses that step.
    def chosen(lasting_latency: float) -> str:
        backend = FakeBackend([], {}, tran={B: 1.0, C: 1.0, D: 1.0})
        r = Replan(sig(5), (Trigger("memory", 4.0, urgent=True),), 4.0, True, 10.0, A, CLUSTER, Workload())
        search = TargetSearch(r, backend, controller(backend)._profitable, gamma=0.5, budget=10)
        for opt in (
            Option(B, FakeEstimate(5.0), "breaks within the horizon", lasts=False),  # net 5 - 2 = 3
            Option(C, FakeEstimate(3.0), "breaks at the next step", lasts=False, runs_next=False),  # 7-2-3
            Option(D, FakeEstimate(lasting_latency), "lasts"),  # 2 x (10 - latency) - 1
        ):
            search.evaluate(opt)
        assert search.best is not None
        return search.best.source

    assert chosen(9.0) == "breaks within the horizon"
    assert chosen(7.5) == "lasts"


def test_outside_the_urgent_path_a_target_over_the_cap_at_the_next_step_is_not_taken():
    def last_decision(cap: float):  # noqa: ANN202
        class Capped(FakeBackend):
            def estimate(self, plan, cluster, workload, calibration, memory=None):
                est = super().estimate(plan, cluster, workload, calibration)
                est.feasible = plan != B or workload.response_len < cap  # B runs out from cap tokens
                return est

        ctl = controller(Capped([A, B], {A: 10.0, B: 5.0}, tran={B: 0.1}))
        return [ctl.step(sig(s, length=n)) for s, n in enumerate((1000, 1100, 1440))][-1]

    d = last_decision(1500.0)  # a drift replan; the next step is checked at 1,440 + 340 tokens
    assert d.kind == "keep" and "over the memory cap at the next step's forecast" in str(d.considered)
    assert last_decision(1800.0).kind == "transition"
