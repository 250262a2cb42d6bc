"""Split and Merge plans for every power-of-two TP/PP change up to 8 ranks, replayed in one process.

The replay uses the same pieces as the distributed path (holdings, moves, strided views,
pack/unpack, the keep-what-you-hold step); only the wire is missing. Each target shard must
equal the shard cut directly from the full tensors, for parameters and AdamW state.
"""

import itertools

import pytest
import torch

from nereus_lightning.emu import EMU, StateSchema, Unit, merge, reshard_plan, split, unit_holdings
from nereus_lightning.emu.primitives import _new_state
from nereus_lightning.emu.transfer import move_views
from nereus_lightning.kernels import pack, unpack
from nereus_lightning.plan.layout import Layout
from tests.emu.workers import tiny

LAYOUTS = [Layout(t, p) for t in (1, 2, 4, 8) for p in (1, 2, 4, 8) if t * p <= 8]


@pytest.fixture(scope="module", params=[(8, True), (6, False)], ids=["8layers_tied", "6layers"])
def model_state(request):
    layers, tied = request.param
    # 8 heads of 4 dimensions: TP 8 divides them.
    config, model, optim = tiny(
        "llama", layers, num_attention_heads=8, num_key_value_heads=8, tie_word_embeddings=tied
    )
    full = {n: p.detach() for n, p in model.named_parameters()}
    return StateSchema.of(config, model), full, optim


_CUTS: dict = {}


def _replay(schema, full, optim, op):
    def cut(unit, rank):
        key = (unit, rank)
        if key not in _CUTS:
            _CUTS[key] = EMU.from_model("s", schema, full, unit, rank, trains=True, full_optim=optim)
        return _CUTS[key]

    old = {r: {(n, k): t for n, k, t in cut(u, r).tensors()} for u in op.sources for r in u.gpus}
    old_iv = {r: iv for u in op.sources for r, iv in unit_holdings(schema, u.layout, u.gpus).items()}
    new_iv = {r: iv for u in op.targets for r, iv in unit_holdings(schema, u.layout, u.gpus).items()}
    new = {r: _new_state(schema, old[r], old_iv[r], new_iv[r], True, torch.device("cpu")) for r in new_iv}
    plan = reshard_plan(op, schema, True)
    for (src, dst), moves in plan.pairs().items():
        out = [v for m in moves for v in move_views(schema, m, old[src], old_iv[src][m.name], True)]
        into = [v for m in moves for v in move_views(schema, m, new[dst], new_iv[dst][m.name], True)]
        unpack(pack(out), into)
    wrong = []
    for u in op.targets:
        for r in u.gpus:
            want = {(n, k): t for n, k, t in cut(u, r).tensors()}
            if want.keys() != new[r].keys():
                wrong.append((str(u), r, "names"))
            wrong += [(str(u), r, key) for key, t in want.items() if not torch.equal(t, new[r][key])]
    return wrong, plan


def test_every_power_of_two_split_and_merge_gives_the_directly_cut_shards(model_state):
    schema, full, optim = model_state
    _CUTS.clear()  # cuts of this model only
    checked = 0
    for big, small in itertools.product(LAYOUTS, LAYOUTS):
        if big == small or big.tp % small.tp or big.pp % small.pp or big.pp > schema.num_layers:
            continue
        op = split("s", Unit(big, tuple(range(big.size))), small)
        wrong, plan = _replay(schema, full, optim, op)
        assert wrong == [], (big, small, wrong[:3])
        for order in (None, tuple(reversed(range(big.size)))):
            back = merge("s", op.targets, big, ranks=order, schema=schema)
            wrong, plan = _replay(schema, full, optim, back)
            assert wrong == [], (small, big, order, wrong[:3])
            if order is None and schema.num_layers % big.pp == 0:
                assert plan.moves == ()  # full replicas nest: nothing moves
        checked += 1
    assert checked >= 15
