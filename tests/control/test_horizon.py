"""H_x from what the controller knows of the run: the pool's stability, a relaunch, the steps left."""

from __future__ import annotations

import pytest

from nereus_lightning.control import DecisionLog
from nereus_lightning.control.forecast import LengthForecast, horizon_offsets
from tests.control.fakes import FakeBackend, controller, gen_plan, sig

SMALL, BIG = gen_plan(1, 2), gen_plan(1, 4)  # 2 GPUs; the same layout over 4


def _grow_backend() -> FakeBackend:
    # BIG saves 1 s/step and its transition costs 0.97 s: pays back in 0.97 steps.
    return FakeBackend([SMALL, BIG], {SMALL: 10.0, BIG: 9.0}, tran={BIG: 0.97})


def test_resume_on_more_ranks_uses_them_and_the_log_says_why(tmp_path):
    old = controller(_grow_backend(), plan=SMALL, max_steps=20)
    for s in range(2):
        assert old.step(sig(s, gpus=2)).kind == "none"
    path = tmp_path / "decisions.jsonl"
    ctl = controller(_grow_backend(), plan=SMALL, log=DecisionLog(str(path)), max_steps=20)
    ctl.load_state_dict(old.state_dict())
    d = ctl.step(sig(2, gpus=4))  # relaunched on 4 ranks
    assert d.kind == "transition" and d.target == BIG
    assert d.horizon == 18.0  # the steps left: the launch's pool holds for the rest of the run
    assert d.transition_cost == 0.0  # the checkpoint loads straight into BIG: nothing to pay back
    record = path.read_text()
    assert "relaunched on this pool: H = 18 steps left" in record
    assert "L_tran = 0" in record and "pays back in 0.00 steps <= gamma*H_x = 0.5*18.00" in record


def _relaunched(backend: FakeBackend, gpus: int, **cfg) -> tuple:  # noqa: ANN003
    old = controller(backend, plan=SMALL, **cfg)
    old.step(sig(0, gpus=2))
    ctl = controller(backend, plan=SMALL, **cfg)
    ctl.load_state_dict(old.state_dict())
    return ctl, ctl.step(sig(1, gpus=gpus))


def test_a_relaunch_moves_even_where_a_transition_would_not_pay_back():
    # BIG's DAG would cost 50 s (50 steps > gamma * 3 steps left), but a relaunch runs no DAG.
    backend = FakeBackend([SMALL, BIG], {SMALL: 10.0, BIG: 9.0}, tran={BIG: 50.0})
    ctl, d = _relaunched(backend, 4, max_steps=4)
    assert d.kind == "transition" and d.target == BIG and d.horizon == 3.0
    assert ctl.plan == BIG and ctl.step(sig(2, gpus=4)).kind == "none"  # an ordinary step after it
    # Without the relaunch the same growth is kept: the DAG does not pay back in 3 steps.
    ctl = controller(backend, plan=SMALL, max_steps=4)
    ctl.step(sig(0, gpus=2))
    assert ctl.step(sig(1, gpus=4)).kind == "keep"


def test_a_relaunch_keeps_a_plan_that_is_still_the_best_and_gamma_0_moves_nothing():
    backend = FakeBackend([SMALL, BIG], {SMALL: 9.0, BIG: 10.0})
    assert _relaunched(backend, 4, max_steps=10)[1].kind == "keep"  # the pool trigger's replan
    backend = FakeBackend([SMALL, BIG], {SMALL: 10.0, BIG: 9.0})
    assert _relaunched(backend, 4, max_steps=10, gamma=0.0)[1].kind == "keep"


def test_a_pool_seen_for_one_step_keeps_the_paper_horizon():
    # The same growth without a relaunch, one step after the pool was first seen: it held for
    # one step, H = 1, and 0.97 > gamma * 1.
    ctl = controller(_grow_backend(), plan=SMALL)
    ctl.step(sig(0, gpus=2))
    d = ctl.step(sig(1, gpus=4))
    assert d.horizon == 1.0 and d.kind == "keep" and "pays back in 0.97 steps > gamma*H_x" in d.reason


def test_a_pool_stable_for_long_grows_when_it_pays_back():
    ctl = controller(_grow_backend(), plan=SMALL)
    for s in range(6):
        ctl.step(sig(s, gpus=2))
    d = ctl.step(sig(6, gpus=4))
    assert d.horizon == 6.0 and d.kind == "transition"  # the pool held for 6 steps


def test_no_horizon_reaches_past_the_last_step():
    ctl = controller(_grow_backend(), plan=SMALL, max_steps=8)
    for s in range(7):
        ctl.step(sig(s, gpus=2))
    d = ctl.step(sig(7, gpus=4))  # one step left: 0.97 > 0.5 * 1
    assert d.horizon == 1.0 and d.kind == "keep"
    assert any("capped at the 1 steps left" in t.detail for t in d.triggers)


def test_clock_state_round_trips_and_old_state_keeps_the_paper_rule():
    ctl = controller(_grow_backend(), plan=SMALL)
    ctl.step(sig(3, gpus=2))
    state = ctl.state_dict()
    assert state["pool"]["clock"]["origin"] == 3
    del state["pool"]["clock"]["origin"]  # a checkpoint of an older version
    fresh = controller(_grow_backend(), plan=SMALL)
    fresh.load_state_dict(state)
    assert fresh.pool.clock.origin is None and fresh.pool.clock.horizon == 1.0


def test_a_refused_growth_is_taken_once_the_gain_given_up_has_paid_for_it(tmp_path):
    # BIG pays back in 3 steps (3 s for 1 s/step): refused under the pool's first horizon
    # (1 step), rechecked once the pool has held 3 steps (3 s of gain given up), then taken.
    backend = FakeBackend([SMALL, BIG], {SMALL: 10.0, BIG: 9.0}, tran={BIG: 3.0})
    path = tmp_path / "decisions.jsonl"
    ctl = controller(backend, plan=SMALL, log=DecisionLog(str(path)))
    ctl.step(sig(0, gpus=2))
    assert ctl.step(sig(1, gpus=4)).kind == "keep"
    assert [ctl.step(sig(s, gpus=4)).kind for s in (2, 3)] == ["none", "none"]
    d = ctl.step(sig(4, gpus=4))
    assert d.kind == "transition" and d.target == BIG
    assert [t.kind for t in d.triggers] == ["recheck"] and d.horizon == 6.0  # 3 steps / gamma
    assert "a refused gain given up for 3 steps" in path.read_text()
    assert ctl.pool.reference == tuple(range(4)) and ctl.step(sig(5, gpus=4)).kind == "none"


def test_a_recheck_that_still_does_not_pay_waits_longer_and_a_trigger_clears_it():
    backend = FakeBackend([SMALL, BIG], {SMALL: 10.0, BIG: 9.0}, tran={BIG: 3.0})
    ctl = controller(backend, plan=SMALL)
    ctl.step(sig(0, gpus=2))
    ctl.step(sig(1, gpus=4))  # refused: due at step 4
    backend.tran[BIG] = 5.0  # dearer by then: pays back in 5 steps
    assert ctl.step(sig(4, gpus=4)).kind == "keep" and ctl.recheck.due == 6
    assert ctl.step(sig(6, gpus=4)).kind == "transition"
    ctl = controller(backend, plan=SMALL)
    ctl.step(sig(0, gpus=2))
    ctl.step(sig(1, gpus=4))
    backend.latency[SMALL] = 8.0  # the lengths moved: SMALL is now the faster plan
    assert ctl.step(sig(2, length=2000, gpus=4)).kind == "keep" and ctl.recheck.due is None
    state = ctl.state_dict()
    fresh = controller(backend, plan=SMALL)
    fresh.load_state_dict(state)
    assert fresh.recheck.state_dict() == ctl.recheck.state_dict()


def _burst(tran: float):  # noqa: ANN202
    """A controller on BIG whose pool held the whole cluster for 6 steps, lost half of it at step 6
    and got it back at step 7; BIG saves 1 s/step over SMALL and its transition costs ``tran`` s."""
    backend = FakeBackend(
        lambda cluster, workload: [SMALL, BIG] if cluster.num_gpus >= 4 else [SMALL],
        {SMALL: 10.0, BIG: 9.0},
        tran={BIG: tran},
    )
    ctl = controller(backend, plan=BIG)
    ctl.pool.capacity = 4  # a cluster of 4 GPUs
    for s in range(6):
        ctl.step(sig(s, gpus=4))
    assert ctl.step(sig(6, gpus=2)).changes_plan and ctl.plan == SMALL  # the revocation
    return ctl, ctl.step(sig(7, gpus=4))


def test_the_whole_cluster_back_after_a_revocation_burst_is_judged_over_the_supply_stability():
    # The crossing clock's intervals are 6 steps (4 GPUs) and 1 (the burst): its EMA, 3.5 steps,
    # would refuse a move paying back in 2.5 steps (> gamma * 3.5). A whole cluster can only lose
    # GPUs next: one loss in the 7 steps seen, H = 7, and 2.5 <= 0.5 * 7.
    ctl, d = _burst(2.5)
    assert ctl.pool.clock.horizon == 3.5
    assert d.kind == "transition" and d.target == BIG and d.horizon == 7.0
    assert "H = the supply's stability, 7.0 steps per loss" in d.triggers[0].detail


def test_a_pool_short_of_the_cluster_keeps_the_crossing_clock():
    # The same burst on a larger cluster: the pool may still grow, any change is its next crossing.
    backend = FakeBackend(
        lambda cluster, workload: [SMALL, BIG] if cluster.num_gpus >= 4 else [SMALL],
        {SMALL: 10.0, BIG: 9.0},
        tran={BIG: 2.5},
    )
    ctl = controller(backend, plan=BIG)
    assert ctl.pool.capacity == 256  # paper_cluster2: 64 nodes x 4 GPUs
    for s in range(6):
        ctl.step(sig(s, gpus=4))
    ctl.step(sig(6, gpus=2))
    d = ctl.step(sig(7, gpus=4))
    assert d.kind == "keep" and d.horizon == 3.5


def test_a_growth_that_does_not_pay_back_over_the_supply_stability_is_still_refused():
    ctl, d = _burst(4.0)  # pays back in 4 steps > 0.5 * 7
    assert d.kind == "keep" and d.horizon == 7.0 and ctl.plan == SMALL
    assert "pays back in 4.00 steps > gamma*H_x = 0.5*7.00" in d.reason


def test_pool_loss_count_round_trips_and_old_state_counts_none():
    ctl, _ = _burst(2.5)
    state = ctl.state_dict()
    assert state["pool"]["losses"] == 1
    fresh = controller(FakeBackend([SMALL, BIG], {SMALL: 10.0, BIG: 9.0}), plan=SMALL)
    fresh.load_state_dict(state)
    assert fresh.pool.losses == 1
    del state["pool"]["losses"]  # a checkpoint of an older version
    fresh.load_state_dict(state)
    assert fresh.pool.losses == 0


def test_the_horizon_forecast_samples_the_mean_over_the_steps_ahead_and_is_empty_without_trend():
    offsets = horizon_offsets(6.0, 4)
    assert sum(offsets) / len(offsets) == pytest.approx(3.5)  # the mean of steps 1 .. 6
    assert offsets[0] > 0.5 and offsets[-1] < 6.5
    forecast = LengthForecast()
    for step, length in enumerate((1000.0, 1000.0, 1000.0)):
        forecast.observe(sig(step, length=length))
    assert forecast.over_horizon(6.0) == []  # flat: every step runs at the last measurement
    forecast.observe(sig(3, length=1050.0))
    assert forecast.over_horizon(6.0) == []  # a level shift: the slopes disagree, no trend
    forecast.observe(sig(4, length=1100.0))
    means = [lengths["response_len"] for lengths in forecast.over_horizon(6.0)]
    assert sum(means) / len(means) == pytest.approx(1100.0 + 50.0 * 3.5)
