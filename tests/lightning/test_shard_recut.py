"""A training stage's shard degree changed through the strategy re-cuts its row blocks in place: shard 2 ->
4 (a Split node per replica) then 4 -> 2 (a Merge) leaves the logical state bit-identical, each node's
priced bytes are what its ranks received (plus the unpriced AdamW steps and counters of a rank new to the
unit), and the job trains on."""

from __future__ import annotations

import pytest
import torch

from nereus_lightning.plan.layout import Candidate, Layout
from nereus_lightning.plan.rows import grown_order

pytestmark = pytest.mark.distributed

TRAIN = ("actor_train", "critic_train")
TWO = (0, 2)
FOUR = grown_order(TWO, (1, 3))  # (0, 1, 2, 3): the shard order the ZeRO collectives gather in


def _placement(layout: Layout, gpus: tuple[int, ...]) -> dict:
    return dict.fromkeys(TRAIN, Candidate(layout, 1, gpus))


def _state(strategy) -> dict:  # noqa: ANN001
    """Every training stage's logical state on rank 0 (params, AdamW state, counters)."""
    out = {}
    for stage in TRAIN:
        state = strategy.units.logical_state(stage)
        if state is not None:
            out[stage] = state
    return out


def _recut_through(rank: int, world_size: int, zero: int) -> dict:
    """One RL step at shard 2, the re-cut to shard 4 and back to shard 2, one more step: the logical state
    around each re-cut, each re-cut node's priced and received bytes, and the units then."""
    from nereus_lightning import emu
    from nereus_lightning.lightning import PPOModule
    from tests.lightning.helpers import plan_of, small_task, strategy_at

    torch.manual_seed(0)
    module = PPOModule(task=small_task(), prompts_per_step=8, seed=3)
    opt = module.configure_optimizers()
    two, four = Layout(1, 1, shard=2, zero=zero), Layout(1, 1, shard=4, zero=zero)
    strategy = strategy_at(module, _placement(two, TWO))
    module.rl_step(0, strategy, opt)
    out: dict = {"states": [_state(strategy)], "nodes": [], "units": [], "modes": []}
    for layout, gpus in ((four, FOUR), (two, TWO)):
        strategy.transition(plan_of("ppo", _placement(layout, gpus)))
        out["modes"].append(strategy.units.last_transition.get("mode"))
        records = strategy.units.last_report.records
        out["nodes"].append(
            [
                (r.op, r.model_stage, r.predicted_bytes, r.measured_bytes)
                for r in records
                if r.model_stage in TRAIN
            ]
        )
        unit = emu.registry().mine("actor_train")
        out["units"].append(None if unit is None else (str(unit.unit), sorted(unit.row_keys)))
        out["states"].append(_state(strategy))
    out["metrics"] = module.rl_step(1, strategy, opt)
    out["tensors"] = {stage: len(out["states"][0][stage].params) for stage in out["states"][0]}
    return out


@pytest.mark.parametrize("zero", [1, 3])
def test_a_shard_degree_change_through_the_strategy_recuts_the_rows_exactly_as_priced(
    dist4, zero: int
) -> None:
    per_rank = dist4.run(_recut_through, zero)
    first = per_rank[0]
    assert first["modes"] == ["dag", "dag"]
    start, grown, back = first["states"]
    assert start.keys() == set(TRAIN)
    for stage in TRAIN:
        assert not grown[stage].differences(start[stage]), (zero, stage, "shard 2 -> 4")
        assert not back[stage].differences(start[stage]), (zero, stage, "shard 4 -> 2")
    # one re-cut node per training stage each way (its one replica): a Split up, a Merge down
    for i, op in enumerate(("split", "merge")):
        nodes = first["nodes"][i]
        assert sorted((o, s) for o, s, _, _ in nodes) == [(op, s) for s in TRAIN], nodes
        # Each stage's bytes as priced (the critic's value head as the body holds it); the two ranks new
        # to the unit each also get a 4-byte AdamW step per tensor and 48 B of counters (unpriced, as for
        # an Extend).
        for _, stage, priced, received in nodes:
            unpriced = 2 * (4 * first["tensors"][stage] + 48) if op == "split" else 0
            assert priced > 0 and received == priced + unpriced, (zero, op, stage, priced, received)
    rows = ["exp_avg", "exp_avg_sq"] + (["param"] if zero == 3 else [])
    for rank, out in enumerate(per_rank):
        grown_unit, back_unit = out["units"]
        assert grown_unit is not None and grown_unit[0].startswith(f"Z{zero}x4 TP1xPP1@"), (rank, grown_unit)
        assert grown_unit[1] == rows
        assert (back_unit is None) == (rank not in TWO), (rank, back_unit)
    assert torch.isfinite(torch.tensor(first["metrics"]["actor/pg_loss"]))  # and trains on
