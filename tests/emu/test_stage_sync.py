"""emu.sync: weight sync between model-stages of one model (any layouts), and a whole-state relayout."""

from __future__ import annotations

import torch

from nereus_lightning.emu import Unit, create_unit, gather_logical_state, registry
from nereus_lightning.emu.sync import relayout, sync_params
from nereus_lightning.plan.layout import Layout
from nereus_lightning.spec.errors import NereusConfigError
from tests.emu.workers import tiny

TRAIN, GEN = "actor_train", "actor_gen"


def sync_and_relayout(rank: int, world: int, kind: str) -> dict:
    """actor_train TP2 on (0, 1) (trained: params shifted), actor_gen PP2 x2 on (2, 3) and (1, 0)."""
    registry().clear()
    config, model, optim = tiny(kind)
    create_unit(
        TRAIN, config, model, Layout(2, 1), (0, 1), trains=True, full_optim=optim, colocate_with=[GEN]
    )
    for ranks in ((2, 3), (1, 0)):
        create_unit(GEN, config, model, Layout(1, 2), ranks, colocate_with=[TRAIN])
    mine = next((e for e in registry().units[TRAIN].values() if e is not None), None)
    if mine is not None:
        with torch.no_grad():
            for name, p in mine.params.items():
                p.add_(0.5 + 0.01 * len(name))  # an "update" only actor_train has seen
    gen_before = next((e for e in registry().units[GEN].values() if e is not None), None)
    ids_before = {n: t.data_ptr() for n, t in gen_before.params.items()} if gen_before else {}
    traffic = sync_params(TRAIN, GEN)
    try:  # the other way round would part the training weights from their AdamW state
        sync_params(GEN, TRAIN)
        refused = ""
    except NereusConfigError as exc:
        refused = str(exc)
    same_tensors = (
        all(gen_before.params[n].data_ptr() == p for n, p in ids_before.items()) if gen_before else True
    )
    train = gather_logical_state(TRAIN, dst=0)
    gen = gather_logical_state(GEN, dst=0)
    before = gather_logical_state(TRAIN, dst=0)
    moved, _ = relayout(TRAIN, [Unit(Layout(1, 2), (3, 2)), Unit(Layout(1, 2), (0, 1))])
    after = gather_logical_state(TRAIN, dst=0)
    live = registry().live(TRAIN)
    out = dict(
        received=traffic.payload_received,
        relayout_received=moved.payload_received,
        same_tensors=same_tensors,
        refused=refused,
        live=[str(u) for u in live],
    )
    if rank == 0:
        out["sync_diff"] = [n for n in train.params if not torch.equal(train.params[n], gen.params[n])]
        out["names_equal"] = set(train.params) == set(gen.params)
        out["relayout_diff"] = before.differences(after)
        out["replicas"] = after.replicas
    return out


def test_sync_params_copies_the_training_weights_into_another_layout(dist4):
    for kind in ("llama", "gqa_tied"):
        per_rank = dist4.run(sync_and_relayout, kind)
        first = per_rank[0]
        assert first["names_equal"] and first["sync_diff"] == [], (kind, first["sync_diff"][:3])
        assert all(out["same_tensors"] for out in per_rank)  # modules built on actor_gen stay valid
        assert all("target_stage: 'actor_train' trains" in out["refused"] for out in per_rank)
        assert per_rank[2]["received"] > 0 and per_rank[3]["received"] > 0  # not a local copy
        assert first["relayout_diff"] == [] and first["replicas"] == 2, (kind, first["relayout_diff"][:3])
        assert sum(out["relayout_received"] for out in per_rank) > 0
        assert all(out["live"] == first["live"] and len(out["live"]) == 2 for out in per_rank)
