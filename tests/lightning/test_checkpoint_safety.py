"""Checkpoints that run no code when loaded, are written
atomically, hold finite state only and name damage.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from nereus_lightning.lightning.checkpoint import (
    LEGACY_META_FILE,
    META_FILE,
    decode,
    encode,
    latest_checkpoint,
    read_checkpoint,
)
from nereus_lightning.plan.layout import Candidate, Layout, Plan
from nereus_lightning.spec.errors import CheckpointError
from tests.lightning.helpers import fit, small_task


class Payload:
    """Unpickling this creates ``marker``: what a hostile checkpoint would do."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):  # noqa: ANN204
        return (open, (self.marker, "w"))


def payload_pickle(marker: Path) -> bytes:
    """A pickle that creates ``marker`` when loaded; checked to do so, so the tests below can fail."""
    probe = marker.with_name(marker.name + ".probe")
    pickle.loads(pickle.dumps(Payload(probe))).close()
    assert probe.exists()
    return pickle.dumps(Payload(marker))


def same(a, b) -> bool:  # noqa: ANN001
    """Equal values of equal types all the way down (tensors: dtype, shape and values, NaN == NaN)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return (
            a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a.isnan(), b.isnan())
            and torch.equal(torch.nan_to_num(a), torch.nan_to_num(b))
        )
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and math.isnan(a):
        return math.isnan(b)
    return a == b


def through_json(value):  # noqa: ANN001, ANN201
    """``value`` encoded, written as strict JSON text, read back and decoded."""
    return decode(json.loads(json.dumps(encode(value), allow_nan=False)))


# ---- the JSON metadata ----------------------------------------------------------------------------
def test_metadata_values_round_trip_exactly():
    plan = Plan.of({"actor_train": Candidate(Layout(2, 1), 2, (0, 1, 2, 3), micro_batch=2, recompute=True)})
    value = {
        "epoch": 3,
        "scores": [0.1, float("inf"), float("-inf"), float("nan"), 1e-310, 2.0**60 + 1.0],
        "kth_value": torch.tensor(float("inf")),
        "tensors": [
            torch.tensor([[1.5, float("nan")], [-0.0, 3.25]]),
            torch.tensor([1.0, 2.5e38], dtype=torch.bfloat16),
            torch.arange(6, dtype=torch.int64).reshape(2, 3),
            torch.tensor([True, False]),
            torch.empty(0, 3),
        ],
        "pool": (0, 1, (2, 3)),
        "plan": plan,
        "by_step": {1: "a", (2, 3): "b"},
        "looks_tagged": {"__tuple__": [1, 2]},
        "none": None,
        "flag": False,
        "nereus_data": {"epoch": 1, "position": 17, "order": [3, 1, 2]},
    }
    back = through_json(value)
    assert same(back, value)
    assert back["plan"] == plan and isinstance(back["pool"][2], tuple)


def test_a_value_json_cannot_hold_is_refused_naming_its_key():
    with pytest.raises(
        CheckpointError, match=r"callbacks\.Mine\.score_fn: a builtins\.function cannot be stored"
    ):
        encode({"callbacks": {"Mine": {"score_fn": lambda x: x}}})
    with pytest.raises(CheckpointError, match=r"hyper_parameters\.raw: a builtins\.bytes"):
        encode({"hyper_parameters": {"raw": b"\x00"}})


@pytest.mark.parametrize(
    "cls", ["subprocess:Popen", "os:system", "nereus_lightning.lightning.checkpoint:shutil.rmtree"]
)
def test_decoding_builds_only_nereus_dataclasses(tmp_path, cls):
    marker = tmp_path / "marker"
    hostile = {
        "__dataclass__": {"type": cls, "fields": {"args": ["touch", str(marker)], "path": str(tmp_path)}}
    }
    with pytest.raises(CheckpointError, match=r"checkpoint\.x: refers to .*; only the record types"):
        decode({"x": hostile})
    assert not marker.exists() and tmp_path.exists()


def test_controller_state_round_trips_exactly_through_the_callback_state():
    from nereus_lightning.control import Controller
    from nereus_lightning.lightning import NereusCallback
    from nereus_lightning.plan.calibration import Calibration
    from tests.control import fakes

    a, b = fakes.gen_plan(1, 4), fakes.gen_plan(2, 4)
    backend = fakes.FakeBackend([a, b], {a: 10.0, b: 5.0}, tran={b: 2.0}, op_time={"training.gemm": 4.0})

    def controller() -> Controller:
        return fakes.controller(backend, a, calibration=Calibration())

    ctl = controller()
    for step, length in enumerate(
        [1000, 1000, 1500, 1500, 2300, 2300, 3500]
    ):  # drift crossings: H_x EMAs move
        op_time = {"training.gemm": 6.0 + step / 3}
        ctl.step(fakes.sig(step, length=length, op_time=op_time, transition_time=0.7 * (step > 3)))
    state = ctl.state_dict()
    assert state["drift"]["response_len"]["clock"]["ema"] is not None  # the test covers a learned H_x
    assert state["calibration"]["count"]["training.gemm"] > 0 and state["transition_scale"] != 1.0
    callback = NereusCallback(controller=ctl)
    callback.controller = ctl
    callback.history = [{"step": 0.0, "actor/pg_loss": float("nan")}]
    saved = callback.state_dict()
    loaded = through_json({"callbacks": {"NereusCallback": saved}})["callbacks"]["NereusCallback"]
    assert same(loaded, saved)
    fresh = NereusCallback(controller=controller())
    fresh.load_state_dict(loaded)
    fresh.controller = controller()
    fresh.controller.load_state_dict(fresh._restored)
    assert same(fresh.controller.state_dict(), state)
    assert fresh.controller.drift["response_len"].reference == ctl.drift["response_len"].reference


# ---- damaged and hostile checkpoint directories ---------------------------------------------------
@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """Two PPO steps on 2 gloo ranks, checkpoints s1.ckpt, s2.ckpt and last.ckpt (read-only for the tests)."""
    root = tmp_path_factory.mktemp("saved")
    fit(str(root), devices=2, max_steps=2, every=1, last=True)
    return root / "ckpt"


def copy_of(saved: Path, tmp_path: Path, name: str = "s2.ckpt") -> Path:
    return Path(shutil.copytree(saved / name, tmp_path / name))


def record_size(ckpt: Path, name: str) -> None:
    """Make ``nereus_meta.json`` agree with the current size and content of ``name`` (as a forger would)."""
    from nereus_lightning.lightning.integrity import file_digest

    doc = json.loads((ckpt / META_FILE).read_text())
    doc["files"][name] = {"size": (ckpt / name).stat().st_size, "sha256": file_digest(ckpt / name)}
    (ckpt / META_FILE).write_text(json.dumps(doc))


@pytest.mark.distributed
def test_a_saved_checkpoint_reads_back_and_is_the_newest(saved):
    stored = read_checkpoint(saved / "s2.ckpt")
    assert stored.state == "emu" and stored.checkpoint["global_step"] == 2
    assert "NereusCallback" in stored.checkpoint["callbacks"]
    assert latest_checkpoint(saved) in (str(saved / "s2.ckpt"), str(saved / "last.ckpt"))
    assert not list(saved.glob(".*"))  # no staging directory left behind
    assert not list(saved.rglob(LEGACY_META_FILE))


@pytest.mark.distributed
def test_pickled_legacy_metadata_is_refused_unread(saved, tmp_path):
    ckpt = copy_of(saved, tmp_path)
    marker = tmp_path / "pwned"
    (ckpt / META_FILE).unlink()
    (ckpt / LEGACY_META_FILE).write_bytes(payload_pickle(marker))
    with pytest.raises(Exception, match=r"nereus_meta\.pt\) is a pickle.*nereus-convert-checkpoint"):
        fit(str(tmp_path / "b"), devices=2, max_steps=3, ckpt_path=str(ckpt))
    assert not marker.exists()
    from nereus_lightning.cli.convert_checkpoint import convert

    with pytest.raises(CheckpointError, match=r"nereus_meta\.pt: cannot be converted.*refused"):
        convert(ckpt)  # even the converter builds only the types an older checkpoint held
    assert not marker.exists()


@pytest.mark.distributed
def test_a_pickle_payload_in_dcp_metadata_is_refused_unread(saved, tmp_path):
    ckpt = copy_of(saved, tmp_path)
    marker = tmp_path / "pwned"
    (ckpt / "emu" / "actor_train" / ".metadata").write_bytes(payload_pickle(marker))
    record_size(ckpt, "emu/actor_train/.metadata")
    with pytest.raises(Exception, match=r"emu/actor_train/\.metadata: damaged DCP metadata .*refused"):
        fit(str(tmp_path / "b"), devices=2, max_steps=3, ckpt_path=str(ckpt))
    assert not marker.exists()


@pytest.mark.distributed
def test_a_truncated_shard_is_named_before_anything_loads(saved, tmp_path):
    ckpt = copy_of(saved, tmp_path)
    shard = ckpt / "emu" / "critic_train" / "__1_0.distcp"
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size // 2)
    with pytest.raises(
        Exception, match=r"emu/critic_train/__1_0\.distcp: damaged: \d+ bytes, the checkpoint recorded"
    ):
        fit(str(tmp_path / "b"), devices=2, max_steps=3, ckpt_path=str(ckpt))
    record_size(ckpt, "emu/critic_train/__1_0.distcp")  # a forged size: DCP's own metadata still disagrees
    with pytest.raises(CheckpointError, match=r"critic_train/__1_0\.distcp: truncated: \d+ bytes"):
        read_checkpoint(ckpt)
    assert latest_checkpoint(tmp_path) is None


@pytest.mark.distributed
@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda c: (c / "emu" / "actor_gen" / ".metadata").unlink(), r"actor_gen/\.metadata: missing"),
        (
            lambda c: (c / META_FILE).write_text('{"format": "nereus-checkpoint", "format_'),
            r"nereus_meta\.json: damaged",
        ),
        (
            lambda c: (c / META_FILE).unlink(),
            r"is not a Nereus checkpoint directory \(no nereus_meta\.json\)",
        ),
        (
            lambda c: (c / META_FILE).write_text(
                (c / META_FILE).read_text().replace('_version": 2', '_version": 3')
            ),
            r"nereus_meta\.json: checkpoint format version 3; this nereus-lightning reads version 2",
        ),
    ],
)
def test_damaged_metadata_names_the_file(saved, tmp_path, damage, message):
    ckpt = copy_of(saved, tmp_path)
    damage(ckpt)
    with pytest.raises(CheckpointError, match=message):
        read_checkpoint(ckpt)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP's note on one-process use
def test_a_corrupt_shard_of_the_right_size_names_the_file(tmp_path):
    from nereus_lightning.emu.dcp_state import load_tensors, save_tensors

    save_tensors({"w": torch.arange(64, dtype=torch.float32)}, tmp_path / "c")
    shard = max((tmp_path / "c").glob("*.distcp"), key=lambda f: f.stat().st_size)  # the one with data
    shard.write_bytes(b"\x07" * shard.stat().st_size)
    with pytest.raises(CheckpointError, match=rf"{shard.name}: damaged"):
        load_tensors({"w": torch.zeros(64)}, tmp_path / "c")


@pytest.mark.distributed
def test_an_older_checkpoint_converts_and_resumes(saved, tmp_path):
    from nereus_lightning.cli.convert_checkpoint import main

    ckpt = copy_of(saved, tmp_path)
    stored = read_checkpoint(ckpt)
    (ckpt / META_FILE).unlink()
    legacy = dict(stored.checkpoint, nereus_state="emu")  # what the older save_checkpoint pickled
    (ckpt / LEGACY_META_FILE).write_bytes(pickle.dumps(legacy))
    with pytest.raises(CheckpointError, match="nereus-convert-checkpoint"):
        read_checkpoint(ckpt)
    with pytest.raises(SystemExit) as done:
        main([str(ckpt)])
    assert done.value.code == 0
    assert same(read_checkpoint(ckpt).checkpoint, stored.checkpoint)
    trainer, rows = fit(str(tmp_path / "b"), devices=2, max_steps=3, ckpt_path=str(ckpt))
    assert [int(float(r["step"])) for r in rows] == [2]


# ---- atomic and finite saves ----------------------------------------------------------------------
@pytest.mark.distributed
def test_a_crash_mid_save_leaves_the_previous_last_ckpt_whole(tmp_path, monkeypatch):
    import nereus_lightning.emu.dcp_state as emu_checkpoint

    real, stages_saved = emu_checkpoint.save_tensors, []

    def save_then_die(state: dict, path: str, **group: object) -> None:
        real(state, path, **group)
        if ".last.ckpt.partial" in str(path):
            model_stage = os.path.basename(path)
            if model_stage in stages_saved:  # the second save of last.ckpt, one model-stage written
                os._exit(3)
            stages_saved.append(model_stage)

    monkeypatch.setattr(emu_checkpoint, "save_tensors", save_then_die)  # the forked ranks inherit it
    with pytest.raises(Exception, match="exit code|terminated|signal"):
        fit(str(tmp_path / "a"), devices=2, max_steps=3, every=1, last=True)
    monkeypatch.undo()
    ckpts = tmp_path / "a" / "ckpt"
    assert (ckpts / ".last.ckpt.partial").is_dir()  # the interrupted save
    assert read_checkpoint(ckpts / "last.ckpt").checkpoint["global_step"] == 1  # the previous one, whole
    assert latest_checkpoint(ckpts) == str(ckpts / "s2.ckpt")
    trainer, rows = fit(str(tmp_path / "b"), devices=2, max_steps=2, ckpt_path=str(ckpts / "last.ckpt"))
    assert trainer.state.finished and [int(float(r["step"])) for r in rows] == [1]


@pytest.mark.distributed
@pytest.mark.parametrize(
    "precision, poison, problem",
    [
        ("32-true", float("nan"), r"non-finite values .* in actor_train/model\.norm\.weight \(rank 1\)"),
        # bf16 training weights are stored as their fp32 masters: one changed outside the step would not
        # come back, so it is named instead.
        (
            "bf16-mixed",
            3.0,
            r"parameters that are not their fp32 master rounded: actor_train/model\.norm\.weight \(rank 1\)",
        ),
    ],
)
def test_a_checkpoint_that_would_not_give_the_state_back_is_refused_on_every_rank(
    tmp_path, precision, poison, problem
):
    from nereus_lightning.lightning import PPOModule

    class Poisoned(PPOModule):
        def rl_step(self, step, strategy, optimizer=None):  # noqa: ANN001, ANN202
            out = super().rl_step(step, strategy, optimizer)
            if step == 1 and torch.distributed.get_rank() == 1:
                unit = strategy.units._local("actor_train")
                unit.params["model.norm.weight"][0] = poison
            return out

    module = Poisoned(task=small_task(), seed=3, prompts_per_step=8)
    with pytest.raises(Exception, match=rf"s2\.ckpt not written: {problem}"):
        fit(str(tmp_path / "a"), devices=2, max_steps=3, every=1, module=module, precision=precision)
    ckpts = tmp_path / "a" / "ckpt"
    assert sorted(p.name for p in ckpts.iterdir()) == ["s1.ckpt"]
    assert latest_checkpoint(ckpts) == str(ckpts / "s1.ckpt")


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP's note on one-process use
def test_weights_stored_as_masters_read_back_rounded_and_a_missing_one_is_named(tmp_path):
    from nereus_lightning.emu.dcp_state import PARAMS_FROM_MASTERS, save_tensors
    from nereus_lightning.lightning.hf_export import logical_params

    norm, master = torch.rand(8), torch.randn(4, 8)
    stage = tmp_path / "actor_train"
    state = {"param/norm": norm, "master/w": master, "exp_avg/w": torch.zeros(4, 8)}
    save_tensors({**state, "counters": torch.zeros(6, dtype=torch.int64)}, stage)
    record = stage / PARAMS_FROM_MASTERS
    record.write_text(json.dumps({"params_from_masters": {"w": "bfloat16"}}))
    params = logical_params(str(stage))
    assert params.keys() == {"norm", "w"} and torch.equal(params["norm"], norm)
    assert params["w"].dtype == torch.bfloat16 and torch.equal(params["w"], master.to(torch.bfloat16))
    # A weight named by the record that the checkpoint lacks, a master without a dtype, a damaged record.
    record.write_text(json.dumps({"params_from_masters": {"w": "bfloat16", "v": "bfloat16"}}))
    with pytest.raises(CheckpointError, match=r"train/\.metadata: holds neither 'param/v' nor 'master/v'"):
        logical_params(str(stage))
    record.unlink()
    with pytest.raises(
        CheckpointError,
        match=r"train/\.metadata: holds 'master/w' but not 'param/w', and .*/params_from_masters\.json does",
    ):
        logical_params(str(stage))
    record.write_text('{"params_from_masters": {"w": "int4x"}}')
    with pytest.raises(CheckpointError, match=r"actor_train/params_from_masters\.json: damaged"):
        logical_params(str(stage))


def test_a_damaged_weights_record_is_named(tmp_path):
    from nereus_lightning.lightning.unit_checkpoints import WEIGHTS_FROM, read_weights_from
    from nereus_lightning.plan.layout import Candidate, Layout, Plan

    plan = Plan.of({n: Candidate(Layout(1, 1), 1, (0,)) for n in ("actor_gen", "actor_train")})
    (tmp_path / "actor_gen").mkdir()
    (tmp_path / "actor_gen" / WEIGHTS_FROM).write_text('{"weights_from": "actor_train"}')
    assert read_weights_from(str(tmp_path), plan) == {"actor_gen": "actor_train"}
    (tmp_path / "actor_gen" / WEIGHTS_FROM).write_text('{"weights_from": 3}')
    with pytest.raises(CheckpointError, match=r"actor_gen/weights_from\.json: damaged"):
        read_weights_from(str(tmp_path), plan)


# ---- verified contents ----------------------------------------------------------------------------
def forge(ckpt: Path) -> None:
    """Re-record every file's size and SHA-256 in ``nereus_meta.json``, as someone rewriting it would."""
    from nereus_lightning.lightning.integrity import file_digest

    doc = json.loads((ckpt / META_FILE).read_text())
    doc["files"] = {
        p.relative_to(ckpt).as_posix(): {"size": p.stat().st_size, "sha256": file_digest(p)}
        for p in sorted(ckpt.rglob("*"))
        if p.is_file() and not p.is_symlink() and p.name != META_FILE
    }
    (ckpt / META_FILE).write_text(json.dumps(doc))


def flip_64_bytes(saved: Path, ckpt: Path) -> str:
    name = "emu/actor_train/__0_0.distcp"
    with open(ckpt / name, "r+b") as f:
        f.seek(100)
        data = f.read(64)
        f.seek(100)
        f.write(bytes(b ^ 0xFF for b in data))
    return rf"{name}: damaged: its content is not what nereus_meta\.json recorded"


def shard_of_another_checkpoint(saved: Path, ckpt: Path) -> str:
    name = "emu/critic_train/__1_0.distcp"
    shutil.copy(saved / "s1.ckpt" / name, ckpt / name)
    return rf"{name}: damaged: its content is not what nereus_meta\.json recorded"


def metadata_of_another_step(saved: Path, ckpt: Path) -> str:
    shutil.copy(saved / "s1.ckpt" / META_FILE, ckpt / META_FILE)
    return r"s2\.ckpt/nereus_meta\.json: does not describe the files beside it: \d+ of \d+ files differ"


@pytest.mark.distributed
@pytest.mark.parametrize("damage", [flip_64_bytes, shard_of_another_checkpoint, metadata_of_another_step])
def test_changed_contents_are_refused_before_training_naming_the_file(saved, tmp_path, damage):
    ckpt = copy_of(saved, tmp_path)
    assert (ckpt / "emu" / "critic_train" / "__1_0.distcp").stat().st_size == (
        saved / "s1.ckpt" / "emu" / "critic_train" / "__1_0.distcp"
    ).stat().st_size  # same sizes: only the contents tell them apart
    message = damage(saved, ckpt)
    with pytest.raises(Exception, match=message):
        fit(str(tmp_path / "b"), devices=2, max_steps=3, ckpt_path=str(ckpt))
    assert not fit_rows(tmp_path / "b")  # no step ran


def fit_rows(folder: Path) -> list:
    import csv

    return [
        r for f in folder.rglob("metrics.csv") for r in csv.DictReader(open(f)) if r.get("critic/score/mean")
    ]


@pytest.mark.distributed
def test_a_metadata_file_of_another_step_with_forged_hashes_is_caught_by_the_step_in_the_tensors(
    saved, tmp_path
):
    ckpt = copy_of(saved, tmp_path)
    shutil.copy(saved / "s1.ckpt" / META_FILE, ckpt / META_FILE)
    forge(ckpt)  # every hash now matches: only the step stored inside the tensors disagrees
    with pytest.raises(
        CheckpointError, match=r"emu/\w+: its tensors were saved at step 2, but .* says step 1"
    ):
        read_checkpoint(ckpt)


@pytest.mark.distributed
@pytest.mark.parametrize("target", ["emu/critic_train/__0_0.distcp", "hf", "emu/actor_gen"])
def test_a_symbolic_link_anywhere_in_a_checkpoint_is_refused(saved, tmp_path, target):
    ckpt = copy_of(saved, tmp_path)
    remove_path(ckpt / target)
    (ckpt / target).symlink_to(saved / "s1.ckpt" / target)
    with pytest.raises(CheckpointError, match=rf"{target}: a symbolic link \(to .*s1\.ckpt"):
        read_checkpoint(ckpt)
    assert latest_checkpoint(tmp_path) is None


def remove_path(path: Path) -> None:
    shutil.rmtree(path) if path.is_dir() else path.unlink()


@pytest.mark.distributed
@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda c: c.update(global_step=1e30), r"global_step: 1e\+30 is not a whole number"),
        (lambda c: c.update(global_step="2"), r"global_step: '2' is not a whole number"),
        (
            lambda c: c["loops"]["fit_loop"]["epoch_loop.manual_optimization.optim_step_progress"][
                "total"
            ].update(completed=10**30),
            r"optim_step_progress'\]\.total\.completed: 10{30} is not a whole number",
        ),
        (
            lambda c: c["callbacks"]["NereusCallback"]["controller"]["plan"]["__dataclass__"]["fields"][
                "assignments"
            ]["__tuple__"][0]["__tuple__"][1]["__dataclass__"]["fields"]["gpus"].update(__tuple__=[-1, 1]),
            r"controller\.plan\[0\]\.gpus\[0\]: -1 is not a whole number",
        ),
    ],
    ids=["step_1e30", "step_text", "loop_counter", "plan_gpu"],
)
def test_values_no_run_could_save_are_refused_naming_the_field(saved, tmp_path, edit, message):
    ckpt = copy_of(saved, tmp_path)
    doc = json.loads((ckpt / META_FILE).read_text())
    edit(doc["checkpoint"])
    (ckpt / META_FILE).write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match=rf"s2\.ckpt/nereus_meta\.json: checkpoint\..*{message}"):
        read_checkpoint(ckpt)
    assert latest_checkpoint(tmp_path) is None  # the finder skips it (it does not crash on it)


# ---- DCP metadata: records only, sizes backed by data ---------------------------------------------
def build_on(module: str, name: str, attribute: str) -> bytes:
    """A pickle that pushes the class ``module.name`` and BUILDs it with ``{attribute: "x"}`` as slot state:
    ``setattr(cls, attribute, "x")`` for the whole process under the standard unpickler."""
    return (
        b"\x80\x02c"
        + f"{module}\n{name}\n".encode()
        + b"N}X"
        + len(attribute).to_bytes(4, "little")
        + attribute.encode()
        + b"X\x01\x00\x00\x00xs\x86b."
    )


@pytest.mark.parametrize(
    "module, name",
    [("torch.distributed.checkpoint.metadata", "Metadata"), ("pathlib", "PosixPath")],
)
def test_a_metadata_file_cannot_change_a_class(tmp_path, module, name):
    import importlib

    from nereus_lightning.emu.dcp_state import read_dcp_metadata

    cls = getattr(importlib.import_module(module), name)
    hostile = build_on(module, name, "nereus_hostile")
    pickle.loads(hostile)  # the standard unpickler does set the attribute: the file is a real attack
    assert cls.nereus_hostile == "x"
    del cls.nereus_hostile
    (tmp_path / ".metadata").write_bytes(hostile)
    with pytest.raises(
        CheckpointError, match=rf"damaged DCP metadata .*sets attributes of the class .*{name}"
    ):
        read_dcp_metadata(tmp_path)
    assert not hasattr(cls, "nereus_hostile")


def dcp_metadata(size: tuple, chunk: tuple, length: int):  # noqa: ANN201
    """DCP metadata of one fp32 tensor ``w`` of ``size``: one chunk of ``chunk`` in ``length`` bytes."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    zero = torch.Size([0] * len(size))
    entry = TensorStorageMetadata(
        TensorProperties(dtype=torch.float32),
        torch.Size(size),
        [ChunkStorageMetadata(zero, torch.Size(chunk))],
    )
    return Metadata(
        {"w": entry}, storage_data={MetadataIndex("w", zero, 0): _StorageInfo("__0_0.distcp", 0, length)}
    )


@pytest.mark.parametrize(
    "size, chunk, length, message",
    [
        (
            (1 << 30, 1 << 30),
            (1 << 30, 1 << 30),
            64,
            r"w\.size: \(1073741824, 1073741824\) is not a tensor of at most",
        ),
        (
            (1000, 1000),
            (1000, 1000),
            64,
            r"w\.chunks\[0\] declares 4000000 bytes of torch\.float32 but its data files hold 64",
        ),
        ((4, 4), (4, 8), 64, r"w\.chunks\[0\]: .* is not a chunk inside the tensor's \(4, 4\)"),
        ((8,), (4,), 64, r"w: its chunks hold 4 of its 8 elements"),
    ],
    ids=["absurd_size", "size_beyond_data", "chunk_outside", "chunks_short"],
)
def test_sizes_the_data_does_not_back_are_refused_before_anything_is_allocated(
    tmp_path, size, chunk, length, message
):
    from nereus_lightning.emu.dcp_state import read_dcp_metadata
    from nereus_lightning.lightning.hf_export import logical_params

    (tmp_path / ".metadata").write_bytes(pickle.dumps(dcp_metadata(size, chunk, length)))
    (tmp_path / "__0_0.distcp").write_bytes(b"\0" * length)
    with pytest.raises(CheckpointError, match=rf"\.metadata: {message}"):
        read_dcp_metadata(tmp_path)
    with pytest.raises(CheckpointError, match=message):
        logical_params(str(tmp_path))  # (what allocated the declared sizes before)
