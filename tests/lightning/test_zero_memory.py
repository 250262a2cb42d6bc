"""What a shard rank holds after a sharded update through the strategy, and in its training pass, is what
``plan.memory`` prices.

Four gloo ranks, one PPO update with both training stages at (1 replica, shard 2, TP2) and ZeRO-1/2/3,
against ZeRO-0 (DP2 x TP2) on the same ranks: the bytes of AdamW state each rank holds (and of
parameters at ZeRO-3) are half the unsharded rank's, up to the rows of the last block, the two shard
ranks' together exactly the unsharded rank's; no gradient stays after the step; and the ratio to
ZeRO-0 is the planner's (:func:`~nereus_lightning.plan.memory.resident_rank_bytes`), as are the bytes;
after the backward it holds the bytes of the planner's training state and gathered terms.
"""

from __future__ import annotations

import pytest

from nereus_lightning.plan.layout import Candidate, Layout
from tests.lightning.helpers import one_update

pytestmark = pytest.mark.distributed

GPUS = (0, 1, 2, 3)
STAGE = "actor_train"


def _bytes(tensors) -> int:  # noqa: ANN001
    """Bytes of the distinct storages behind ``tensors`` (a view of a held tensor adds nothing)."""
    seen: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    seen.pop(0, None)  # released (empty) storages
    return sum(seen.values())


def _sizes(units, strategy=None) -> dict:  # noqa: ANN001
    """The actor training stage's bytes on this rank, by kind: AdamW state, parameters, gradients."""
    from nereus_lightning import emu
    from nereus_lightning.models.zero import ZeroShards

    unit, module = emu.registry().mine(STAGE), units.stage(STAGE)
    optimizer = units.optimizers[STAGE]
    inner = optimizer.optimizer if isinstance(optimizer, ZeroShards) else optimizer
    moments = [t for entry in inner.state.values() for k, t in entry.items() if k != "step"]
    moments += [t for entry in unit.optim_state.values() for k, t in entry.items() if k != "step"]
    params = [*unit.params.values(), *module.parameters()]
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    if isinstance(optimizer, ZeroShards):
        params += list(optimizer.blocks.values())
        grads += [b.grad for b in optimizer.blocks.values() if b.grad is not None]
    return {"optim": _bytes(moments), "params": _bytes(params), "grads": _bytes(grads)}


def _held(rank: int, world_size: int, zero: int) -> dict:
    """One update at ZeRO-``zero``; the actor training stage's bytes this rank holds after it and in its
    pass (after the backward, before the step), by kind, and what the planner prices for both."""
    from nereus_lightning.lightning.emu_state import EMUStates
    from nereus_lightning.plan.memory import resident_rank_bytes, training_state_terms
    from nereus_lightning.spec.model import ModelSpec

    train: object = ((2, 1), GPUS) if zero == 0 else Candidate(Layout(2, 1, shard=2, zero=zero), 1, GPUS)
    placement = {"actor_train": train, "critic_train": train}
    held: dict = {}

    def measure(strategy) -> None:  # noqa: ANN001
        held.update(_sizes(strategy.units))
        spec, layout = ModelSpec.from_hf_config(strategy.stage(STAGE).config), strategy.plan[STAGE].layout
        held["priced"] = resident_rank_bytes(spec, layout, 0)
        state, gathered, _ = training_state_terms(spec, layout, 0)
        held["priced_pass"] = state + gathered

    update = EMUStates.update

    def measured(units, model_stage, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        if model_stage == STAGE and "pass" not in held:  # the first mini-batch's gradients are all there
            held["pass"] = _sizes(units)
        return update(units, model_stage, *args, **kwargs)

    EMUStates.update = measured  # this worker process only, for this run
    try:
        one_update(rank, world_size, placement, after=measure)
    finally:
        EMUStates.update = update
    return held


_RUNS: dict[int, list] = {}


def _run(pool, zero: int) -> list:  # noqa: ANN001
    if zero not in _RUNS:
        _RUNS[zero] = pool.run(_held, zero)
    return _RUNS[zero]


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_a_shard_rank_holds_its_rows_as_the_planner_prices(dist4, zero: int) -> None:
    ref, got = _run(dist4, 0), _run(dist4, zero)
    kinds = ["optim"] + (["params"] if zero == 3 else [])
    for rank in range(4):
        peer = (rank + 2) % 4  # the other shard rank at this (pp, tp) position
        assert got[rank]["grads"] == 0 and ref[rank]["grads"] == 0
        if zero < 3:
            assert got[rank]["params"] == ref[rank]["params"], (rank, zero)
        for kind in kinds:
            whole, mine = ref[rank][kind], got[rank][kind]
            assert whole > 0
            assert mine + got[peer][kind] == whole, (rank, zero, kind)  # the rows, each held once
            assert abs(mine - whole / 2) <= 0.02 * whole, (rank, zero, kind, mine, whole)
        held = sum(got[rank][k] for k in ("optim", "params"))
        held_zero0 = sum(ref[rank][k] for k in ("optim", "params"))
        priced = got[rank]["priced"] / ref[rank]["priced"]
        assert held / held_zero0 == pytest.approx(priced, rel=0.02), (rank, zero, held, held_zero0)
        # (the planner's ModelSpec leaves out the tiny model's attention biases: 0.3% of its parameters)
        assert held == pytest.approx(got[rank]["priced"], rel=0.01), (rank, zero, held, got[rank]["priced"])


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_a_shard_ranks_training_pass_holds_what_the_planner_prices(dist4, zero: int) -> None:
    """After the backward: the whole gradients (reduce-scattered at the step), at ZeRO-3 the gathered
    parameters beside their rows, the AdamW rows: plan.memory's state and gathered terms."""
    for rank, out in enumerate(_run(dist4, zero)):
        held = sum(out["pass"].values())
        assert out["pass"]["grads"] > 0, (rank, zero)
        assert held == pytest.approx(out["priced_pass"], rel=0.01), (
            rank,
            zero,
            out["pass"],
            out["priced_pass"],
        )
