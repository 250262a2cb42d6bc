"""The body's transfer plans receive, per GPU, exactly the bytes the brain's transition pieces price."""

from dataclasses import replace

import pytest

from nereus_lightning.emu import StateSchema, Unit, merge, reshard_plan, split
from nereus_lightning.emu.plan import move_bytes
from nereus_lightning.plan.layout import Layout
from nereus_lightning.spec.model import ModelSpec
from nereus_lightning.transition.pieces import gather_transfers, geometry
from tests.emu.workers import tiny

PAIRS = [
    (Layout(2, 2), Layout(1, 2)),
    (Layout(2, 2), Layout(1, 1)),
    (Layout(2, 2), Layout(2, 1)),
    (Layout(1, 4), Layout(1, 2)),
    (Layout(1, 4), Layout(1, 1)),
    (Layout(4, 1), Layout(1, 1)),
]


def _received(plan, schema) -> dict[int, int]:
    out: dict[int, int] = {}
    for move in plan.moves:
        out[move.dst] = out.get(move.dst, 0) + move_bytes(schema, move, trains=False)
    return out


@pytest.mark.parametrize("kind,layers", [("llama", 4), ("gqa_tied", 4), ("qwen2", 4), ("llama", 6)])
def test_split_and_merge_bytes_match_transition_pieces(kind, layers):
    config, model, _ = tiny(kind, layers)
    schema = StateSchema.of(config, model)
    geo = geometry(replace(ModelSpec.from_hf_config(config), dtype="float32"), False)
    checked = 0
    for big, small in PAIRS:
        if config.num_key_value_heads % big.tp:
            continue
        op = split("s", Unit(big, (0, 1, 2, 3)), small)
        brain = {}
        for unit in op.targets:
            for index, gpu in enumerate(unit.ranks):
                pp, tp = divmod(index, small.tp)
                sent = gather_transfers(geo, big, op.source.ranks, op.source.ranks.index(gpu), small, pp, tp)
                brain[gpu] = sum(t.bytes for t in sent if t.src_gpu != t.dst_gpu)
        assert _received(reshard_plan(op, schema, False), schema) == {g: b for g, b in brain.items() if b}, (
            big,
            small,
        )
        for order in (None, (3, 2, 1, 0)):
            back = merge("s", op.targets, big, ranks=order)
            brain = {}
            for index, gpu in enumerate(back.target.ranks):
                own = next(u for u in back.sources if gpu in u.ranks)
                pp, tp = divmod(index, big.tp)
                sent = gather_transfers(geo, small, own.ranks, own.ranks.index(gpu), big, pp, tp)
                brain[gpu] = sum(t.bytes for t in sent if t.src_gpu != t.dst_gpu)
            assert _received(reshard_plan(back, schema, False), schema) == {
                g: b for g, b in brain.items() if b
            }
            checked += 1
    assert checked >= 8
