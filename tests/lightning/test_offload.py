"""Idle generation and inference units live in host memory between their uses; training state stays.

On the CPU host and device are one memory, so the tests move storage themselves
(``helpers.storage_moves``: every offload and onload puts a unit's tensors in fresh storage and
fills the old storage with NaN) and check that training gives the same parameters as without moves.
"""

from __future__ import annotations

import math

import pytest
import torch

from nereus_lightning.spec import Workload
from tests.lightning.helpers import EMU_P1, EMU_P2, offload_run

TRANSITION = [EMU_P1, EMU_P2]  # model-stages on disjoint ranks; the change runs a transition DAG
COLOCATED = [{}, {}]  # every model-stage dp4 on ranks 0-3: they share every GPU, one after another
TRAINS = {"actor_train", "critic_train"}

_RUNS: dict[tuple[str, bool], list] = {}


def _run(pool, tmp_path_factory, name: str, moving: bool) -> list:
    if (name, moving) not in _RUNS:
        folder = str(tmp_path_factory.mktemp(f"{name}-{moving}"))
        placements = {"transition": TRANSITION, "colocated": COLOCATED}[name]
        _RUNS[(name, moving)] = pool.run(offload_run, placements, folder, moving)
    return _RUNS[(name, moving)]


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["transition", "colocated"])
def test_moving_idle_units_keeps_training_results(dist4, tmp_path_factory, name):
    moved = _run(dist4, tmp_path_factory, name, True)[0]
    still = _run(dist4, tmp_path_factory, name, False)[0]
    assert all(math.isfinite(s) for s in moved["scores"]), moved["scores"]
    assert moved["scores"] == pytest.approx(still["scores"], abs=1e-6)
    assert moved["params"].keys() == still["params"].keys()
    assert {k.split(".", 1)[0] for k in moved["params"]} >= {"actor_gen", "actor_train", "ref_infer"}
    for key, value in still["params"].items():
        assert torch.allclose(moved["params"][key], value, atol=1e-6, rtol=0), key
    # The generation unit holds the trained weights (a weight sync or, following, a refill).
    for key, value in moved["params"].items():
        if key.startswith("actor_gen."):
            assert torch.equal(value, moved["params"]["actor_train." + key.split(".", 1)[1]]), key


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["transition", "colocated"])
def test_a_weight_sync_within_every_rank_is_a_refill_at_the_next_use(dist4, tmp_path_factory, name):
    """A unit whose every rank holds the training shards it needs follows its training stage (refilled on
    the device at each use, nothing written to the host at the sync): colocated, all three; under EMU_P2
    actor_infer (ranks 0-1, where actor_train is whole) and critic_infer (rank 3, in critic_train's), not
    actor_gen (TP4 over ranks 0-3; ranks 2-3 hold no actor_train): its sync copies across ranks."""
    follow = {"actor_infer": "actor_train", "critic_infer": "critic_train"}
    if name == "colocated":
        follow["actor_gen"] = "actor_train"
    runs = _run(dist4, tmp_path_factory, name, True)
    assert all(out["following"] == follow for out in runs)
    # each rank's units of them wait on the host without their values
    assert all(set(out["stale"].values()) <= {True} for out in runs)
    assert set().union(*(out["stale"] for out in runs)) == set(follow)


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["transition", "colocated"])
def test_after_a_step_only_training_units_are_on_their_device(dist4, tmp_path_factory, name):
    for rank, out in enumerate(_run(dist4, tmp_path_factory, name, True)):
        for residency in [*out["residency"], out["after_save"]]:
            assert residency, f"rank {rank} holds no unit"
            assert residency == {stage: stage in TRAINS for stage in residency}, (rank, residency)


def test_peak_memory_is_absent_not_zero_without_a_gpu():
    from nereus_lightning.lightning.callback import _signals
    from nereus_lightning.lightning.module import StagePeaks

    peaks = StagePeaks(torch.device("cpu"))
    for stage in ("gen", "infer", "train"):
        peaks.mark(stage)
    assert peaks.stages == {} and peaks.metrics() == {}
    # The controller's memory trigger then sees no measurement at all (rather than 0 bytes).
    workload = Workload("ppo", 2, response_len=8.0)
    assert _signals(1, peaks.metrics(), (0, 1), expected=workload).peak_memory == {}
    assert _signals(1, {"perf/max_memory_allocated_gb": 0.5}, (0,), expected=workload).peak_memory == {
        0: 2.0**29
    }
