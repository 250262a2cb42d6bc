"""``T_sub`` geometry: how a unit of one layout splits into (and merges from) units of a smaller one.

Pure position arithmetic, cached per layout pair: the sub-units' positions, the GPU tuples they
land on, and the position patterns (with transfer buffers) of Split and Merge. Placing a pattern
on a unit's GPUs gives the exact transfers of that primitive call (``transition.pieces``).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache
from itertools import repeat
from math import gcd
from operator import itemgetter

from nereus_lightning.plan.layout import Layout
from nereus_lightning.transition.dag import MemEffect
from nereus_lightning.transition.pieces import Geometry, Piece, Transfer, gather_pattern

_new = tuple.__new__  # builds a NamedTuple without its (slow) Python-level __new__


def common_layout(a: Layout, b: Layout) -> Layout:
    """``T_sub``: the largest layout into which both ``a`` and ``b`` can be split."""
    return Layout(gcd(a.tp, b.tp), gcd(a.pp, b.pp))


@lru_cache(maxsize=1024)
def sub_positions(x: Layout, s: Layout) -> tuple[tuple[int, ...], ...]:
    """For each sub-unit ``j`` of a layout-``x`` unit split into ``s``: its positions as ``x`` indices."""
    k_tp, k_pp = x.tp // s.tp, x.pp // s.pp
    out = []
    for jp in range(k_pp):
        for jt in range(k_tp):
            out.append(
                tuple((pq * k_pp + jp) * x.tp + tq * k_tp + jt for pq in range(s.pp) for tq in range(s.tp))
            )
    return tuple(out)


@lru_cache(maxsize=1024)
def splitter(x: Layout, s: Layout) -> Callable[[tuple[int, ...]], list[tuple[int, ...]]]:
    """A function from a layout-``x`` unit's GPUs to its ``s`` sub-units' GPUs (``sub_positions`` order)."""
    positions = sub_positions(x, s)
    if len(positions) == 1:
        return lambda gpus: [gpus]
    flat = itemgetter(*(i for idx in positions for i in idx))
    size = s.size
    if size == 1:
        return lambda gpus: list(zip(flat(gpus)))  # single GPUs: C speed
    return lambda gpus: list(zip(*[iter(flat(gpus))] * size, strict=True))


@lru_cache(maxsize=1024)
def sub_gpus(x: Layout, s: Layout, units: int) -> Callable[[tuple[int, ...]], tuple[int, ...]]:
    """The GPUs of :func:`all_subs`'s sub-units, flat (a tuple: compared without making the units)."""
    positions = [u * x.size + i for u in range(units) for idx in sub_positions(x, s) for i in idx]
    if not positions:
        return lambda gpus: ()
    if positions == list(range(len(positions))):  # every GPU in order (e.g. TP2 -> TP1)
        return tuple
    return itemgetter(*positions) if len(positions) > 1 else (lambda gpus: (gpus[positions[0]],))


@lru_cache(maxsize=1024)
def all_subs(x: Layout, s: Layout, units: int) -> Callable[[tuple[int, ...]], list[tuple[int, ...]]]:
    """Like :func:`splitter` for ``units`` consecutive layout-``x`` units at once (unit-major)."""
    flat = sub_gpus(x, s, units)
    size = s.size
    if size == 1:
        return lambda gpus: list(zip(flat(gpus)))
    return lambda gpus: list(zip(*[iter(flat(gpus))] * size, strict=True))


@lru_cache(maxsize=256)
def consecutive(size: int, sub: int) -> tuple[tuple[int, ...], ...]:
    """The positions of a ``size``-GPU unit cut into consecutive runs of ``sub``."""
    return tuple(tuple(range(c, c + sub)) for c in range(0, size, sub))


@lru_cache(maxsize=256)
def unit_and_index(units: int, k: int) -> tuple[tuple[int, int], ...]:
    """``(i, j)`` for sub-unit ``j`` of unit ``i``, unit-major (the values of ``where``)."""
    return tuple((i, j) for i in range(units) for j in range(k))


Pattern = tuple[tuple[int, int, int, Piece], ...]  # (src position, dst position, bytes, piece)


@lru_cache(maxsize=4096)
def split_pattern(
    geo: Geometry, a: Layout, s: Layout, tiles: tuple[tuple[int, ...], ...]
) -> tuple[Pattern, tuple[int, ...]]:
    """Split of a layout-``a`` unit into ``s`` units at ``tiles``
    (its positions), and buffers per position.
    """
    out = []
    for tile in tiles:
        for q, x in enumerate(tile):
            for src, size, piece in gather_pattern(geo, a, x, s, q // s.tp, q % s.tp):
                out.append((src, x, size, piece))
    return tuple(out), _buffers(out, a.size)


@lru_cache(maxsize=4096)
def merge_pattern(
    geo: Geometry, s: Layout, b: Layout, tiles: tuple[tuple[int, ...], ...]
) -> tuple[Pattern, tuple[int, ...]]:
    """Merge of ``s`` units at ``tiles`` (positions of the layout-``b`` result), and buffers per position."""
    at = {x: (tile, q) for tile in tiles for q, x in enumerate(tile)}
    out = []
    for x in range(b.size):
        tile, q = at[x]
        for src, size, piece in gather_pattern(geo, s, q, b, x // b.tp, x % b.tp):
            out.append((tile[src], x, size, piece))
    return tuple(out), _buffers(out, b.size)


def _buffers(pattern: list[tuple[int, int, int, Piece]], size: int) -> tuple[int, ...]:
    """Transfer buffers per position while a Split or Merge runs: each transfer is packed into one
    contiguous send buffer and lands in one receive buffer before it is unpacked. (Extend sends a
    whole shard in the same layout: the unit's flat storage is the buffer on both sides.)"""
    buf = [0] * size
    for sx, dx, nbytes, _ in pattern:
        buf[sx] += nbytes
        if dx != sx:
            buf[dx] += nbytes
    return tuple(buf)


def placed(gpus: tuple[int, ...], pattern: Pattern) -> list[Transfer]:
    """A position pattern placed on ``gpus``."""
    return [_new(Transfer, (gpus[sx], gpus[dx], size, piece)) for sx, dx, size, piece in pattern]


def uniform_effects(gpus: tuple[int, ...], net: float) -> tuple[MemEffect, ...]:
    """The same net effect on every GPU, no buffers."""
    return tuple(zip(gpus, repeat(net), repeat(0.0)))
