"""Row blocks of a ZeRO-sharded unit: FSDP2's cut and the moves that re-cut it to another degree.

A shard group of ``d`` ranks holds every row-cut tensor as ``d`` dim-0 row blocks
(:func:`row_block`). When the degree changes, :func:`row_moves` lists which rows go from which
rank to which; the body executes that list (``emu.transfer.recut_rows``) and the brain prices
it, so both read one list; :func:`recut_in_place` says when a plan change is such a re-cut. Plain
integers, no tensors (the brain imports it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from math import gcd

from nereus_lightning.plan.layout import Candidate, Plan
from nereus_lightning.spec.errors import require
from nereus_lightning.spec.model import ModelSpec


def row_block(rows: int, shard: int, shard_rank: int) -> tuple[int, int]:
    """The rows ``[lo, hi)`` of a ``rows``-row tensor that ``shard_rank`` holds: FSDP2's cut, ``ceil(rows /
    shard)`` rows each, the last ranks' blocks short or empty."""
    size = -(-rows // shard)
    lo = min(shard_rank * size, rows)
    return lo, min(lo + size, rows)


@dataclass(frozen=True)
class RowMove:
    """Rows ``[lo, hi)`` of the row-cut tensor ``key`` sent from ``src`` to ``dst``."""

    src: int
    dst: int
    key: str
    lo: int
    hi: int


def row_moves(rows: Mapping[str, int], old: tuple[int, ...], new: tuple[int, ...]) -> tuple[RowMove, ...]:
    """The moves that re-cut row blocks held by ranks ``old`` (shard order) into the blocks of ``new``.

    ``rows`` gives each row-cut tensor's row count. A rank keeps the rows it holds in both cuts;
    every other row of a new block comes from the old rank that holds it. Growing ``d -> d'`` with
    :func:`grown_order` moves ``(d' - d) / d'`` of the state, the least any order can.
    """
    moves = []
    for key, n in rows.items():
        for j, dst in enumerate(new):
            want = row_block(n, len(new), j)
            for i, src in enumerate(old):
                have = row_block(n, len(old), i)
                lo, hi = max(want[0], have[0]), min(want[1], have[1])
                if lo < hi and src != dst:
                    moves.append(RowMove(src, dst, key, lo, hi))
    return tuple(moves)


def grown_order(old: tuple[int, ...], added: tuple[int, ...]) -> tuple[int, ...]:
    """The shard order of a unit grown from ``old`` by ``added`` ranks that keeps the most in place: with
    ``k = d' / d``, old rank ``i`` at position ``i * k`` (its new block lies inside its old one)."""
    d, total = len(old), len(old) + len(added)
    require(total % d == 0, "shard", f"growing shard {d} -> {total}: the new degree must be a multiple")
    k, spare = total // d, iter(added)
    return tuple(rank for r in old for rank in (r, *(next(spare) for _ in range(k - 1))))


def shrunk_order(order: tuple[int, ...], shard: int) -> tuple[int, ...]:
    """The ranks that stay when a unit of shard order ``order`` shrinks to ``shard``: every ``k``-th
    (``k = d / shard``), each holding ``1 / k`` of its new block already (the inverse of
    :func:`grown_order`)."""
    require(len(order) % shard == 0, "shard", f"shrinking shard {len(order)} -> {shard}: need a divisor")
    return order[:: len(order) // shard]


def unit_rows(old: int, new: int) -> int:
    """The row count on which a re-cut between degrees ``old`` and ``new`` is priced: ``lcm(old, new)``,
    the fewest rows that both cut evenly (a tensor whose row count it divides moves that fraction)."""
    return old * new // gcd(old, new)


def first_sources(old: tuple[int, ...], new: tuple[int, ...]) -> dict[int, int]:
    """Per rank of ``new`` not in ``old``: the rank of ``old`` whose block holds the first row of its new
    block (on :func:`unit_rows` rows), which sends it whatever a shard rank holds whole."""
    out: dict[int, int] = {}
    for move in row_moves({"": unit_rows(len(old), len(new))}, old, new):
        if move.dst not in old:
            out.setdefault(move.dst, move.src)
    return out


def shard_rows(model: ModelSpec, tp: int) -> frozenset[int]:
    """The row counts of the tensors a shard rank cuts into row blocks, at TP degree ``tp``: those of the
    TP-split tensors (the vocabulary, the attention projections, the MLP) and of the ones whose rows TP
    leaves whole (the hidden size, a head's q/k norm)."""
    hd = model.head_dim or model.hidden // model.num_heads
    split = [model.vocab, model.num_heads * hd, model.num_kv_heads * hd, model.intermediate]
    if model.num_experts:
        split += [model.expert_intermediate, model.shared_intermediate]
    whole = [model.hidden, model.num_experts] + ([hd] if model.qk_norm else [])
    return frozenset([n // tp for n in split if n] + [n for n in whole if n])


def recut_in_place(model: ModelSpec, current: Candidate, target: Candidate) -> bool:
    """Whether ``target`` is ``current`` with another shard degree alone, re-cut in place: the same
    replicas, model cut and ZeRO stage, each replica on a superset of its GPUs (growing) or a subset
    (shrinking), and ``lcm(d, d')`` (:func:`unit_rows`) dividing every row count (:func:`shard_rows`),
    so that the row moves are priced exactly. Otherwise the shard groups move whole."""
    a, b = current.layout, target.layout
    if (a.tp, a.pp, a.zero, current.dp) != (b.tp, b.pp, b.zero, target.dp) or a.shard == b.shard:
        return False
    for r in range(current.dp):
        old, new = set(current.replica_gpus(r)), set(target.replica_gpus(r))
        if not (old < new or new < old):
            return False
    lcm = unit_rows(a.shard, b.shard)
    return all(n % lcm == 0 for n in shard_rows(model, a.tp))


def recut_stages(current: Plan, target: Plan, model_of: Mapping[str, ModelSpec]) -> frozenset[str]:
    """The model-stages of ``current`` re-cut in place to ``target`` (:func:`recut_in_place`; ``model_of``:
    each model-stage's ModelSpec)."""
    return frozenset(n for n, c in current.items() if recut_in_place(model_of[n], c, target[n]))
