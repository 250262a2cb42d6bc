"""Drift families: seeded members with the family's shape, and the controller on one of them."""

from __future__ import annotations

import pytest

from nereus_lightning.sim.drift_families import COMBINATIONS, FAMILIES, FamilyShape, family_trace
from nereus_lightning.sim.experiment import make_setup, run_experiment
from nereus_lightning.spec.errors import NereusConfigError

SHAPE = FamilyShape(steps=40, length=(1000, 4000), gpus=(8, 32), node=4)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_members_are_seeded_and_stay_in_their_frame(family):
    a, b, c = (family_trace(family, SHAPE, seed) for seed in (1, 1, 2))
    assert a == b and a != c
    assert len(a) == SHAPE.steps and all(8 <= g <= 32 and g % 4 == 0 for g in a.num_gpus)
    assert all(p >= m for m, p in zip(a.response_len, a.response_len_p95, strict=True))


def test_family_shapes():
    for seed in range(5):
        cur = family_trace("curriculum", SHAPE, seed).response_len
        assert sum(1 for x, y in zip(cur, cur[1:], strict=False) if y > 1.3 * x) >= 2  # the raises
        grow = family_trace("pool_growth", SHAPE, seed).num_gpus
        assert grow[0] < grow[-1] == 32 and sorted(grow) == list(grow)  # grows once, then keeps it
        rise = family_trace("rise_fall", SHAPE, seed)
        top = max(range(len(rise)), key=rise.response_len.__getitem__)
        assert 0 < top < len(rise) - 1 and min(rise.num_gpus) < 32  # a peak inside; revocations
    with pytest.raises(NereusConfigError, match="family"):
        family_trace("sawtooth", SHAPE)


def test_combinations_cover_models_clusters_and_algorithms():
    assert len(COMBINATIONS) >= 8
    assert len({c.algorithm for c in COMBINATIONS}) == 3 and len({c.cluster for c in COMBINATIONS}) >= 4


@pytest.mark.parametrize("index", [6, 1])  # 1: the added GPUs stayed idle under H = 1
def test_nereus_takes_the_grown_pool_into_use(index):
    combo = COMBINATIONS[index]
    setup = make_setup(combo.model, combo.cluster, {"algorithm": combo.algorithm})
    trace = family_trace("pool_growth", combo.shape, 0)
    comp = run_experiment(setup, trace, ["always", "nereus:0.5"], plot=False)["comparison"]
    grown = trace.num_gpus.index(max(trace.num_gpus))
    last = comp.records["nereus(gamma=0.5)"][-1]
    assert any(r.action == "transition" for r in comp.records["nereus(gamma=0.5)"][grown:])
    nereus = comp.summaries["nereus(gamma=0.5)"]
    assert nereus.infeasible_steps == 0 and nereus.gap_to_oracle < 0.01, last.plan
    assert nereus.mean_step_s <= comp.summaries["always-switch"].mean_step_s * 1.001


def test_after_an_unannounced_length_jump_nereus_keeps_headroom_for_the_next():
    # qwen2_0_5b PPO on l40sx8, curriculum seed 1: the length doubles at steps 8 and 20 without
    # warning. The first doubling may run out of memory for a plan made for the lengths before it
    # (nothing foretold it); after it, Nereus prices a second one and holds it (without the pricing:
    # infeasible steps 8 and 20).
    combo = COMBINATIONS[3]
    setup = make_setup(combo.model, combo.cluster, {"algorithm": combo.algorithm}, seed=1)
    trace = family_trace("curriculum", combo.shape, 1)
    comp = run_experiment(setup, trace, ["static", "nereus:0.5"], plot=False)["comparison"]
    nereus = comp.records["nereus(gamma=0.5)"]
    assert [r.step for r in nereus if not r.feasible] in ([], [8])
    assert comp.summaries["nereus(gamma=0.5)"].gap_to_oracle < 0.01


def test_a_step_that_runs_out_of_memory_is_charged_a_restart():
    # The static plan runs out of memory at the curriculum's doublings; the body does not catch
    # that error, so each such step costs its time and a checkpoint/restart.
    combo = COMBINATIONS[3]
    setup = make_setup(combo.model, combo.cluster, {"algorithm": combo.algorithm}, seed=1, restart_s=250.0)
    trace = family_trace("curriculum", combo.shape, 1)
    records = run_experiment(setup, trace, ["static"], plot=False)["comparison"].records["static"]
    lost = [r.step_s for r in records if not r.feasible]
    ran = [r.step_s for r in records if r.feasible]
    assert lost and ran and max(ran) < 250.0 <= min(lost) < 250.0 + max(ran) * 1.5
