"""One PPO update through the strategy with sharded training stages (1 replica of shard 2 x TP2, ZeRO-1/2/3)
equals the same job at ZeRO-0 (DP2 x TP2) on the same four gloo ranks, and the weight sync after it gives
the inference and generation stages exactly the trained weights."""

from __future__ import annotations

import pytest
import torch

from nereus_lightning.plan.layout import Candidate, Layout
from tests.lightning.helpers import one_update

pytestmark = pytest.mark.distributed

GPUS = (0, 1, 2, 3)


def _placement(zero: int) -> dict:
    """Both training stages at ZeRO-``zero`` (ZeRO-0: DP2 x TP2); every other stage dp4."""
    if zero == 0:
        train: object = ((2, 1), GPUS)
    else:
        train = Candidate(Layout(2, 1, shard=2, zero=zero), 1, GPUS)
    return {"actor_train": train, "critic_train": train}


def _update_and_synced(rank: int, world_size: int, placement: dict) -> dict:
    """:func:`one_update`, and the logical parameters its weight sync left in the non-training stages."""
    from nereus_lightning import emu

    out = one_update(rank, world_size, placement)
    for stage in SYNCED:
        state = emu.gather_logical_state(stage, dst=0)
        out[stage] = None if state is None else state.params
    return out


SYNCED = {"actor_gen": "actor", "actor_infer": "actor", "critic_infer": "critic"}
_RUNS: dict[int, list] = {}


def _run(pool, zero: int) -> list:  # noqa: ANN001
    if zero not in _RUNS:  # the ZeRO-0 run is shared by the three comparisons
        _RUNS[zero] = pool.run(_update_and_synced, _placement(zero))
    return _RUNS[zero]


def _assert_same(ref: dict, got: dict, zero: object) -> None:
    """Both models' logical parameters within 1e-5 (relative norm) and the losses and norms alike
    (``zero`` names the case in a failure)."""
    for model in ("actor", "critic"):
        names = [n for n in ref["params"] if n.startswith(model + ".")]
        assert names and sorted(names) == sorted(n for n in got["params"] if n.startswith(model + "."))
        pa = torch.cat([ref["params"][n].reshape(-1) for n in names])
        pb = torch.cat([got["params"][n].reshape(-1) for n in names])
        rel = float((pa - pb).norm() / pa.norm())
        assert rel < 1e-5, (zero, model, rel)
    for key in ("actor/pg_loss", "critic/vf_loss", "actor/grad_norm", "critic/grad_norm"):
        a, b = ref["metrics"][key], got["metrics"][key]
        assert abs(a - b) <= 1e-5 * max(1.0, abs(a)), (zero, key, a, b)


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_a_sharded_ppo_update_through_the_strategy_is_zero0s(dist4, zero: int) -> None:
    ref, got = _run(dist4, 0)[0], _run(dist4, zero)[0]
    _assert_same(ref, got, zero)
    for stage, model in SYNCED.items():
        assert got[stage], (zero, stage)
        for n, p in got[stage].items():
            assert torch.equal(p, got["params"][f"{model}.{n}"]), (zero, stage, n)


@pytest.mark.parametrize("zero", [2, 3])
def test_sharded_stages_save_and_resume_as_zero0_does(dist4, tmp_path, zero: int) -> None:
    from tests.lightning.helpers import offload_run

    runs = {}
    for z in (0, zero):  # a step at ZeRO-z, a save, a fresh module resumed from it at ZeRO-z, a step
        runs[z] = dist4.run(offload_run, [_placement(z)], str(tmp_path / f"z{z}"), False)[0]
    ref, got = runs[0], runs[zero]
    assert got["scores"] == pytest.approx(ref["scores"], rel=1e-5, abs=1e-6)
    assert ref["params"].keys() == got["params"].keys() and ref["params"]
    for n, p in ref["params"].items():
        rel = float((p - got["params"][n]).norm() / p.norm())
        assert rel < 1e-5, (zero, n, rel)


SHAPES = {  # a ZeRO-0 placement, and the (tp, pp, replicas) of its sharded twin (shard 2) on the same GPUs
    "pp2": (((1, 2), GPUS), (1, 2, 1)),  # shard 2 x PP2 against DP2 x PP2
    "dp2": (GPUS, (1, 1, 2)),  # two replicas of shard 2 against DP4
}


@pytest.mark.parametrize(("shape", "zero"), [("pp2", 3), ("dp2", 1), ("dp2", 3)])
def test_sharded_pipelines_and_sharded_replicas_update_as_zero0(dist4, shape: str, zero: int) -> None:
    plain, (tp, pp, dp) = SHAPES[shape]
    sharded = Candidate(Layout(tp, pp, shard=2, zero=zero), dp, GPUS)
    ref = dist4.run(one_update, {"actor_train": plain, "critic_train": plain})[0]
    got = dist4.run(one_update, {"actor_train": sharded, "critic_train": sharded})[0]
    _assert_same(ref, got, zero)


def _steps_through(rank: int, world_size: int, placements: list, infeasible: bool = False) -> dict:
    """One RL step under each of ``placements`` in turn (the strategy's transition between them), from the
    same seed; each step's metrics, each transition's mode and what the actor's unit then is and holds as
    row blocks. With ``infeasible`` the brain finds no transition (nothing moves)."""
    from nereus_lightning import emu, transition
    from nereus_lightning.lightning import PPOModule
    from nereus_lightning.spec.errors import InfeasiblePlanError
    from tests.lightning.helpers import plan_of, small_task, strategy_at

    def no_order(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise InfeasiblePlanError("test: no safe order")

    torch.manual_seed(0)
    module = PPOModule(task=small_task(), prompts_per_step=8, seed=3)
    opt = module.configure_optimizers()
    strategy = strategy_at(module, placements[0])
    out: dict = {"metrics": [], "modes": [], "units": [], "recompute": []}
    build = transition.build_transition
    for step, placement in enumerate(placements):
        if step:
            transition.build_transition = no_order if infeasible else build
            try:
                strategy.transition(plan_of("ppo", placement))
            finally:
                transition.build_transition = build
            out["modes"].append(strategy.units.last_transition.get("mode"))
            unit = emu.registry().mine("actor_train")
            out["units"].append((str(unit.unit), sorted(unit.row_keys)))
            out["recompute"].append(strategy.units.units["actor_train"].recompute)
        out["metrics"].append(module.rl_step(step, strategy, opt))
    out["params"] = {}
    for role in ("actor", "critic"):
        full = strategy.units.logical_params(f"{role}_train") or {}
        out["params"].update({f"{role}.{n}": p.detach().clone() for n, p in full.items()})
    return out


def _trained(layout: Layout) -> dict:
    train = Candidate(layout, 4 // layout.size, GPUS)
    return {"actor_train": train, "critic_train": train}


CHANGES = {  # shard degree changes mid-run: (from, to)
    "shard2-to-shard4": (Layout(2, 1, shard=2, zero=2), Layout(1, 1, shard=4, zero=2)),
    "unsharded-to-shard2": (Layout(2, 1), Layout(2, 1, shard=2, zero=3)),
    "shard4-to-unsharded": (Layout(1, 1, shard=4, zero=1), Layout(1, 1)),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_shard_degree_change_mid_run_trains_on_as_a_run_started_there(dist4, change: str) -> None:
    start, there = (_trained(layout) for layout in CHANGES[change])
    moved = dist4.run(_steps_through, [start, there])[0]
    ref = dist4.run(_steps_through, [there, there])[0]
    assert moved["modes"] == ["dag"], (change, moved["modes"])
    _assert_same({**ref, "metrics": ref["metrics"][1]}, {**moved, "metrics": moved["metrics"][1]}, change)
    keys = ("actor/pg_loss", "critic/vf_loss", "actor/grad_norm", "critic/grad_norm", "critic/score/mean")
    for step in range(2):
        for key in keys:
            a, b = ref["metrics"][step][key], moved["metrics"][step][key]
            assert abs(a - b) <= 1e-5 * max(1.0, abs(a)), (change, step, key, a, b)


def test_a_sharded_stage_the_brain_cannot_move_stays_and_steps_on(dist4) -> None:
    """The transition gathers the rows and renames the units for the brain; when nothing moves, the units
    are the replica's again, hold their rows, and train on as if no transition had been tried."""
    start, other = _trained(Layout(2, 1, shard=2, zero=3)), _trained(Layout(1, 1, shard=4, zero=3))
    kept = dist4.run(_steps_through, [start, other], True)
    ref = dist4.run(_steps_through, [start, start])[0]
    for rank, out in enumerate(kept):
        assert out["modes"] == ["kept"], (rank, out["modes"])
        ((unit, rows),) = out["units"]
        assert unit.startswith("Z3x2 TP2xPP1@") and rows == ["exp_avg", "exp_avg_sq", "param"], (
            rank,
            unit,
            rows,
        )
    _assert_same({**ref, "metrics": ref["metrics"][1]}, {**kept[0], "metrics": kept[0]["metrics"][1]}, "kept")


def test_a_sharded_stage_that_stays_keeps_its_rows_while_another_moves(dist4) -> None:
    """A transition of the generation stage alone leaves the sharded training stages in their rows (their
    modules and optimizers kept), and the job trains on as if nothing had moved."""
    start = _trained(Layout(2, 1, shard=2, zero=3))
    moved = dist4.run(_steps_through, [start, {**start, "actor_gen": ((2, 1), GPUS)}])
    ref = dist4.run(_steps_through, [start, start])[0]
    for rank, out in enumerate(moved):
        assert out["modes"] == ["dag"], (rank, out["modes"])
        ((unit, rows),) = out["units"]
        assert unit.startswith("Z3x2 TP2xPP1@") and rows == ["exp_avg", "exp_avg_sq", "param"], (rank, unit)
    _assert_same(
        {**ref, "metrics": ref["metrics"][1]}, {**moved[0], "metrics": moved[0]["metrics"][1]}, "gen"
    )


def test_a_sharded_stage_whose_micro_batch_alone_changes_keeps_its_rows(dist4) -> None:
    """A new micro-batch and recompute move no state: the sharded training stages keep their rows, modules
    and optimizers (the module recomputes as the new plan says), and train on as a run started there."""
    layout = Layout(2, 1, shard=2, zero=3)
    start = _trained(layout)
    there = {name: Candidate(layout, 1, GPUS, micro_batch=2, recompute=True) for name in start}
    moved = dist4.run(_steps_through, [start, there])
    ref = dist4.run(_steps_through, [there, there])[0]
    for rank, out in enumerate(moved):
        ((unit, rows),) = out["units"]
        assert unit.startswith("Z3x2 TP2xPP1@") and rows == ["exp_avg", "exp_avg_sq", "param"], (rank, unit)
        assert out["recompute"] == [True], (rank, out["recompute"])
    _assert_same({**ref, "metrics": ref["metrics"][1]}, {**moved[0], "metrics": moved[0]["metrics"][1]}, "mb")
