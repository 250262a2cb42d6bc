"""DeepSpeed universal checkpoints in and out of nereus (``tests/fixtures/deepspeed``: DeepSpeed 0.19.8
trained a tiny Qwen2 two steps at ZeRO-2 on two gloo ranks, ``ds_to_universal`` converted it, and a
fresh engine resuming it recorded the next batch's losses).

Imported, the AdamW state is the checkpoint's, and nereus resuming it unsharded, at shard 2 x TP2 (ZeRO-2)
and at shard 4 (ZeRO-1) gives DeepSpeed's losses on the next batch, before and after one more step.
Exported back, DeepSpeed resumes it with the same losses (marked ``deepspeed``: ``nox -s deepspeed``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.lightning.test_checkpoint_safety import saved  # noqa: F401 (the fixture: a PPO run's checkpoints)

FIXTURE = Path(__file__).parents[1] / "fixtures" / "deepspeed"
EXPECTED = json.loads((FIXTURE / "expected.json").read_text())
TOLERANCE = 1e-5


def _config():  # noqa: ANN202
    import transformers as tf

    return tf.AutoConfig.from_pretrained(FIXTURE)


@pytest.fixture(scope="module")
def imported(tmp_path_factory) -> Path:
    from nereus_lightning.lightning.deepspeed_universal import import_universal

    return import_universal(FIXTURE / "universal", tmp_path_factory.mktemp("ds") / "actor_train", _config())


def _stored(stage: Path) -> dict[str, torch.Tensor]:
    from nereus_lightning.emu.dcp_state import load_tensors, read_dcp_metadata

    meta = read_dcp_metadata(stage).state_dict_metadata
    box = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in meta.items()}
    load_tensors(box, stage, alone=True)
    return box


def test_import_keeps_the_adamw_state(imported: Path) -> None:
    stored = _stored(imported)
    folders = sorted((FIXTURE / "universal" / "step2" / "zero").glob("*/fp32.pt"))
    assert len(folders) == len(dict(_model().named_parameters())) > 0
    for fp32 in folders:
        name = fp32.parent.name
        for file, key in (("fp32", "param"), ("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq")):
            want = torch.load(fp32.parent / f"{file}.pt", weights_only=True)["param"]
            assert torch.equal(stored[f"{key}/{name}"], want.detach()), (name, key)
        assert stored[f"exp_avg_sq/{name}"].abs().sum() > 0, name  # trained state, not a fresh one
        assert (
            float(stored[f"step/{name}"])
            == float(torch.load(fp32.parent / "step.pt", weights_only=True))
            == 2
        )
    assert int(stored["global_step"][0]) == 2


def _model():  # noqa: ANN202
    import transformers as tf

    return tf.AutoModelForCausalLM.from_config(_config())


def _sequences() -> torch.Tensor:
    """The next batch's sequences (every one of the same length, so the mean of per-sequence means is
    DeepSpeed's mean of its ranks' micro-batch means)."""
    return torch.tensor(EXPECTED["next_batch"]).reshape(-1, len(EXPECTED["next_batch"][0][0]))


def _loss(module, ids: torch.Tensor, total: int) -> torch.Tensor:  # noqa: ANN001
    """The sum of ``ids``' per-sequence mean next-token losses over ``total`` sequences."""
    logits = module.full_logits(module(ids)).float()
    per_token = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none"
    )
    return per_token.view(len(ids), -1).mean(dim=1).sum() / total


def _hyper() -> dict:
    adamw = EXPECTED["adamw"]
    return {**adamw, "betas": tuple(adamw["betas"])}


def _losses(step, loss_now) -> list[float]:  # noqa: ANN001
    """The loss at the resumed state, then after one step on the same batch."""
    first = loss_now(grad=True)
    step()
    return [first, loss_now(grad=False)]


def test_nereus_resumes_unsharded_with_deepspeeds_next_losses(imported: Path) -> None:
    from nereus_lightning.emu.dcp_state import load_tensors
    from nereus_lightning.lightning.stage_step import step_stage
    from nereus_lightning.models import ReplicaComm, ShardedCausalLM, bind_adamw
    from nereus_lightning.models.optim import fresh_adamw_state

    names = {n: p for n, p in _model().named_parameters()}
    state = {f"param/{n}": torch.zeros_like(p.detach()) for n, p in names.items()}
    optim = {n: fresh_adamw_state(state[f"param/{n}"]) for n in names}
    load_tensors(state | {f"{k}/{n}": t for n in names for k, t in optim[n].items()}, imported, alone=True)
    module = ShardedCausalLM(_config(), ReplicaComm.single(), {n: state[f"param/{n}"] for n in names})
    opt = bind_adamw(module, optim, **_hyper())
    ids = _sequences()

    def loss_now(grad: bool) -> float:
        with torch.set_grad_enabled(grad):
            loss = _loss(module, ids, len(ids))
        if grad:
            loss.backward()
        return float(loss.detach())

    got = _losses(lambda: step_stage(module, opt, EXPECTED["gradient_clipping"]), loss_now)
    want = [EXPECTED["loss_at_resume"], EXPECTED["loss_after_next_step"]]
    assert got[1] < got[0]
    for a, b in zip(got, want, strict=True):
        assert abs(a - b) <= TOLERANCE, (got, want)


def _sharded(rank: int, world: int, stage: str) -> dict[str, list[float]]:
    """Resume ``stage`` at shard 2 x TP2 (ZeRO-2) and shard 4 x TP1 (ZeRO-1); each shard rank computes its
    own sequences of the batch, the shard group sums the gradients."""

    from nereus_lightning.emu.dcp_state import load_tensors, zero_state_dict
    from nereus_lightning.models import ReplicaComm, ShardedCausalLM
    from nereus_lightning.models.groups import group_for, replica_groups
    from nereus_lightning.models.optim import fresh_adamw_state
    from nereus_lightning.models.sharded import shard_state
    from nereus_lightning.models.zero import ShardGroup, ZeroShards, cut_rows
    from nereus_lightning.plan.layout import Layout

    config, model = _config(), _model()
    replica_groups([(0, 1), (2, 3)], Layout(2, 1))  # every rank, same order
    group_for((0, 1, 2, 3))
    out = {}
    for label, layout, zero, peers, mesh in (
        ("shard2_tp2_z2", Layout(2, 1), 2, (rank % 2, rank % 2 + 2), [[0, 2], [1, 3]]),
        ("shard4_z1", Layout(), 1, (0, 1, 2, 3), [[0, 1, 2, 3]]),
    ):
        comm = ReplicaComm.of(
            tuple(r for r in range(4) if r // layout.size == rank // layout.size), layout, rank
        )
        shards = ShardGroup(zero, peers, rank, group_for(peers))
        full = shard_state(model, config, layout, 0, comm.tp_rank)
        module = ShardedCausalLM(config, comm, {n: torch.zeros_like(t) for n, t in full.items()})
        optim = {
            n: fresh_adamw_state(cut_rows(p.detach(), shards.shard, shards.shard_rank))
            for n, p in module.named_parameters()
        }
        zs = ZeroShards(module, shards, None, optim, **_hyper())
        load_tensors(zero_state_dict(zs, torch.tensor(mesh)), stage)
        out[label] = _shard_losses(module, zs, _sequences())
    return out


def _shard_losses(module, zs, ids: torch.Tensor) -> list[float]:  # noqa: ANN001
    """:func:`_losses` of a sharded replica: each shard rank takes its share of the sequences ``ids``."""
    import torch.distributed as dist

    mine = ids.chunk(zs.shards.shard)[zs.shards.shard_rank]

    def loss_now(grad: bool) -> float:
        with torch.set_grad_enabled(grad):
            loss = _loss(module, mine, len(ids))
        if grad:
            loss.backward()
        summed = loss.detach().clone()
        dist.all_reduce(summed, group=zs.shards.group)
        return float(summed)

    return _losses(lambda: zs.step(EXPECTED["gradient_clipping"], None), loss_now)


@pytest.mark.distributed
def test_nereus_resumes_sharded_with_deepspeeds_next_losses(imported: Path, dist4) -> None:
    want = [EXPECTED["loss_at_resume"], EXPECTED["loss_after_next_step"]]
    for rank, out in enumerate(dist4.run(_sharded, str(imported))):
        for label, got in out.items():
            for a, b in zip(got, want, strict=True):
                assert abs(a - b) <= TOLERANCE, (rank, label, got, want)


def test_export_reads_back_as_the_state_it_came_from(imported: Path, tmp_path: Path) -> None:
    from nereus_lightning.lightning.deepspeed_universal import (
        LATEST,
        export_universal,
        read_stage,
        read_universal,
    )

    folder = export_universal(imported, tmp_path / "ds", _config())
    assert (tmp_path / "ds" / LATEST).read_text() == folder.name == "global_step2"
    exported, original = read_universal(tmp_path / "ds"), read_universal(FIXTURE / "universal")
    assert exported.keys() == original.keys() == read_stage(imported).keys()
    for name, entry in original.items():
        for key, tensor in entry.items():
            assert torch.equal(exported[name][key], tensor), (name, key)


def test_import_refuses_other_names_and_shapes(tmp_path: Path) -> None:
    import transformers as tf

    from nereus_lightning.lightning.deepspeed_universal import import_universal
    from nereus_lightning.spec.errors import CheckpointError

    values = json.loads((FIXTURE / "config.json").read_text())
    values.pop("layer_types")
    other = tf.AutoConfig.for_model(
        values.pop("model_type"), **{**values, "vocab_size": 48, "num_hidden_layers": 2}
    )
    with pytest.raises(CheckpointError) as err:
        import_universal(FIXTURE / "universal", tmp_path / "out", other)
    message = str(err.value)
    assert "missing ['model.layers.1." in message
    assert "model.embed_tokens.weight (32, 8) (the model: (48, 8))" in message
    assert not (tmp_path / "out").exists()


def test_cli_names_what_a_wrong_folder_lacks(tmp_path: Path, capsys) -> None:
    from nereus_lightning.cli.convert_checkpoint import main

    with pytest.raises(SystemExit) as exit_:
        main(["from-deepspeed", str(tmp_path), "--config", str(FIXTURE), "--output", str(tmp_path / "out")])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "not a DeepSpeed universal checkpoint" in err and "zero/<parameter>/fp32.pt" in err
    assert "latest_universal" in err


def test_cli_round_trip(tmp_path: Path, capsys) -> None:
    from nereus_lightning.cli.convert_checkpoint import main
    from nereus_lightning.lightning.deepspeed_universal import read_universal

    stage, ds = tmp_path / "emu" / "actor_train", tmp_path / "ds"
    for argv in (
        ["from-deepspeed", str(FIXTURE / "universal"), "--config", str(FIXTURE), "--output", str(stage)],
        ["to-deepspeed", str(stage), "--config", str(FIXTURE), "--output", str(ds)],
    ):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 0, capsys.readouterr().err
    back, original = read_universal(ds), read_universal(FIXTURE / "universal")
    assert all(torch.equal(back[n][k], t) for n, e in original.items() for k, t in e.items())


@pytest.mark.deepspeed
@pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None,
    reason="deepspeed is not installed (DS_BUILD_OPS=0 pip install deepspeed; or run `nox -s deepspeed`)",
)
def test_deepspeed_resumes_the_export_with_its_own_losses(imported: Path, tmp_path: Path) -> None:
    from nereus_lightning.lightning.deepspeed_universal import export_universal

    export_universal(imported, tmp_path / "ds", _config())
    script = FIXTURE / "make_fixture.py"
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, str(script), "--resume", str(tmp_path / "ds"), "29583"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    for key in ("loss_at_resume", "loss_after_next_step"):
        assert abs(got[key] - EXPECTED[key]) <= TOLERANCE, (got, EXPECTED)


@pytest.mark.distributed
def test_a_trained_nereus_checkpoint_goes_out_and_back(saved, tmp_path: Path, capsys) -> None:  # noqa: F811
    """A PPO run's checkpoint: to-deepspeed (verified, the config from ``hf/actor``) holds the actor's
    state, and from-deepspeed gives it back."""
    from nereus_lightning.cli.convert_checkpoint import main
    from nereus_lightning.lightning.deepspeed_universal import read_stage, read_universal

    stage = saved / "s2.ckpt" / "emu" / "actor_train"
    config = saved / "s2.ckpt" / "hf" / "actor"
    back = tmp_path / "back" / "actor_train"
    for argv in (
        ["to-deepspeed", str(saved / "s2.ckpt"), "--output", str(tmp_path / "ds")],
        ["from-deepspeed", str(tmp_path / "ds"), "--config", str(config), "--output", str(back)],
    ):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 0, capsys.readouterr().err
    original, exported, again = read_stage(stage), read_universal(tmp_path / "ds"), read_stage(back)
    assert original.keys() == exported.keys() == again.keys()
    assert float(next(iter(original.values()))["step"]) == 2
    for name, entry in original.items():
        for key, tensor in entry.items():
            assert torch.equal(exported[name][key], tensor) and torch.equal(again[name][key], tensor), (
                name,
                key,
            )


def _universal_of(model, root: Path) -> None:  # noqa: ANN001
    """A universal checkpoint of ``model`` as ``ds_to_universal`` lays it out (moments: seeded noise)."""
    folder = root / "step3"
    generator = torch.Generator().manual_seed(3)
    for name, param in model.named_parameters():
        (folder / "zero" / name).mkdir(parents=True)
        for key in ("fp32", "exp_avg", "exp_avg_sq"):
            value = param.detach() if key == "fp32" else torch.rand(param.shape, generator=generator)
            torch.save({"param": value, "cat_dim": 0}, folder / "zero" / name / f"{key}.pt")
        torch.save(torch.tensor(3.0), folder / "zero" / name / "step.pt")
    (root / "latest_universal").write_text("step3")


#: Phi-3's default token ids (32000) lie outside the tiny vocabulary.
NO_IDS = {"pad_token_id": None, "bos_token_id": None, "eos_token_id": None}


def test_a_fused_family_maps_rows_both_ways(tmp_path: Path) -> None:
    """Phi-3 holds q|k|v and gate|up in one weight each: imported, a nereus unit computes the transformers
    model's logits; bf16 imports the weights as masters; exported, the files are the model's again."""
    from nereus_lightning.emu.dcp_state import read_params_from_masters
    from nereus_lightning.lightning.deepspeed_universal import (
        export_universal,
        import_universal,
        read_universal,
    )
    from nereus_lightning.lightning.hf_export import logical_params
    from nereus_lightning.models import ReplicaComm, ShardedCausalLM
    from nereus_lightning.testing.tiny import tiny_config, tiny_model

    fields = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, **NO_IDS}
    config, model = tiny_config("phi3", **fields), tiny_model("phi3", **fields)
    _universal_of(model, tmp_path / "ds")
    stage = import_universal(tmp_path / "ds", tmp_path / "actor_train", config)
    module = ShardedCausalLM(config, ReplicaComm.single(), logical_params(str(stage)))
    ids = torch.randint(0, config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(module(ids), model(ids).logits, atol=1e-5)
    low = import_universal(tmp_path / "ds", tmp_path / "bf16", config, torch.bfloat16)
    assert set(read_params_from_masters(low).values()) == {torch.bfloat16}
    assert all(p.dtype == torch.bfloat16 for p in logical_params(str(low)).values())
    export_universal(low, tmp_path / "back", config)
    back, original = read_universal(tmp_path / "back"), read_universal(tmp_path / "ds")
    assert back.keys() == original.keys() and any(".qkv_proj." in n for n in back)
    for name, entry in original.items():
        for key, tensor in entry.items():
            assert torch.equal(back[name][key], tensor), (name, key)
