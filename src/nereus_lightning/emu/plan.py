"""Which slice of which tensor goes from which rank to which: the transfer plan of a resharding.

Pure Python (no torch), so the same list prices a transition and drives its execution. Every
shard is one interval ``[lo, hi)`` along its parameter's TP dimension (the whole first-dim
extent for replicated tensors). A target rank keeps what it already holds and receives exactly
the rest, each missing segment from one holder; the holder is the least-loaded one so far
(ties: the nearest rank, then the lowest), which spreads an all-gather evenly over its group.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from nereus_lightning.emu.schema import StateSchema, position_of
from nereus_lightning.plan.layout import Layout
from nereus_lightning.spec.errors import require

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
