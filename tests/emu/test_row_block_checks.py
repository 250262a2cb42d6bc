"""The checks before a save read a sharded replica's row blocks as its own: a bf16 parameter held whole
(ZeRO-1) is compared with its fp32 master's rows, which are all this shard rank holds."""

from __future__ import annotations

import torch

from nereus_lightning import emu
from nereus_lightning.emu.dcp_state import params_off_master
from nereus_lightning.emu.schema import StateSchema
from nereus_lightning.models.zero import cut_rows
from nereus_lightning.plan.layout import Layout
from nereus_lightning.plan.units import Unit
from nereus_lightning.testing.tiny import tiny_model

STAGE = "actor_train"


def _row_cut_unit(shard_rank: int) -> emu.EMU:
    """Shard rank ``shard_rank``'s EMU of a bf16 ZeRO-1 replica (shard 2) at rest: whole parameters, its
    rows of the AdamW state (masters included)."""
    model = tiny_model("qwen2").to(torch.bfloat16)
    schema = StateSchema.of(model.config, model)
    unit = Unit(Layout(1, 1, shard=2, zero=1), (0, 1))
    state = emu.EMU.from_model(STAGE, schema, model, unit, shard_rank, trains=True)
    for entry in state.optim_state.values():
        for key, t in entry.items():
            if key != "step":
                entry[key] = cut_rows(t, 2, shard_rank).clone()
    state.row_keys = frozenset(k for e in state.optim_state.values() for k in e if k != "step")
    reg = emu.registry()
    reg.clear()
    reg.declare(STAGE, schema, trains=True)
    reg.add(STAGE, unit, state)
    return state


def test_a_whole_parameter_is_checked_against_its_masters_rows() -> None:
    state = _row_cut_unit(1)
    assert "master" in state.row_keys
    assert params_off_master(STAGE) == []
    name = "model.layers.0.mlp.down_proj.weight"
    with torch.no_grad():
        state.params[name][0] += 1  # a row of shard rank 0's block: not this rank's to check
    assert params_off_master(STAGE) == []
    with torch.no_grad():
        state.params[name][-1] += 1  # a row of its own block
    assert params_off_master(STAGE) == [name]
    emu.registry().clear()
