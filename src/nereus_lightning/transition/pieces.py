"""What one GPU holds of a model-stage's logical state, and the exact bytes of every transfer.

The logical state of a model-stage is its parameters (inference) or its parameters plus fp32
master weights and AdamW moments (training; ``plan.memory.optimizer_bytes_per_param``).
Gradients are not state: they are empty at a safe boundary. Under ``Layout(tp, pp)`` the GPU at
position ``(pp_rank, tp_rank)`` holds

* the blocks ``layer_range(num_layers, pp, pp_rank)`` (earlier stages take the remainder,
  as ``plan.compute.stage_layers`` and ``models.sharding.layer_range``),
* the input embedding on stage 0, the final norm and the LM head on the last stage (a tied LM
  head is a copy of the embedding and lives on the last stage too when ``pp > 1``; a value
  model's ``score`` head replaces the LM head, ``ModelSpec.num_labels``),
* of every TP-split tensor the contiguous fraction ``[tp_rank / tp, (tp_rank + 1) / tp)``,
  and every TP-replicated tensor (the two block norms, Qwen3's q/k norms, the final norm, a value
  head) whole.

A :class:`Piece` names a part of that state; :func:`piece_bytes` is THE byte formula, used both
to price a transition and (by the executor) to check what it sent::

    bytes = bpp * ( (layer_hi - layer_lo) * (split(layer) * f + (replicated(layer) if layer_norms))
                    + embed * split(embedding) * f + lm_head * split(lm_head) * f
                    + final_norm * (hidden + value_head) )

with ``f = (tp_hi - tp_lo) / tp_den`` (integer division of the product, exact whenever TP divides
the tensor, which ``ModelSpec.validate_tp`` and ``models.sharding.tp_slices`` require),
``replicated(layer) = 2 * hidden (+ 2 * head_dim with q/k norms)``,
``value_head = ModelSpec.value_head_params`` (travelling with the final norm, as the body sends it),
``split(layer) = layer_params - replicated(layer)`` and
``bpp = dtype_bytes (+ optimizer_bytes_per_param(model) when the model-stage trains)``.
"""

from __future__ import annotations

from functools import lru_cache
from math import gcd
from typing import NamedTuple

from nereus_lightning.plan.layout import Layout
from nereus_lightning.plan.memory import optimizer_bytes_per_param
from nereus_lightning.plan.rows import first_sources, row_moves, unit_rows
from nereus_lightning.spec.errors import require
from nereus_lightning.spec.model import ModelSpec


class Piece(NamedTuple):
    """A part of one model-stage's state: blocks, top-level tensors and a TP fraction.

    ``embed`` means the embedding matrix (on a tied model's last stage: its LM-head copy);
    ``lm_head`` the untied LM-head weight (a value model has none); ``final_norm`` the last stage's
    TP-replicated tensors (the final norm, a value model's head) and ``layer_norms`` those of the listed
    blocks. TP-split tensors are included for the fraction ``[tp_lo / tp_den, tp_hi / tp_den)`` of their
    split dimension.
    """

    layer_lo: int
    layer_hi: int
    embed: bool
    lm_head: bool
    final_norm: bool
    layer_norms: bool
    tp_lo: int
    tp_hi: int
    tp_den: int

    def __str__(self) -> str:
        parts = []
        if self.layer_hi > self.layer_lo:
            parts.append(
                f"layers {self.layer_lo}-{self.layer_hi - 1}{'' if self.layer_norms else ' (no norms)'}"
            )
        if self.embed:
            parts.append("embed")
        if self.lm_head:
            parts.append("lm_head")
        if self.final_norm:
            parts.append("final_norm")
        return f"{'+'.join(parts)} tp[{self.tp_lo}:{self.tp_hi}]/{self.tp_den}"


class Transfer(NamedTuple):
    """One point-to-point copy of ``bytes`` bytes of ``what`` from ``src_gpu`` to ``dst_gpu``."""

    src_gpu: int
    dst_gpu: int
    bytes: int
    what: Piece


class Geometry(NamedTuple):
    """Per-parameter sizes of one model-stage's state (see the module docstring)."""

    model: ModelSpec
    bytes_per_param: int
    layer_split: int
    layer_replicated: int
    embedding: int
    lm_head: int
    value_head: int


@lru_cache(maxsize=256)
def geometry(model: ModelSpec, trains: bool) -> Geometry:
    """The state geometry of ``model`` for an inference (``trains=False``) or training model-stage."""
    replicated = 2 * model.hidden + (2 * model.head_dim if model.qk_norm else 0)
    bpp = model.dtype_bytes + (optimizer_bytes_per_param(model) if trains else 0)
    split = model.layer_params - replicated
    heads = (model.lm_head_params, model.value_head_params)
    return Geometry(model, bpp, split, replicated, model.embedding_params, *heads)


def piece_bytes(geo: Geometry, p: Piece) -> int:
    """Bytes of piece ``p`` (the formula in the module docstring)."""
    num, den = p.tp_hi - p.tp_lo, p.tp_den
    params = (p.layer_hi - p.layer_lo) * (
        geo.layer_split * num // den + (geo.layer_replicated if p.layer_norms else 0)
    )
    if p.embed:
        params += geo.embedding * num // den
    if p.lm_head:
        params += geo.lm_head * num // den
    if p.final_norm:
        params += geo.model.hidden + geo.value_head
    return params * geo.bytes_per_param


class StageContent(NamedTuple):
    """The blocks and top-level tensors of one pipeline stage."""

    lo: int
    hi: int
    embed: bool
    lm_head: bool
    final_norm: bool


@lru_cache(maxsize=4096)
def stage_content(num_layers: int, tied: bool, pp: int, pp_rank: int) -> StageContent:
    """What pipeline stage ``pp_rank`` of ``pp`` holds of a ``num_layers``-block model (``tied``:
    its LM head is the embedding; see the module docstring)."""
    base, extra = divmod(num_layers, pp)
    lo = pp_rank * base + min(pp_rank, extra)
    hi = lo + base + (1 if pp_rank < extra else 0)
    last = pp_rank == pp - 1
    embed = pp_rank == 0 or (tied and last)
    return StageContent(lo, hi, embed, last and not tied, last)


@lru_cache(maxsize=4096)
def shard_bytes(geo: Geometry, layout: Layout, pp_rank: int) -> int:
    """Bytes held by one GPU of pipeline stage ``pp_rank`` under ``layout``."""
    c = stage_content(geo.model.num_layers, geo.model.tie_embeddings, layout.pp, pp_rank)
    return piece_bytes(geo, Piece(c.lo, c.hi, c.embed, c.lm_head, c.final_norm, True, 0, 1, layout.tp))


def full_piece(model: ModelSpec, layout: Layout, pp_rank: int, tp_rank: int) -> Piece:
    """The whole shard at position ``(pp_rank, tp_rank)`` of ``layout``."""
    c = stage_content(model.num_layers, model.tie_embeddings, layout.pp, pp_rank)
    return Piece(c.lo, c.hi, c.embed, c.lm_head, c.final_norm, True, tp_rank, tp_rank + 1, layout.tp)


@lru_cache(maxsize=1024)
def _extend_pattern(geo: Geometry, layout: Layout) -> tuple[tuple[int, Piece], ...]:
    """(bytes, piece) of every position of ``layout``."""
    return tuple(
        (
            shard_bytes(geo, layout, i // layout.tp),
            full_piece(geo.model, layout, i // layout.tp, i % layout.tp),
        )
        for i in range(layout.size)
    )


def extend_transfers(
    geo: Geometry, layout: Layout, src: tuple[int, ...], dst: tuple[int, ...]
) -> list[Transfer]:
    """Extend: the GPU at each position of ``dst`` receives the whole shard of that position from ``src``."""
    new = tuple.__new__  # a NamedTuple without its slow Python-level __new__
    return [
        new(Transfer, (s, d, size, piece))
        for s, d, (size, piece) in zip(src, dst, _extend_pattern(geo, layout), strict=True)
    ]


def gather_transfers(
    geo: Geometry,
    have: Layout,
    have_gpus: tuple[int, ...],
    dst_index: int,
    want: Layout,
    want_pp: int,
    want_tp: int,
) -> list[Transfer]:
    """What the GPU ``have_gpus[dst_index]`` lacks to hold shard ``(want_pp, want_tp)`` of ``want``.

    ``have_gpus`` is one full replica under ``have`` (the GPU's own unit, so it already holds
    shard ``dst_index`` of it). Each missing TP-split part comes from the one rank of that unit
    that holds it; the replicated tensors of a block the GPU lacks come from the first rank of
    their stage that sends anything. Used by Split (``want`` smaller) and Merge (``want`` larger).
    """
    dst = have_gpus[dst_index]
    return [
        Transfer(have_gpus[i], dst, size, piece)
        for i, size, piece in gather_pattern(geo, have, dst_index, want, want_pp, want_tp)
    ]


@lru_cache(maxsize=65536)
def gather_pattern(
    geo: Geometry, have: Layout, dst_index: int, want: Layout, want_pp: int, want_tp: int
) -> tuple[tuple[int, int, Piece], ...]:
    """:func:`gather_transfers` by positions: (source index, bytes, piece)."""
    model = geo.model
    return tuple(
        (i, piece_bytes(geo, piece), piece)
        for i, piece in gather_pieces(
            model.num_layers, model.tie_embeddings, have, dst_index, want, want_pp, want_tp
        )
    )


@lru_cache(maxsize=65536)
def gather_pieces(
    num_layers: int, tied: bool, have: Layout, dst_index: int, want: Layout, want_pp: int, want_tp: int
) -> tuple[tuple[int, Piece], ...]:
    """:func:`gather_pattern` without the bytes: (source index, piece), for a model of
    ``num_layers`` blocks (``tied``: LM head tied to the embedding). It depends on nothing else,
    so the body executes these very pieces (``emu.transfer_plan.reshard_plan``)."""
    p0, t0 = divmod(dst_index, have.tp)
    w = stage_content(num_layers, tied, want.pp, want_pp)
    den = have.tp * want.tp // gcd(have.tp, want.tp)
    w_lo, w_hi = want_tp * (den // want.tp), (want_tp + 1) * (den // want.tp)
    step = den // have.tp
    # A tied model may hold the embedding on two stages: take it from one (the resident's if any).
    embed_from = p0 if stage_content(num_layers, tied, have.pp, p0).embed else (0 if w.embed else -1)
    out = []
    for p in range(have.pp):
        h = stage_content(num_layers, tied, have.pp, p)
        lo, hi = max(h.lo, w.lo), min(h.hi, w.hi)
        if hi < lo:
            hi = lo
        embed = w.embed and p == embed_from
        lm_head, norm = h.lm_head and w.lm_head, h.final_norm and w.final_norm
        if hi == lo and not (embed or lm_head or norm):
            continue
        first = True
        for t in range(w_lo // step, -(-w_hi // step)):
            f_lo, f_hi = max(w_lo, t * step), min(w_hi, (t + 1) * step)
            if f_hi <= f_lo:
                continue
            replicated = first and p != p0
            first = False
            if p == p0 and t == t0:
                continue  # resident
            final_norm = norm and replicated
            if hi > lo or embed or lm_head or final_norm:  # else nothing of it is missing here
                piece = Piece(lo, hi, embed, lm_head, final_norm, replicated and hi > lo, f_lo, f_hi, den)
                out.append((p * have.tp + t, piece))
    return tuple(out)


def recut_transfers(
    geo: Geometry, old: Layout, new: Layout, src: tuple[int, ...], dst: tuple[int, ...]
) -> list[Transfer]:
    """A sharded unit on ``src`` (``old``) re-cut to ``new`` on ``dst``: the same model cut, another shard
    degree. At each ``(pp, tp)`` position the row blocks move as :func:`~nereus_lightning.plan.rows.row_moves`
    lists them (what ``emu.recut`` sends), priced on ``lcm(d, d')`` unit rows (exact when that divides
    every tensor's row count) but for a value head, priced on its own ``num_labels`` rows (of ``hidden + 1``
    parameters: weight and bias); at ZeRO-1/2 a GPU new to the unit also receives the position's whole
    parameters from the old GPU whose block holds its first row.
    """
    require(
        (old.tp, old.pp, old.zero) == (new.tp, new.pp, new.zero) and old.shard != new.shard,
        "recut",
        f"{old} -> {new} is not a change of the shard degree alone",
    )
    model, m = geo.model, old.model_size
    rows = unit_rows(old.shard, new.shard)
    param_bytes = model.dtype_bytes
    cut_bpp = geo.bytes_per_param - (0 if old.zero == 3 else param_bytes)
    out = []
    for i in range(m):
        piece = full_piece(model, old, i // old.tp, i % old.tp)
        params = shard_bytes(geo, old, i // old.tp) // geo.bytes_per_param
        head = geo.value_head if piece.final_norm else 0
        row_bytes = {"": (params - head) * cut_bpp, "value_head": (model.hidden + 1) * cut_bpp}
        before, after = src[i::m], dst[i::m]
        for move in row_moves({"": rows} | ({"value_head": model.num_labels} if head else {}), before, after):
            unit = rows if move.key == "" else 1
            out.append(Transfer(move.src, move.dst, row_bytes[move.key] * (move.hi - move.lo) // unit, piece))
        if old.zero < 3:
            out += [
                Transfer(s, g, params * param_bytes, piece) for g, s in first_sources(before, after).items()
            ]
    return out
