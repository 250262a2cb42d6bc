"""Re-cutting a sharded unit's row blocks: the list of moves the body executes and the brain prices."""

from __future__ import annotations

import pytest

from nereus_lightning.plan.rows import first_sources, grown_order, row_block, row_moves, shrunk_order


def test_growing_keeps_each_old_block_inside_its_new_one() -> None:
    assert grown_order((5, 7), (1, 2)) == (5, 1, 7, 2)
    assert shrunk_order((5, 1, 7, 2), 2) == (5, 7)
    moves = row_moves({"w": 8}, (5, 7), (5, 1, 7, 2))
    # rank 5 keeps rows 0-2 (its new block), rank 7 rows 4-6; rows 2-4 and 6-8 move to the new ranks
    assert sorted((m.src, m.dst, m.lo, m.hi) for m in moves) == [(5, 1, 2, 4), (7, 2, 6, 8)]


@pytest.mark.parametrize(("d", "grown"), [(1, 2), (2, 4), (2, 6), (3, 6), (4, 8), (2, 8)])
@pytest.mark.parametrize("rows", [24, 25, 7, 1])
def test_a_re_cut_fills_every_new_block_once_moving_the_least(d: int, grown: int, rows: int) -> None:
    """Every row of every new block is kept or received exactly once; growing ``d -> d'`` moves ``(d' - d)
    / d'`` of the rows where ``d'`` divides them; shrinking back moves as many."""
    old = tuple(range(10, 10 + d))
    new = grown_order(old, tuple(range(100, 100 + grown - d)))
    for a, b in ((old, new), (new, shrunk_order(new, d))):
        moves = row_moves({"w": rows}, a, b)
        for j, dst in enumerate(b):
            lo, hi = row_block(rows, len(b), j)
            got = [(m.lo, m.hi) for m in moves if m.dst == dst]
            if dst in a:  # what it keeps: its old block's rows inside its new block
                held = row_block(rows, len(a), a.index(dst))
                got.append((max(held[0], lo), min(held[1], hi)))
            got = sorted(g for g in got if g[0] < g[1])
            covered = [r for g in got for r in range(*g)]
            assert covered == list(range(lo, hi)), (a, b, dst, got)
        if rows % grown == 0:
            assert sum(m.hi - m.lo for m in moves) == rows * (grown - d) // grown


def test_each_new_rank_takes_what_is_held_whole_from_the_old_rank_of_its_first_row() -> None:
    assert first_sources((5, 7), (5, 1, 7, 2)) == {1: 5, 2: 7}
    assert first_sources((5, 1, 7, 2), (5, 7)) == {}  # shrinking: every rank of the new cut held the unit
    assert first_sources((0, 1), (0, 4, 5, 1, 6, 7)) == {4: 0, 5: 0, 6: 1, 7: 1}
