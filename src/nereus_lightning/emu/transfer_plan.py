"""Which slice of which tensor goes from which rank to which: the transfer plan of a resharding.

Plain data (no tensors). Every shard is one interval ``[lo, hi)`` along its parameter's TP
dimension (the whole first-dim extent for replicated tensors). A target rank keeps what it
already holds and receives exactly the rest.

* Split and Merge (:func:`reshard_plan`) execute the brain's own plan: the pieces of
  ``transition.tsub.split_pieces`` / ``merge_pieces``, each turned into the tensor slices it
  names (:func:`piece_slices`). The same pieces price the transition (``transition.pieces``),
  so what a DAG node is priced at and what it sends are one list, rank pair by rank pair.
* Copies between arbitrary unit sets (weight sync, re-layout: ``emu.sync``, which the brain does
  not price) use :func:`plan_transfer`: each missing segment from one holder, the least-loaded
  one so far (ties: the nearest rank, then the lowest), which spreads an all-gather evenly.
* A sharded unit's shard degree changes by re-cutting its dim-0 row blocks: ``plan.rows.row_moves``
  (the brain's list, executed by ``emu.transfer.recut_rows``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

from nereus_lightning.emu.schema import StateSchema
from nereus_lightning.plan.layout import Layout
from nereus_lightning.plan.units import Primitive, position_of
from nereus_lightning.spec.errors import require
from nereus_lightning.transition.pieces import Piece
from nereus_lightning.transition.tsub import merge_pieces, split_pieces

if TYPE_CHECKING:
    from nereus_lightning.emu.ops import Merge, Split

Interval = tuple[int, int]
Holdings = dict[int, dict[str, Interval]]  # rank -> name -> interval held


@dataclass(frozen=True)
class Move:
    """Slice ``[lo, hi)`` of parameter ``name`` (and its AdamW slices, master included) sent from ``src`` to
    ``dst``.

    ``with_step``: the receiver held no copy of ``name`` before, so the 0-d AdamW step travels too.
    """

    src: int
    dst: int
    name: str
    lo: int
    hi: int
    with_step: bool


@dataclass(frozen=True)
class TransferPlan:
    """All moves of one resharding, grouped by (src, dst) pair in a fixed order."""

    moves: tuple[Move, ...]

    def pairs(self) -> dict[tuple[int, int], list[Move]]:
        """Moves per (src, dst) pair; one packed buffer each."""
        out: dict[tuple[int, int], list[Move]] = {}
        for move in self.moves:
            out.setdefault((move.src, move.dst), []).append(move)
        return out

    def ranks(self) -> tuple[int, ...]:
        """Every rank that sends or receives something (sorted)."""
        return tuple(sorted({m.src for m in self.moves} | {m.dst for m in self.moves}))

    def payload_bytes(self, schema: StateSchema, trains: bool) -> dict[int, int]:
        """Tensor bytes each rank sends (without buffer alignment padding)."""
        out: dict[int, int] = {}
        for move in self.moves:
            out[move.src] = out.get(move.src, 0) + move_bytes(schema, move, trains)
        return out


def position_holdings(schema: StateSchema, layout: Layout, index: int) -> dict[str, Interval]:
    """What rank index ``index`` of a unit of ``layout`` holds: its stage's parameters, each as its TP
    interval.
    """
    pos = position_of(layout, index)
    return {
        name: schema.interval(name, layout, pos.tp_rank) for name in schema.stage_names(layout, pos.pp_rank)
    }


def unit_holdings(schema: StateSchema, layout: Layout, ranks: Iterable[int]) -> Holdings:
    """What each rank of a unit holds."""
    return {rank: position_holdings(schema, layout, index) for index, rank in enumerate(ranks)}


def merged_holdings(*parts: Holdings) -> Holdings:
    """The union of several units' holdings (units never share a rank)."""
    out: Holdings = {}
    for part in parts:
        for rank, held in part.items():
            require(rank not in out, "units", f"rank {rank} appears in two units")
            out[rank] = held
    return out


def element_count(schema: StateSchema, name: str, lo: int, hi: int) -> int:
    """Elements in slice ``[lo, hi)`` of ``name`` along its TP dim (whole tensor when replicated)."""
    shape = list(schema.shape_of[name])
    dim = schema.placements[name].tp_dim
    if dim is None:
        return _prod(shape)
    shape[dim] = hi - lo
    return _prod(shape)


def move_bytes(schema: StateSchema, move: Move, trains: bool) -> int:
    """Tensor bytes of one move: the parameter slice, and for training units its AdamW slices (+ step).

    Per element that is ``schema.element_bytes``: the parameter's bytes, plus for a training unit
    fp32 ``exp_avg`` and ``exp_avg_sq`` and, below fp32, the fp32 ``master`` (bf16: 2 + 12 = 14,
    fp32: 3 x 4 = 12, as ``plan.memory.optimizer_bytes_per_param`` prices); the 0-d step is 4 bytes.
    """
    n = element_count(schema, move.name, move.lo, move.hi) * schema.element_bytes(move.name, trains)
    return n + (4 if trains and move.with_step else 0)


def _prod(values: Iterable[int]) -> int:
    out = 1
    for v in values:
        out *= v
    return out


@lru_cache(maxsize=256)
def reshard_plan(op: Split | Merge, schema: StateSchema, trains: bool) -> TransferPlan:
    """The moves of a Split or Merge: the brain's pieces of that call as tensor slices (the same
    list on every rank; cached per op).

    A piece's slices travel in schema order; the 0-d AdamW step of a tensor the receiver held no
    copy of travels once, with its first slice.
    """
    if op.kind is Primitive.SPLIT:  # positions are the source unit's; a tile per target unit
        (whole,), parts, of = op.sources, op.targets, split_pieces
    else:  # Merge: positions are the target unit's; a tile per source unit
        (whole,), parts, of = op.targets, op.sources, merge_pieces
    gpus = whole.gpus
    tiles = tuple(tuple(map(gpus.index, u.gpus)) for u in parts)
    pieces = of(schema.num_layers, schema.tied, op.sources[0].layout, op.targets[0].layout, tiles)
    held = merged_holdings(*(unit_holdings(schema, u.layout, u.gpus) for u in op.sources))
    moves: list[Move] = []
    stepped: set[tuple[int, str]] = set()
    for sx, dx, piece in pieces:
        src, dst = gpus[sx], gpus[dx]
        for name, lo, hi in piece_slices(schema, piece):
            first = name not in held[dst] and (dst, name) not in stepped
            if first:
                stepped.add((dst, name))
            moves.append(Move(src, dst, name, lo, hi, first))
    return TransferPlan(tuple(moves))


@lru_cache(maxsize=65536)
def piece_slices(schema: StateSchema, piece: Piece) -> tuple[tuple[str, int, int], ...]:
    """The tensor slices ``(name, lo, hi)`` of a brain :class:`~nereus_lightning.transition.pieces.Piece`.

    Its blocks' TP-split tensors for the fraction ``[tp_lo / tp_den, tp_hi / tp_den)`` of their TP
    dim, their replicated tensors whole (``layer_norms``); the embedding and LM head for that
    fraction; the last stage's replicated tensors (final norm, a critic's value head) whole
    (``final_norm``).
    """
    out = []
    for name in schema.names:
        p = schema.placements[name]
        if p.kind == "block":
            assert p.layer is not None
            in_range = piece.layer_lo <= p.layer < piece.layer_hi
            wanted = in_range and (p.tp_dim is not None or piece.layer_norms)
        elif p.kind in ("embed", "lm_head"):
            require(p.tp_dim is not None, "tp_plan", f"{name} must be TP-split (it is priced as split)")
            wanted = piece.embed if p.kind == "embed" else piece.lm_head
        else:  # final_norm, value_head
            require(p.tp_dim is None, "tp_plan", f"{name} must be TP-replicated (it is priced as replicated)")
            wanted = piece.final_norm
        if not wanted:
            continue
        if p.tp_dim is None:
            out.append((name, *schema.interval(name, Layout(), 0)))
            continue
        size = schema.shape_of[name][p.tp_dim]
        require(
            size * piece.tp_lo % piece.tp_den == 0 and size * piece.tp_hi % piece.tp_den == 0,
            "layout.tp",
            f"{piece.tp_den} does not divide dim {p.tp_dim} ({size}) of {name}",
        )
        out.append((name, size * piece.tp_lo // piece.tp_den, size * piece.tp_hi // piece.tp_den))
    return tuple(out)


def plan_transfer(schema: StateSchema, held: Holdings, needed: Holdings, trains: bool = True) -> TransferPlan:
    """The moves that give every rank of ``needed`` its intervals, sourcing from ``held``.

    Raises if some needed segment has no holder (the state would be lost).
    """
    load: dict[int, int] = {rank: 0 for rank in held}
    moves: list[Move] = []
    for dst in sorted(needed):
        mine = held.get(dst, {})
        for name in schema.names:
            want = needed[dst].get(name)
            if want is None:
                continue
            have = mine.get(name)
            for seg in _subtract(want, have):
                moves.extend(_source(schema, name, seg, dst, held, load, have is None, trains))
    return TransferPlan(tuple(moves))


def _subtract(want: Interval, have: Interval | None) -> list[Interval]:
    if have is None:
        return [want]
    out = []
    if want[0] < have[0]:
        out.append((want[0], min(want[1], have[0])))
    if want[1] > have[1]:
        out.append((max(want[0], have[1]), want[1]))
    return [seg for seg in out if seg[0] < seg[1]]


def _source(
    schema: StateSchema,
    name: str,
    seg: Interval,
    dst: int,
    held: Holdings,
    load: dict[int, int],
    with_step: bool,
    trains: bool,
) -> list[Move]:
    holders = sorted((rank, h[name]) for rank, h in held.items() if rank != dst and name in h)
    cuts = sorted({seg[0], seg[1]} | {p for _, iv in holders for p in iv if seg[0] < p < seg[1]})
    spans: list[tuple[int, int, int]] = []  # (src, lo, hi), adjacent spans of one source merged
    for lo, hi in zip(cuts, cuts[1:], strict=False):
        options = [rank for rank, iv in holders if iv[0] <= lo and hi <= iv[1]]
        require(
            bool(options),
            "state",
            f"no live copy holds {name}[{lo}:{hi}] for rank {dst}; the state would be lost",
        )
        src = min(options, key=lambda r: (load[r], abs(r - dst), r))
        load[src] += element_count(schema, name, lo, hi)
        if spans and spans[-1][0] == src and spans[-1][2] == lo:
            spans[-1] = (src, spans[-1][1], hi)
        else:
            spans.append((src, lo, hi))
    # The 0-d AdamW step travels once per (name, dst), with the first span.
    return [Move(src, dst, name, lo, hi, with_step and i == 0) for i, (src, lo, hi) in enumerate(spans)]
