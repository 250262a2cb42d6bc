"""bf16 training units: fp32 moments and master held, moved and
priced as the brain prices them (14 B/param).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from nereus_lightning.emu import (
    EMU,
    StateSchema,
    Unit,
    create_unit,
    destroy,
    execute,
    extend,
    gather_logical_state,
    merge,
    registry,
    reshard_plan,
    split,
)
from nereus_lightning.emu.sync import relayout
from nereus_lightning.plan.layout import Layout
from nereus_lightning.plan.memory import optimizer_bytes_per_param
from nereus_lightning.spec.errors import NereusConfigError
from nereus_lightning.spec.model import ModelSpec
from nereus_lightning.transition.pieces import extend_transfers, gather_transfers, geometry, shard_bytes
from tests.emu.workers import COUNTERS, tiny

STAGE = "actor_train"
BIG, SMALL = Layout(2, 2), Layout(1, 2)
ALL = (0, 1, 2, 3)


def bf16_tiny(kind: str = "llama"):
    """The tiny model of ``tests.emu.workers.tiny`` in bf16, its
    AdamW state with the fp32 weights as masters.
    """
    config, model, optim = tiny(kind)
    config.dtype = torch.bfloat16
    for name, p in model.named_parameters():
        optim[name]["master"] = p.detach().clone()
    return config, model.to(torch.bfloat16), optim


def test_training_state_is_14_bytes_per_bf16_param_as_the_brain_prices() -> None:
    for kind in ("llama", "gqa_tied"):
        config, model, optim = bf16_tiny(kind)
        spec = ModelSpec.from_hf_config(config)
        assert spec.dtype == "bfloat16" and spec.dtype_bytes + optimizer_bytes_per_param(spec) == 14
        schema = StateSchema.of(config, model)
        for layout in (Layout(1, 1), BIG):
            unit = Unit(layout, ALL[: layout.size])
            for rank in unit.gpus:
                emu = EMU.from_model(STAGE, schema, model, unit, rank, trains=True, full_optim=optim)
                params = sum(p.numel() for p in emu.params.values())
                shaped = sum(t.nbytes for _, key, t in emu.tensors() if key != "step")
                assert shaped == params * (spec.dtype_bytes + optimizer_bytes_per_param(spec)), (kind, layout)
                assert emu.nbytes() == shaped + 4 * len(emu.params)  # + the 0-d fp32 step per tensor
                # Per GPU, the very bytes the transition brain says this position holds.
                pos = unit.position(rank)
                assert shaped == shard_bytes(geometry(spec, True), layout, pos.pp_rank), (kind, layout, rank)
                for name, state in emu.optim_state.items():
                    assert emu.params[name].dtype == torch.bfloat16
                    assert {k: t.dtype for k, t in state.items()} == dict.fromkeys(
                        ("exp_avg", "exp_avg_sq", "master", "step"), torch.float32
                    )
                    assert torch.equal(state["master"].to(torch.bfloat16), emu.params[name])


def split_extend_merge(rank: int, world: int) -> dict:
    """(TP2,PP2) -> Split -> (TP1,PP2)x2 -> Destroy one -> Extend it
    back -> Merge -> relayout, bf16 training.
    """
    registry().clear()
    config, model, optim = bf16_tiny()
    create_unit(STAGE, config, model, BIG, ALL, trains=True, full_optim=optim, counters=COUNTERS)
    before = gather_logical_state(STAGE)
    op = split(STAGE, Unit(BIG, ALL), SMALL)
    got = {"split": execute(op).payload_received}
    keep, gone = op.targets
    execute(destroy(STAGE, gone))
    got["extend"] = execute(extend(STAGE, keep, [gone.gpus])).payload_received
    mid = gather_logical_state(STAGE)
    got["merge"] = execute(merge(STAGE, op.targets, BIG)).payload_received
    after = gather_logical_state(STAGE)
    relayout(STAGE, [Unit(Layout(1, 4), ALL)])  # the fallback path; each rank keeps part of its shards
    moved = gather_logical_state(STAGE)
    out: dict = {"payload": got}
    if rank == 0:
        out["mid"] = (mid.replicas, before.differences(mid))
        out["after"] = before.differences(after)
        out["relayout"] = before.differences(moved)
        out["keys"] = {n: {k: str(t.dtype) for k, t in s.items()} for n, s in after.optim.items()}
        out["master_is_param"] = all(
            torch.equal(after.optim[n]["master"].to(torch.bfloat16), p) for n, p in after.params.items()
        )
        out["param_dtypes"] = {str(p.dtype) for p in after.params.values()}
    return out


def _steps_into(plan, gpu: int) -> int:
    return 4 * sum(1 for m in plan.moves if m.dst == gpu and m.with_step)


def test_bf16_transfers_are_exact_and_carry_the_bytes_the_brain_prices(dist4) -> None:
    per_rank = dist4.run(split_extend_merge)
    config, model, _ = bf16_tiny()
    schema, geo = StateSchema.of(config, model), geometry(ModelSpec.from_hf_config(config), True)
    assert geo.bytes_per_param == 14
    # Split: each new position receives what it lacks (priced by gather_transfers) + a step per new tensor.
    op = split(STAGE, Unit(BIG, ALL), SMALL)
    plan = reshard_plan(op, schema, True)
    for unit in op.targets:
        for index, gpu in enumerate(unit.gpus):
            pp, tp = divmod(index, SMALL.tp)
            priced = gather_transfers(geo, BIG, ALL, ALL.index(gpu), SMALL, pp, tp)
            brain = sum(t.bytes for t in priced if t.src_gpu != t.dst_gpu)
            assert brain > 0 and per_rank[gpu]["payload"]["split"] == brain + _steps_into(plan, gpu), gpu
    # Extend: the new replica's positions receive a whole shard each + 48 B of counters + steps.
    keep, gone = op.targets
    priced = {t.dst_gpu: t.bytes for t in extend_transfers(geo, SMALL, keep.gpus, gone.gpus)}
    for index, gpu in enumerate(gone.gpus):
        names = schema.stage_names(SMALL, index // SMALL.tp)
        assert per_rank[gpu]["payload"]["extend"] == priced[gpu] + 48 + 4 * len(names), gpu
    assert all(per_rank[gpu]["payload"]["extend"] == 0 for gpu in keep.gpus)
    # Merge back.
    back = merge(STAGE, op.targets, BIG)
    plan = reshard_plan(back, schema, True)
    for index, gpu in enumerate(back.target.gpus):
        own = next(u for u in back.sources if gpu in u.gpus)
        pp, tp = divmod(index, BIG.tp)
        priced = gather_transfers(geo, SMALL, own.gpus, own.gpus.index(gpu), BIG, pp, tp)
        brain = sum(t.bytes for t in priced if t.src_gpu != t.dst_gpu)
        assert per_rank[gpu]["payload"]["merge"] == brain + _steps_into(plan, gpu), gpu
    # The state, master included, survives bit for bit.
    out = per_rank[0]
    assert out["mid"] == (2, [])
    assert out["after"] == [] and out["relayout"] == []
    assert out["param_dtypes"] == {"torch.bfloat16"} and out["master_is_param"]
    assert len(out["keys"]) == len(schema.names)
    assert all(
        keys == dict.fromkeys(("exp_avg", "exp_avg_sq", "master", "step"), "torch.float32")
        for keys in out["keys"].values()
    )


def test_a_given_master_that_does_not_round_to_its_parameter_is_refused() -> None:
    config, model, optim = bf16_tiny()
    schema, unit = StateSchema.of(config, model), Unit(Layout(1, 1), (0,))
    name = "model.layers.0.mlp.up_proj.weight"
    optim[name]["master"] = optim[name]["master"] + 0.25  # no longer the master the bf16 weight came from
    # A checkpoint stores the master only: this unit would resume with other weights than it holds.
    with pytest.raises(NereusConfigError, match=rf"full_optim: {name}: its master rounded to bfloat16 is"):
        EMU.from_model(STAGE, schema, model, unit, 0, trains=True, full_optim=optim)


def dcp_bf16(rank: int, world: int, path: str) -> dict:
    """A training unit of bf16 weights (fp32 masters) and fp32 norms (none) saved with DCP as it is (``new``)
    and as checkpoints before issue 14 were (``old``: every parameter too), Split, then each loaded into the
    new layout: per checkpoint the shards that differ; on rank 0 what each holds.
    """
    from nereus_lightning.emu.dcp_state import (
        PARAMS_FROM_MASTERS,
        dcp_state_dict,
        load_state,
        read_dcp_metadata,
        save_state,
        save_tensors,
    )

    registry().clear()
    config, model, optim = bf16_tiny("gqa_tied")
    for name, p in model.named_parameters():
        if "norm" in name:  # an fp32 parameter is stepped as it is, without a master
            p.data = p.data.float()
            del optim[name]["master"]
    create_unit(STAGE, config, model, BIG, ALL, trains=True, full_optim=optim, counters=COUNTERS)
    save_state(STAGE, f"{path}/new")
    save_tensors(dcp_state_dict(registry().local(STAGE, Unit(BIG, ALL))), f"{path}/old")
    execute(split(STAGE, Unit(BIG, ALL), SMALL))
    mine = next(u for u in registry().live(STAGE) if rank in u.gpus)
    ours = registry().local(STAGE, mine)
    out: dict = {"masters": sum(1 for _, k, _ in ours.tensors() if k == "master")}
    for saved in ("new", "old"):
        oracle = EMU.empty(STAGE, registry().schema(STAGE), mine, rank, trains=True)
        for _, _, t in oracle.tensors():
            t.fill_(-7.0)  # a shard DCP did not fill cannot pass by chance
        load_state(oracle, f"{path}/{saved}")
        theirs = {(n, k): t for n, k, t in oracle.tensors()}
        bad = [f"{n}.{k}" for n, k, t in ours.tensors() if not torch.equal(t, theirs[(n, k)])]
        out[saved] = bad + ([] if oracle.counters == ours.counters else ["counters"])
    if rank == 0:
        out["stored"] = {s: set(read_dcp_metadata(f"{path}/{s}").state_dict_metadata) for s in ("new", "old")}
        out["record"] = json.loads((Path(path) / "new" / PARAMS_FROM_MASTERS).read_text())
        out["dtypes"] = {n: str(p.dtype).removeprefix("torch.") for n, p in model.named_parameters()}
    return out


def test_dcp_checkpoint_holds_the_master_and_gives_back_its_weight(dist4, tmp_path) -> None:
    per_rank = dist4.run(dcp_bf16, str(tmp_path))
    for rank, out in enumerate(per_rank):
        # Both loads give every shard of the new layout bit for bit: bf16 weights rounded from their masters,
        # the older checkpoint's stored weights left unread.
        assert out["masters"] > 0 and out["new"] == out["old"] == [], (rank, out["new"][:4], out["old"][:4])
    out = per_rank[0]
    low = {n for n, dtype in out["dtypes"].items() if dtype == "bfloat16"}
    fp32 = set(out["dtypes"]) - low
    assert low and fp32
    # A bf16 weight is stored as its fp32 master only; an fp32 one (no master) as it is.
    new, old = out["stored"]["new"], out["stored"]["old"]
    assert {k for k in new if k.startswith("param/")} == {f"param/{n}" for n in fp32}
    assert {k for k in new if k.startswith("master/")} == {f"master/{n}" for n in low}
    assert old == new | {f"param/{n}" for n in low}
    assert out["record"] == {"params_from_masters": dict.fromkeys(low, "bfloat16")}  # (what export reads)
