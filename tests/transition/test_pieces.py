"""The byte formula of pieces, checked against a brute-force model of the state as atoms."""

from __future__ import annotations

import itertools

import pytest

from nereus_lightning.plan.layout import Layout
from nereus_lightning.plan.memory import optimizer_bytes_per_param, stage_params
from nereus_lightning.spec.model import MODEL_PRESETS, ModelSpec
from nereus_lightning.transition.pieces import (
    Piece,
    extend_transfers,
    full_piece,
    gather_transfers,
    geometry,
    piece_bytes,
    shard_bytes,
)

UNEVEN = ModelSpec("uneven", 6, 64, 4, 2, 96, 128, qk_norm=True)  # 6 layers: PP 4 gives 2,2,1,1
MODELS = [MODEL_PRESETS["tiny_llama"], MODEL_PRESETS["tiny_gqa"], UNEVEN]
LAYOUTS = [Layout(t, p) for t in (1, 2, 4) for p in (1, 2, 4)]
D = 8  # atoms per TP-split tensor (the finest TP degree used here is 4)


def atoms_of_piece(p: Piece) -> set[tuple]:
    """The state as atoms: (what, layer, tp slot) for split tensors, (what, layer) for replicated ones."""
    slots = range(p.tp_lo * D // p.tp_den, p.tp_hi * D // p.tp_den)
    out: set[tuple] = set()
    for layer in range(p.layer_lo, p.layer_hi):
        out.update(("block", layer, k) for k in slots)
        if p.layer_norms:
            out.add(("norms", layer))
    if p.embed:
        out.update(("embed", -1, k) for k in slots)
    if p.lm_head:
        out.update(("lm_head", -1, k) for k in slots)
    if p.final_norm:
        out.add(("final_norm", -1))
    return out


def atom_bytes(model: ModelSpec, trains: bool, atoms: set[tuple]) -> int:
    geo = geometry(model, trains)
    per = {
        "block": geo.layer_split // D,
        "norms": geo.layer_replicated,
        "embed": geo.embedding // D,
        "lm_head": geo.lm_head // D,
        "final_norm": model.hidden,
    }
    return sum(per[a[0]] for a in atoms) * geo.bytes_per_param


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.name)
@pytest.mark.parametrize("trains", [False, True])
def test_shard_bytes_match_plan_memory(model: ModelSpec, trains: bool) -> None:
    bpp = model.dtype_bytes + (optimizer_bytes_per_param(model) if trains else 0)
    geo = geometry(model, trains)
    for pp in (1, 2, 4):
        for r in range(pp):
            assert shard_bytes(geo, Layout(1, pp), r) == stage_params(model, pp, r) * bpp
            # TP splits everything but the norms, which every TP rank holds whole.
            layers = full_piece(model, Layout(1, pp), r, 0)
            norms = (layers.layer_hi - layers.layer_lo) * geo.layer_replicated + (
                model.hidden if r == pp - 1 else 0
            )
            assert 2 * shard_bytes(geo, Layout(2, pp), r) - shard_bytes(geo, Layout(1, pp), r) == norms * bpp


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.name)
def test_gather_receives_exactly_what_is_missing(model: ModelSpec) -> None:
    for have, want in itertools.product(LAYOUTS, LAYOUTS):
        _check_gather(model, have, want)


def _check_gather(model: ModelSpec, have: Layout, want: Layout) -> None:
    """For every GPU of a ``have`` unit and every ``want`` shard: the received pieces come from the
    senders' own shards, are disjoint from each other and from what the GPU holds, and complete it."""
    geo = geometry(model, True)
    gpus = tuple(range(100, 100 + have.size))
    held = {g: atoms_of_piece(full_piece(model, have, i // have.tp, i % have.tp)) for i, g in enumerate(gpus)}
    for dst_index in range(have.size):
        dst = gpus[dst_index]
        for wp, wt in [(0, 0), (want.pp - 1, want.tp - 1)]:
            wanted = atoms_of_piece(full_piece(model, want, wp, wt))
            got = set()
            for t in gather_transfers(geo, have, gpus, dst_index, want, wp, wt):
                assert t.dst_gpu == dst and t.src_gpu != dst
                piece_atoms = atoms_of_piece(t.what)
                assert piece_atoms <= held[t.src_gpu], f"{t.what} not held by {t.src_gpu}"
                assert not piece_atoms & got and not piece_atoms & held[dst]
                assert t.bytes == piece_bytes(geo, t.what) == atom_bytes(model, True, piece_atoms)
                got |= piece_atoms
            assert wanted <= got | held[dst]
            assert got <= wanted


def test_full_shard_bytes_equal_atom_count() -> None:
    for model in MODELS:
        geo = geometry(model, False)
        for layout in LAYOUTS:
            for p in range(layout.pp):
                piece = full_piece(model, layout, p, 0)
                assert shard_bytes(geo, layout, p) == atom_bytes(model, False, atoms_of_piece(piece))


def test_extend_is_rank_aligned() -> None:
    model = MODEL_PRESETS["llama3_8b"]
    geo = geometry(model, False)
    layout = Layout(2, 2)
    ts = extend_transfers(geo, layout, (0, 1, 2, 3), (8, 9, 10, 11))
    assert [(t.src_gpu, t.dst_gpu) for t in ts] == [(0, 8), (1, 9), (2, 10), (3, 11)]
    assert [t.bytes for t in ts] == [shard_bytes(geo, layout, i // 2) for i in range(4)]
    # Two PP stages x two TP ranks hold all weights once, plus the replicated norms once per extra TP rank.
    total = sum(t.bytes for t in ts)
    replicated = (model.num_layers * geo.layer_replicated + model.hidden) * geo.bytes_per_param
    assert total == model.num_params * model.dtype_bytes + replicated
