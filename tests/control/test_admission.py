"""Admission rules of the controller, each on a scripted backend."""

from __future__ import annotations

import json

import pytest

from nereus_lightning.control import DecisionLog
from nereus_lightning.control.triggers import Trigger, smallest_horizon
from tests.control.fakes import FakeBackend, controller, gen_plan, sig

A, B, C = gen_plan(1, 4), gen_plan(2, 4), gen_plan(4, 2)


def test_gamma_zero_admits_only_urgent():
    backend = FakeBackend([A, B], {A: 10.0, B: 5.0}, tran={B: 0.0})
    ctl = controller(backend, gamma=0.0)
    assert ctl.step(sig(0)).kind == "none"
    d = ctl.step(sig(1, length=2000))  # drift: B is faster and even free, but gamma=0
    assert d.kind == "keep" and not d.urgent
    assert "gamma=0" in d.considered[0]["verdict"]
    # Losing GPUs the plan uses is urgent: admitted despite gamma=0.
    backend.candidates = [gen_plan(1, 2)]
    backend.latency[gen_plan(1, 2)] = 20.0
    d = ctl.step(sig(2, length=2000, gpus=2))
    assert d.kind == "transition" and d.urgent and d.target == gen_plan(1, 2)


def test_reference_resets_after_rejected_replan():
    ctl = controller(FakeBackend([A, B], {A: 10.0, B: 5.0}, tran={B: 1000.0}))
    ctl.step(sig(0, length=1000))
    d = ctl.step(sig(1, length=1400))  # +40% > 30%: replan, payback fails
    assert d.kind == "keep"
    assert ctl.drift["response_len"].reference == 1400
    assert ctl.step(sig(2, length=1500)).kind == "none"  # +7% of the new reference: no trigger
    assert ctl.step(sig(3, length=1900)).kind == "keep"  # +36% of 1400


def test_horizon_counts_the_first_interval_from_the_first_step_and_updates_only_at_crossings():
    backend = FakeBackend([A, B], {A: 10.0, B: 5.0}, tran={B: 1000.0})
    ctl = controller(backend, drift_signals=("response_len",))
    ctl.step(sig(0, length=1000))
    ctl.step(sig(1, length=1050))
    d = ctl.step(sig(2, length=1400))
    assert d.horizon == 2.0  # first crossing: the length held since step 0
    for s in range(3, 7):  # no crossing: the EMA must not move
        ctl.step(sig(s, length=1450))
        assert ctl.drift["response_len"].clock.ema == 2.0
    d = ctl.step(sig(7, length=2000))
    assert d.horizon == pytest.approx(0.5 * 5 + 0.5 * 2)  # interval 7 - 2
    d = ctl.step(sig(10, length=2700))
    assert d.horizon == pytest.approx(0.5 * 3 + 0.5 * 3.5)


def test_smallest_horizon_wins():
    # payback L_tran / dL = 3 steps; gamma = 1: admitted with H = 10, rejected with H = 2.
    backend = FakeBackend([A, B], {A: 10.0, B: 5.0}, tran={B: 15.0})
    ctl = controller(backend, gamma=1.0, drift_signals=("response_len", "response_len_p95"))
    ctl.step(sig(0, length=1000, p95=1100))
    ctl.drift["response_len"].clock.ema, ctl.drift["response_len"].clock.last_crossing = 10.0, 0
    ctl.drift["response_len_p95"].clock.ema, ctl.drift["response_len_p95"].clock.last_crossing = 2.0, 0
    d = ctl.step(sig(10, length=1500, p95=1650))  # both cross at step 10 (interval 10)
    assert {t.kind for t in d.triggers} == {"drift:response_len", "drift:response_len_p95"}
    horizons = {t.kind: t.horizon for t in d.triggers}
    assert horizons["drift:response_len"] == 10.0 and horizons["drift:response_len_p95"] == 6.0
    assert d.horizon == 6.0 and d.kind == "transition"
    ctl2 = controller(
        FakeBackend([A, B], {A: 10.0, B: 5.0}, tran={B: 15.0}),
        gamma=1.0,
        drift_signals=("response_len", "response_len_p95"),
    )
    ctl2.step(sig(0, length=1000, p95=1100))
    ctl2.drift["response_len_p95"].clock.ema, ctl2.drift["response_len_p95"].clock.last_crossing = 1.0, 9
    d = ctl2.step(sig(10, length=1500, p95=1650))
    assert d.horizon == 1.0 and d.kind == "keep"  # 3 > gamma * min(H) = 1


def test_infeasible_current_plan_takes_urgent_path_even_when_payback_fails():
    backend = FakeBackend([B], {A: 10.0, B: 9.9}, tran={B: 1e6}, feasible={A: False})
    d = controller(backend, gamma=0.5).step(sig(0))
    assert d.urgent and d.kind == "transition" and d.target == B
    assert any(t.kind == "memory" for t in d.triggers)
    assert d.transition_cost == 1e6  # payback 1e6 / 0.1 steps would fail by far


def test_urgent_path_considers_recompute_and_falls_back_to_restart():
    relief = gen_plan(1, 4, recompute=True)
    backend = FakeBackend([], {A: 10.0, relief: 12.0}, feasible={A: False})
    d = controller(backend).step(sig(0))
    assert d.kind == "transition" and d.target == relief
    backend = FakeBackend(
        [B], {A: 10.0, B: 5.0, relief: 12.0}, tran={B: None, relief: None}, feasible={A: False}
    )
    d = controller(backend).step(sig(0))
    assert d.kind == "restart" and d.target == B
    assert "checkpoint/restart" in d.reason


def test_slower_alternative_with_cheaper_transition():
    backend = FakeBackend([A, B, C], {A: 10.0, B: 5.0, C: 6.0}, tran={B: 100.0, C: 1.0})
    ctl = controller(backend)
    ctl.step(sig(0))
    d = ctl.step(sig(1, length=2000))  # H = 1: B needs 20 steps, C 0.25 <= 0.5
    assert d.kind == "transition" and d.target == C
    assert [c["source"] for c in d.considered] == ["planner best", "planner alternative 1"]
    assert ctl.plan == C


def test_any_gain_and_schedule():
    backend = FakeBackend([A, B], {A: 10.0, B: 9.99}, tran={B: 1e4})
    ctl = controller(backend, admission="any_gain", replan_every=3, drift_triggers=False)
    assert ctl.step(sig(0)).kind == "none"
    kinds = [ctl.step(sig(s, length=1000 * (1 + s))).kind for s in range(1, 4)]
    assert kinds == ["none", "none", "transition"]  # drift ignored; the schedule fires at step 3


def test_decision_log_and_state_roundtrip(tmp_path):
    path = tmp_path / "decisions.jsonl"
    backend = FakeBackend([A, B], {A: 10.0, B: 5.0}, tran={B: 1.0})
    ctl = controller(backend, log=str(path))
    ctl.step(sig(0))
    ctl.step(sig(1, length=2000))
    records = DecisionLog(path).read()
    assert len(records) == 1
    rec = records[0]
    for key in (
        "step",
        "trigger",
        "signals",
        "current_plan",
        "target_plan",
        "current_latency",
        "target_latency",
        "dL",
        "L_tran",
        "H_x",
        "gamma",
        "decision",
        "reason",
    ):
        assert key in rec
    assert rec["decision"] == "transition" and rec["dL"] == 5.0 and rec["target_plan"]["actor_gen"]["tp"] == 2
    state = json.loads(json.dumps(ctl.state_dict()))
    other = controller(backend, plan=None)
    other.load_state_dict(state)
    assert other.plan == ctl.plan and other.drift["response_len"].reference == 2000
    assert other.state_dict() == ctl.state_dict()


def test_calibration_loop_observes_op_classes_and_transitions():
    class Cal:
        def __init__(self):
            self.seen = []

        def observe(self, op, predicted, measured):
            self.seen.append((op, predicted, measured))

    backend = FakeBackend([A, B], {A: 10.0, B: 5.0}, tran={B: 2.0}, op_time={"training.gemm": 4.0})
    cal = Cal()
    ctl = controller(backend, calibration=cal)
    ctl.step(sig(0, op_time={"training.gemm": 6.0}))
    assert cal.seen == [("training.gemm", 4.0, 6.0)]
    assert ctl.step(sig(1, length=2000)).kind == "transition"
    ctl.step(sig(2, length=2000, transition_time=4.0))  # measured twice the prediction
    assert ctl.transition_scale == pytest.approx(1.5)  # EMA with alpha 0.5


def test_restart_without_any_plan_waits_then_restarts():
    small = gen_plan(1, 2)
    backend = FakeBackend([], {A: 10.0})  # not even the surviving replicas fit
    ctl = controller(backend)
    ctl.step(sig(0))
    d = ctl.step(sig(1, gpus=2))  # lost GPUs 2-7, nothing fits: checkpoint and wait
    assert d.kind == "restart" and d.target is None and "wait for GPUs" in d.reason
    assert ctl.step(sig(2, gpus=2)).kind == "wait"
    backend.candidates, backend.latency[small] = [small], 20.0
    d = ctl.step(sig(3, gpus=2))
    assert d.kind == "restart" and d.target == small and ctl.plan == small


def test_restart_when_no_safe_dag_but_the_gain_pays_for_it():
    backend = FakeBackend([A, B], {A: 1000.0, B: 100.0}, tran={B: None})
    ctl = controller(backend, restart_s=300.0)
    ctl.step(sig(0))
    d = ctl.step(sig(1, length=2000))  # 300 s / 900 s per step = 0.33 steps <= 0.5 * H(=1)
    assert d.kind == "restart" and d.target == B and not d.urgent and d.transition_cost == 300.0
    backend = FakeBackend([A, B], {A: 1000.0, B: 800.0}, tran={B: None})
    ctl = controller(backend, restart_s=300.0)
    ctl.step(sig(0))
    assert ctl.step(sig(1, length=2000)).kind == "keep"  # 1.5 steps > 0.5: not worth a restart


def test_revocation_falls_back_to_the_intact_units_before_restarting():
    survivors, other = gen_plan(1, 2), gen_plan(2, 1)
    backend = FakeBackend(
        [other], {A: 10.0, other: 15.0, survivors: 20.0}, tran={other: None, survivors: 0.0}
    )
    ctl = controller(backend)
    ctl.step(sig(0))
    d = ctl.step(sig(1, gpus=2))  # GPUs 2-3 lost; the planner's target has no safe DAG
    assert d.kind == "transition" and d.target == survivors and d.urgent
    assert d.transition_cost == 0.0  # only Destroy: the replicas on lost GPUs are dropped


def test_urgent_restart_when_the_reachable_target_is_much_slower():
    relief = gen_plan(1, 4, recompute=True)
    for h_ema, expected in ((1.0, "transition"), (40.0, "restart")):
        backend = FakeBackend(
            [B], {A: 10.0, B: 5.0, relief: 40.0}, tran={B: None, relief: 0.0}, feasible={A: False}
        )
        ctl = controller(backend, restart_s=300.0)
        ctl.memory_clock.ema, ctl.memory_clock.last_crossing = h_ema, -int(h_ema)  # H stays h_ema at step 0
        # memory: B (5 s/step) has no safe DAG, the recompute variant (40 s/step) has one
        d = ctl.step(sig(0))
        assert d.urgent and d.kind == expected, (h_ema, d.reason)
        # restart: 300 s / 35 s per step = 8.6 steps <= 0.5 * H only when H is large
        assert d.target == (B if expected == "restart" else relief)


def test_a_due_recheck_keeps_its_horizon_beside_a_crossing():
    assert smallest_horizon([Trigger("pool", 3.0), Trigger("drift:response_len", 2.0)]) == 2.0
    # The refused gain has paid for the move already: a drift crossing at the same step does not
    # shrink the recheck's horizon, and a longer crossing horizon is kept.
    assert smallest_horizon([Trigger("drift:response_len", 2.0), Trigger("recheck", 6.0)]) == 6.0
    assert smallest_horizon([Trigger("recheck", 1.0), Trigger("pool", 3.0)]) == 3.0


def _per_token(s_per_k: float, base: float = 0.0):  # noqa: ANN202
    """A latency linear in the mean response length: ``base`` + ``s_per_k`` s per 1,000 tokens."""
    return lambda w: base + s_per_k * w.response_len / 1000


@pytest.mark.parametrize(
    ("lengths", "l_tran", "kind"),
    [
        ((1000, 1100, 1200, 1350), 0.7, "transition"),  # 2.00 steps now, 1.27 over the rise
        ((1000, 1100, 1200, 1350), 1.0, "keep"),  # 2.86 now, 1.82 over the rise > 1.5
        ((1000, 1000, 1000, 1350), 0.7, "keep"),  # a level shift: no trend, the gain now
    ],
)
def test_payback_values_the_gain_over_the_forecast_lengths_of_the_horizon(lengths, l_tran, kind):
    # B scales better with the length: 0.35 s/step faster at 1,350 tokens, 0.55 at the mean of
    # the rise forecast over H = 3 steps (1,550 tokens: +100 per step); gamma * H = 1.5 steps.
    backend = FakeBackend([A, B], {A: _per_token(10.0), B: _per_token(9.0, 1.0)}, tran={B: l_tran})
    ctl = controller(backend, drift_signals=("response_len",))
    for step, length in enumerate(lengths):
        d = ctl.step(sig(step, length=length))
    assert d.horizon == 3.0 and d.kind == kind
    (entry,) = d.considered
    assert entry["dL"] == pytest.approx(0.35)
    if lengths[1] > lengths[0]:
        assert entry["dL_horizon"] == pytest.approx(0.55)
    else:
        assert "dL_horizon" not in entry


@pytest.mark.parametrize(("l_tran", "kind"), [(0.3, "transition"), (0.5, "keep")])
def test_a_quiet_check_finds_a_plan_that_became_faster_under_the_thresholds(l_tran, kind):
    # +20% length (under delta_len = 30%): B becomes 0.2 s/step faster and no trigger fires. The
    # quiet check at step 4 admits it iff it pays back within gamma * 4 = 2 steps (1.5 vs 2.5).
    backend = FakeBackend([A, B], {A: _per_token(10.0), B: _per_token(9.0, 1.0)}, tran={B: l_tran})
    ctl = controller(backend, quiet_check_every=4)
    for step, length in enumerate((1000, 1000, 1200, 1200)):
        assert ctl.step(sig(step, length=length)).kind == "none"
    d = ctl.step(sig(4, length=1200))
    assert [t.kind for t in d.triggers] == ["quiet"] and d.horizon == 4.0 and d.kind == kind
    assert ctl.drift["response_len"].reference == 1000  # no crossing: the references stay
    assert ctl.step(sig(5, length=1200)).kind == "none"  # the next check is 4 steps on
    off = controller(backend)  # quiet checks off: the gain under the threshold is never looked at
    assert all(
        off.step(sig(s, length=n)).kind == "none" for s, n in enumerate((1000, 1000, 1200, 1200, 1200))
    )
