"""Checkpoint saves of several model-stages at once (``emu.dcp_state.save_states``): two DCP saves in flight
on every rank, each over its own process group; staged host memory bounded and freed as each write ends.
"""

from __future__ import annotations

import gc
import os
import threading
import time
import weakref

import pytest
import torch

from nereus_lightning.emu import EMU, Counters, create_unit, gather_logical_state, registry
from nereus_lightning.plan.layout import Layout
from nereus_lightning.spec.errors import CheckpointError
from tests.emu.workers import COUNTERS, tiny

TRAINING = ("actor_train", "critic_train")


def _in_bf16(config, model, optim):  # noqa: ANN001, ANN202
    """``tiny``'s model in bf16, its fp32 weights as the masters (as a bf16-mixed job holds them)."""
    config.dtype = torch.bfloat16
    for name, p in model.named_parameters():
        optim[name]["master"] = p.detach().clone()
    return config, model.to(torch.bfloat16), optim


def _units(seed: int, places: dict[str, tuple[Layout, tuple[int, ...]]], counters: Counters) -> dict:
    """A fresh registry with ``ref_infer`` (fp32), ``actor_train`` (bf16 weights, fp32 masters) and
    ``critic_train`` (fp32) placed as ``places`` says, their weights and AdamW state from ``seed``; this
    rank's EMU of each (None off the unit).
    """
    registry().clear()
    models = {
        "ref_infer": tiny("llama", seed=seed),
        "actor_train": _in_bf16(*tiny("gqa_tied", seed=seed + 2)),
        "critic_train": tiny("llama", seed=seed + 4),
    }
    mine = {}
    for stage, (config, model, optim) in models.items():
        layout, ranks = places[stage]
        trains = stage in TRAINING
        mine[stage] = create_unit(
            stage,
            config,
            model,
            layout,
            ranks,
            trains=trains,
            full_optim=optim if trains else None,
            counters=counters,
        )
    return mine


def two_training_units_saved_at_once(rank: int, world: int, path: str) -> dict:
    """Save three model-stages, the two training units' DCP saves made to wait for each other on every rank,
    then resume every model-stage under other layouts from other weights.

    Returns the thread and process group each training unit's save ran on (this rank), and on rank 0 what
    differs, per model-stage, between the state saved and the state resumed.
    """
    import torch.distributed as dist

    from nereus_lightning.emu import dcp_state

    _units(0, {
        "ref_infer": (Layout(1, 1), (3,)),
        "actor_train": (Layout(2, 1), (0, 1)),  # DTensor shards
        "critic_train": (Layout(1, 1), (2,)),
    }, COUNTERS)  # fmt: skip
    saved = {stage: gather_logical_state(stage, dst=0) for stage in ("ref_infer", *TRAINING)}
    real, both, ran = dcp_state.save_tensors, threading.Barrier(2, timeout=60), {}

    def save_at_once(state: dict, where: str, process_group=None) -> None:  # noqa: ANN001
        stage = os.path.basename(where)
        if stage in TRAINING:
            ran[stage] = (threading.current_thread().name, process_group)
            both.wait()  # breaks (and the save fails) unless the other training unit's save has begun too
        real(state, where, process_group=process_group)

    dcp_state.save_tensors = save_at_once  # what the writers call
    try:
        # As EMUStates.save orders them: training units last (consecutive saves go to different writers).
        dcp_state.save_states([(s, os.path.join(path, s), True) for s in ("ref_infer", *TRAINING)])
    finally:
        dcp_state.save_tensors = real
    out: dict = {
        "threads": {s: name for s, (name, _) in ran.items()},
        "own_groups": [g is not None and g is not dist.group.WORLD for _, g in ran.values()],
        "same_group": ran["actor_train"][1] is ran["critic_train"][1],
    }
    mine = _units(20, {
        "ref_infer": (Layout(1, 1), (0,)),
        "actor_train": (Layout(1, 2), (2, 3)),  # another layout, ranks and weights
        "critic_train": (Layout(1, 1), (1,)),
    }, Counters())  # fmt: skip
    for stage, emu in mine.items():
        dcp_state.load_state(emu, os.path.join(path, stage))
    resumed = {stage: gather_logical_state(stage, dst=0) for stage in mine}
    if rank == 0:
        out["differences"] = {s: saved[s].differences(resumed[s]) for s in resumed}
    return out


@pytest.mark.distributed
def test_two_training_units_are_written_at_once_on_every_rank_and_resume_bit_for_bit(dist4, tmp_path):
    per_rank = dist4.run(two_training_units_saved_at_once, str(tmp_path))
    for rank, out in enumerate(per_rank):
        # Both saves were in flight together (the barrier held), each on its own thread and process group.
        threads = out["threads"]
        assert set(threads) == set(TRAINING) and threads["actor_train"] != threads["critic_train"], rank
        assert all(out["own_groups"]) and not out["same_group"], rank
    assert per_rank[0]["differences"] == {"ref_infer": [], "actor_train": [], "critic_train": []}
    # The same format as one save at a time: one DCP directory per model-stage, the masters' record.
    assert (tmp_path / "actor_train" / "params_from_masters.json").is_file()
    assert not (tmp_path / "critic_train" / "params_from_masters.json").exists()  # fp32: no masters
    assert all((tmp_path / s / ".metadata").is_file() for s in ("ref_infer", *TRAINING))


# ---- staged host memory ------------------------------------------------------------------------------
STAGES = ("actor_gen", "actor_infer", "ref_infer", "critic_infer", "actor_train")
WITHOUT_WEIGHTS = {"actor_gen", "actor_infer"}  # (counters only, as EMUStates.save saves synced copies)


def staged_memory(rank: int, world: int, path: str, failing: str | None) -> dict:
    """Five colocated units on every rank saved with every state staged in host memory, as GPU units are
    (CPU tensors here), each write slowed down so that staging runs ahead of the writers; with ``failing``,
    that model-stage's save raises on every rank.

    Returns how many staged units were mapped at most at once, how many are mapped when ``save_states``
    returns, the threads that unmapped them, what was written, the error, and whether each model-stage
    loads back bit for bit.
    """
    from nereus_lightning.emu import dcp_state
    from nereus_lightning.emu.host import HostBlock

    registry().clear()
    config, model, optim = tiny("llama")
    for stage in STAGES:
        trains = stage.endswith("_train")
        optim_of = optim if trains else None
        create_unit(stage, config, model, Layout(2, 2), (0, 1, 2, 3), trains=trains, full_optim=optim_of,
                    counters=COUNTERS, colocate_with=STAGES)  # fmt: skip
    lock, mapped, most, unmapped_on = threading.Lock(), [0], [0], []

    def unmapped() -> None:
        with lock:
            mapped[0] -= 1
            unmapped_on.append(threading.current_thread().name)

    def on_host(state: dict) -> tuple:
        """``dcp_state._on_host`` for CPU tensors: every tensor copied into one HostBlock."""
        keys = [k for k, v in state.items() if isinstance(v, torch.Tensor)]
        block = HostBlock([dcp_state._local(state[k]) for k in keys], pin=False)
        staged = dict(state)
        for key, host in zip(keys, block.tensors, strict=True):
            host.copy_(dcp_state._local(state[key]))
            staged[key] = dcp_state._with_local(state[key], host)
        weakref.finalize(block._mapping, unmapped)  # runs where the mapping goes
        with lock:
            mapped[0] += 1
            most[0] = max(most[0], mapped[0])
        return staged, block

    real_on_host, real_save = dcp_state._on_host, dcp_state.save_tensors

    def slow_save(state: dict, where: str, process_group=None) -> None:  # noqa: ANN001
        time.sleep(0.5)
        if os.path.basename(where) == failing:  # as DCP raises a failure: on every rank
            raise CheckpointError(f"{where}: disk full")
        real_save(state, where, process_group=process_group)

    dcp_state._on_host, dcp_state.save_tensors = on_host, slow_save
    out: dict = {"error": None}
    try:
        dcp_state.save_states([(s, os.path.join(path, s), s not in WITHOUT_WEIGHTS) for s in STAGES])
    except CheckpointError as exc:
        out["error"] = str(exc)
        del exc
    finally:
        dcp_state._on_host, dcp_state.save_tensors = real_on_host, real_save
    out["mapped_on_return"] = mapped[0]
    gc.collect()  # a failed save's staged state lives in its traceback until the error is gone
    out.update(most=most[0], mapped=mapped[0], unmapped_on=sorted(set(unmapped_on)))
    out["written"] = [s for s in STAGES if os.path.isfile(os.path.join(path, s, ".metadata"))]
    out["same"] = {}
    for stage in out["written"]:
        unit = next(iter(registry().live(stage)))
        ours = registry().local(stage, unit)
        weights = stage not in WITHOUT_WEIGHTS
        again = EMU.empty(stage, registry().schema(stage), unit, rank, trains=stage.endswith("_train"))
        for _, _, t in again.tensors():
            t.fill_(-7.0)  # so that a shard DCP did not fill cannot pass by chance
        dcp_state.load_state(again, os.path.join(path, stage), weights=weights)
        theirs = {(n, k): t for n, k, t in again.tensors()}
        same = not weights or all(torch.equal(t, theirs[(n, k)]) for n, k, t in ours.tensors())
        out["same"][stage] = same and again.counters == ours.counters
    return out


@pytest.mark.distributed
def test_staged_memory_is_bounded_and_unmapped_by_the_freeing_thread_as_each_write_ends(dist4, tmp_path):
    from nereus_lightning.emu.dcp_state import CONCURRENT_SAVES

    for rank, out in enumerate(dist4.run(staged_memory, str(tmp_path), None)):
        assert out["error"] is None, rank
        # Staging ran ahead of the slowed writers up to the bound: the units being written and the next one.
        assert out["most"] == CONCURRENT_SAVES + 1, (rank, out["most"])
        # Every unit's staged memory was unmapped off the writers' threads, all before save_states returned.
        assert out["mapped_on_return"] == 0 and out["unmapped_on"] == ["nereus-unmap_0"], (rank, out)
        assert out["written"] == list(STAGES) and all(out["same"].values()), (rank, out["same"])


@pytest.mark.distributed
def test_a_save_that_fails_everywhere_stops_its_writer_the_other_finishes_and_all_staged_memory_goes(
    dist4, tmp_path
):
    for rank, out in enumerate(dist4.run(staged_memory, str(tmp_path), "ref_infer")):
        assert out["error"] == f"{tmp_path}/ref_infer: disk full", rank
        # Writer 0 (actor_gen, ref_infer, actor_train) stops at the failure; writer 1 finishes its share.
        assert out["written"] == ["actor_gen", "actor_infer", "critic_infer"], (rank, out["written"])
        assert all(out["same"].values()), rank
        # actor_train was staged (or cancelled) but never written; its memory went too.
        assert out["most"] <= 3 and out["mapped"] == 0, (rank, out)
