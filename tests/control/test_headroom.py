"""Headroom for length jumps no forecast announced: the forecast's surprises, their priced risk."""

from __future__ import annotations

import pytest

from nereus_lightning.control import LengthForecast
from nereus_lightning.control.candidates import Shortfall
from nereus_lightning.spec.errors import NereusConfigError
from nereus_lightning.spec.workload import Workload
from tests.control.fakes import FakeBackend, controller, gen_plan, sig

A = gen_plan(1, 4)  # runs out of memory above HOLDS[A] p95 tokens
A_RC = gen_plan(1, 4, recompute=True)  # a little slower, holds four times as much
HOLDS = {A: 3000.0, A_RC: 12000.0}


class Capped(FakeBackend):
    """Each plan fits up to its ``HOLDS`` p95 length."""

    def estimate(self, plan, cluster, workload, calibration, memory=None):
        est = super().estimate(plan, cluster, workload, calibration)
        est.feasible = est.feasible and workload.response_len_p95 <= HOLDS.get(plan, 0.0)
        return est


def test_the_forecast_scores_its_misses():
    f = LengthForecast(window=3, clamp=0.3)
    for step, length in enumerate((1000, 1100, 1200, 1300)):  # a steady rise: forecast, no surprise
        f.observe(sig(step, length=length))
    assert f.surprise() is None and f.scored == 3
    f.observe(sig(4, length=2800))  # forecast 1,400: measured twice that, a rise of 2,800 / 1,300
    rate, ratio = f.surprise()
    assert rate == pytest.approx(1 / 4) and ratio == pytest.approx(2800 / 1300)
    f.observe(sig(4, length=2800))  # a repeated step is not scored twice
    assert f.scored == 4
    g = LengthForecast()
    g.load_state_dict(f.state_dict())
    assert g.surprise() == f.surprise()


def test_the_forecast_keeps_its_smaller_misses():
    f = LengthForecast(window=3, clamp=0.3)
    for step, length in enumerate((1000, 1100, 1200, 1430, 1500)):  # forecast 1,300 for 1,430: 10% short
        f.observe(sig(step, length=length))
    assert f.surprise() is None and f.misses == [pytest.approx(1.1)] and f.scored == 4
    g = LengthForecast()
    g.load_state_dict(f.state_dict())
    assert g.misses == f.misses


def test_the_shortfall_rate_is_the_share_of_steps_that_missed_further_than_a_plan_holds():
    base = Workload("ppo", response_len=1000, response_len_p95=1100)
    short = Shortfall(base, (1.02, 1.05, 1.1, 1.2, 1.25), scored=20)
    assert short.worst.response_len_p95 == pytest.approx(1375)
    # levels (p95): 1,122  1,155  1,210  1,320  1,375
    for holds_p95, rate in ((1200, 3 / 20), (1140, 4 / 20), (1100, 5 / 20), (1300, 2 / 20)):
        asked: list[float] = []

        def holds(w, cap=holds_p95, asked=asked):
            asked.append(w.response_len_p95)
            return w.response_len_p95 <= cap

        assert short.rate(holds) == pytest.approx(rate)
        assert len(asked) <= 3  # a bisection, not a scan


def test_a_shortfall_refuses_misses_it_cannot_price():
    base = Workload("ppo", response_len=1000, response_len_p95=1100)
    with pytest.raises(NereusConfigError, match="shortfall.ratios"):
        Shortfall(base, (1.2, 1.1), scored=5)
    with pytest.raises(NereusConfigError, match="shortfall.scored"):
        Shortfall(base, (1.1, 1.2), scored=1)


def shortfall_run(relief_latency: float) -> list:
    """A rise that outran its forecast by 10% once (step 3), then steady: the decisions."""
    backend = Capped([A], {A: 10.0, A_RC: relief_latency}, tran={A_RC: 0.5})
    ctl = controller(backend, plan=A)
    lengths = (1000, 1100, 1200, 1430, 1660, 1890, 2120, 2350)
    return [ctl.step(sig(step, length=n)) for step, n in enumerate(lengths)]


def test_a_plan_that_would_not_hold_a_forecast_miss_like_an_earlier_one_moves_to_headroom():
    # At 2,350 tokens the trend says 2,838 p95 next, inside A's 3,000; 10% more, as one step in
    # 7 came in, is past it: A's risk is 1/7 of its 10 s step, A with recomputation holds it for
    # 0.5 s/step more. (The rise went on to 2,750 tokens: A would have run out.)
    decisions = shortfall_run(relief_latency=10.5)
    assert all(d.kind in ("none", "keep") for d in decisions[:-1])
    d = decisions[-1]
    assert d.kind == "transition" and d.target == A_RC and not d.urgent
    assert "headroom" in [t.kind for t in d.triggers]
    assert "forecast miss" in d.reason


def test_headroom_for_a_forecast_miss_is_bought_only_where_it_costs_less_than_the_risk():
    decisions = shortfall_run(relief_latency=12.0)  # 2 s/step more than A: above A's 1/7 x 10 s
    assert all(d.target != A_RC for d in decisions)
    assert "headroom" in [t.kind for t in decisions[-1].triggers]


def run(relief_latency: float) -> list:
    """Flat lengths, a jump to twice the length at step 4, flat again: the decisions."""
    backend = Capped([A], {A: 10.0, A_RC: relief_latency}, tran={A_RC: 0.5})
    ctl = controller(backend)
    lengths = (1000, 1000, 1000, 1000, 2000, 2000, 2000)
    return [ctl.step(sig(step, length=n)) for step, n in enumerate(lengths)]


def test_a_plan_that_would_not_hold_a_jump_like_the_one_seen_moves_to_headroom():
    # After the jump (1 in 4 steps, x2), A fits the next step (2,200 p95, forecast 2,860) but not
    # another x2 (4,400): its risk is 1/4 of its 10 s step; A with recomputation holds it for
    # 0.5 s/step more.
    decisions = run(relief_latency=10.5)
    assert [d.kind for d in decisions[:4]] == ["none"] * 4
    d = decisions[4]
    assert d.kind == "transition" and d.target == A_RC
    assert "headroom" in [t.kind for t in d.triggers] and not d.urgent
    assert "risk of running out of memory at a length jump" in d.reason
    assert all(x.kind == "none" for x in decisions[5:])  # A_RC holds it: no further trigger


def test_headroom_is_bought_only_where_it_costs_less_than_the_risk():
    # The relief removes a risk of 2.5 s/step: bought at 2 s/step more, not at 3.
    assert run(relief_latency=12.0)[4].target == A_RC
    decisions = run(relief_latency=13.0)
    assert decisions[4].kind == "keep" and "headroom" in [t.kind for t in decisions[4].triggers]
    assert all(x.kind == "none" for x in decisions[5:])  # refused for this plan: not asked again


def test_a_faster_target_that_would_not_hold_a_jump_is_tried_relieved():
    # The current plan holds a jump already (A relieved at the jump, step 4). At step 6 the planner's
    # best B is faster (9.5 s) but would not hold another x2 jump: with its risk it is no faster
    # than the current plan, yet B with recomputation (9.8 s) holds it and is.
    b, b_rc = gen_plan(2, 4), gen_plan(2, 4, recompute=True)
    holds = {**HOLDS, b: 3000.0, b_rc: 12000.0}

    class Held(FakeBackend):
        def estimate(self, plan, cluster, workload, calibration, memory=None):
            est = super().estimate(plan, cluster, workload, calibration)
            est.feasible = est.feasible and workload.response_len_p95 <= holds.get(plan, 0.0)
            return est

    def offered(cluster, workload):  # B is the planner's plan once the lengths pass 2,500
        return [b] if workload.response_len > 2500 else [A]

    latency = {A: 10.0, A_RC: 10.5, b: 9.5, b_rc: 9.8}
    ctl = controller(Held(offered, latency, tran={A_RC: 0.5, b: 0.5, b_rc: 0.5}))
    decisions = [ctl.step(sig(s, length=n)) for s, n in enumerate((1000, 1000, 1000, 1000, 2000, 2000, 2700))]
    assert decisions[4].target == A_RC
    d = decisions[6]
    assert d.kind == "transition" and d.target == b_rc, d.reason
    risky = next(c for c in d.considered if c["source"] == "planner best, relieved")
    assert risky["latency"] == 9.8
