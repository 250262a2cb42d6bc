"""Split and Merge as transfers: which piece of state each GPU of a Split or Merge receives, and from where.

:func:`split_pieces` and :func:`merge_pieces` are THE transfer plan of those primitives: the
brain prices them (:func:`split_pattern`, :func:`merge_pattern` add the bytes of
``transition.pieces`` and the buffers) and the body executes them (``emu.transfer_plan.reshard_plan``
turns each piece into tensor slices). Pure position arithmetic, cached per layout pair and
tiling; placing a pattern on a unit's GPUs gives the exact transfers of one primitive call.
The unit geometry itself (which positions form each sub-unit, ``T_sub``) is ``plan.units``.
"""

from __future__ import annotations

from functools import lru_cache
from itertools import repeat

from nereus_lightning.plan.layout import Layout
from nereus_lightning.plan.units import all_subs, common_layout, splitter, sub_gpus, sub_positions
from nereus_lightning.transition.dag import MemEffect
from nereus_lightning.transition.pieces import Geometry, Piece, Transfer, gather_pieces, piece_bytes

# Re-exported for the transition modules that import the unit geometry from here.
__all__ = [
    "Pattern",
    "PiecePattern",
    "all_subs",
    "common_layout",
    "consecutive",
    "merge_pattern",
    "merge_pieces",
    "placed",
    "split_pattern",
    "split_pieces",
    "splitter",
    "sub_gpus",
    "sub_positions",
    "uniform_effects",
    "unit_and_index",
]

_new = tuple.__new__  # builds a NamedTuple without its (slow) Python-level __new__


@lru_cache(maxsize=256)
def consecutive(size: int, sub: int) -> tuple[tuple[int, ...], ...]:
    """The positions of a ``size``-GPU unit cut into consecutive runs of ``sub``."""
    return tuple(tuple(range(c, c + sub)) for c in range(0, size, sub))


@lru_cache(maxsize=256)
def unit_and_index(units: int, k: int) -> tuple[tuple[int, int], ...]:
    """``(i, j)`` for sub-unit ``j`` of unit ``i``, unit-major (the values of ``where``)."""
    return tuple((i, j) for i in range(units) for j in range(k))


Pattern = tuple[tuple[int, int, int, Piece], ...]  # (src position, dst position, bytes, piece)
PiecePattern = tuple[tuple[int, int, Piece], ...]  # (src position, dst position, piece)


@lru_cache(maxsize=4096)
def split_pieces(
    num_layers: int, tied: bool, a: Layout, s: Layout, tiles: tuple[tuple[int, ...], ...]
) -> PiecePattern:
    """Split of a layout-``a`` unit into ``s`` units at ``tiles`` (per new unit, its positions in
    the ``a`` unit): what each position receives, from which position (``gather_pieces``)."""
    return tuple(
        (src, x, piece)
        for tile in tiles
        for q, x in enumerate(tile)
        for src, piece in gather_pieces(num_layers, tied, a, x, s, q // s.tp, q % s.tp)
    )


@lru_cache(maxsize=4096)
def merge_pieces(
    num_layers: int, tied: bool, s: Layout, b: Layout, tiles: tuple[tuple[int, ...], ...]
) -> PiecePattern:
    """Merge of ``s`` units at ``tiles`` (per old unit, the positions of its GPUs in the layout-``b``
    result): what each position receives, from which position of its own old unit."""
    at = {x: (tile, q) for tile in tiles for q, x in enumerate(tile)}
    out = []
    for x in range(b.size):
        tile, q = at[x]
        for src, piece in gather_pieces(num_layers, tied, s, q, b, x // b.tp, x % b.tp):
            out.append((tile[src], x, piece))
    return tuple(out)


@lru_cache(maxsize=4096)
def split_pattern(
    geo: Geometry, a: Layout, s: Layout, tiles: tuple[tuple[int, ...], ...]
) -> tuple[Pattern, tuple[int, ...]]:
    """:func:`split_pieces` with their bytes, and the transfer buffers per position."""
    pieces = split_pieces(geo.model.num_layers, geo.model.tie_embeddings, a, s, tiles)
    out = [(src, x, piece_bytes(geo, piece), piece) for src, x, piece in pieces]
    return tuple(out), _buffers(out, a.size)


@lru_cache(maxsize=4096)
def merge_pattern(
    geo: Geometry, s: Layout, b: Layout, tiles: tuple[tuple[int, ...], ...]
) -> tuple[Pattern, tuple[int, ...]]:
    """:func:`merge_pieces` with their bytes, and the transfer buffers per position."""
    pieces = merge_pieces(geo.model.num_layers, geo.model.tie_embeddings, s, b, tiles)
    out = [(src, x, piece_bytes(geo, piece), piece) for src, x, piece in pieces]
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
