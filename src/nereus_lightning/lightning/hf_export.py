"""Hugging Face folders from Nereus checkpoints: ``save_pretrained`` (safetensors) plus the tokenizer.

A checkpoint keeps each trainable model's logical state in its training model-stage's DCP
directory (``emu/actor_train``, ``emu/critic_train``) and, written at save time, the model's
``config.json`` and tokenizer in ``hf/<model>/``. :func:`export_model` reads the parameters back
on one process, whatever the layout they were saved from, and writes ``model.safetensors``, so
``from_pretrained`` gives back the logical parameters bit for bit: into a checkpoint being written
(:func:`write_hf_into`), or from a finished one into a folder of the user's (:func:`export_hf`, which
trusts nothing in the checkpoint).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from nereus_lightning.lightning.checkpoint import remove, replace_path
from nereus_lightning.rl.tokenizer import ByteTokenizer
from nereus_lightning.spec.errors import CheckpointError, NereusConfigError

#: Trainable model -> the model-stage that holds its freshest state.
TRAINED = {"actor": "actor_train", "critic": "critic_train"}
HF_DIR = "hf"


def write_hf_metadata(configs: Mapping[str, Any], tokenizer: Any, ckpt_dir: str) -> None:
    """``hf/<model>/``: each trainable model's config and the tokenizer (one process writes)."""
    for role, config in configs.items():
        folder = os.path.join(ckpt_dir, HF_DIR, role)
        os.makedirs(folder, exist_ok=True)
        config.save_pretrained(folder)
        if tokenizer is not None and not isinstance(tokenizer, ByteTokenizer):  # (the toy task's: no files)
            tokenizer.save_pretrained(folder)


def logical_params(stage_dir: str) -> dict[str, Any]:
    """Every parameter of a model-stage checkpoint, full size, read on this process alone (no unpickling).

    A training stage stores its bf16/fp16 parameters as their fp32 masters only
    (:data:`~nereus_lightning.emu.dcp_state.PARAMS_FROM_MASTERS` names them and their dtype): each
    is its master rounded to that dtype, as the optimizer step rounds it.
    """
    import torch

    from nereus_lightning.emu.dcp_state import load_tensors, read_dcp_metadata, read_params_from_masters

    stored: Mapping[str, Any] = read_dcp_metadata(stage_dir).state_dict_metadata  # (tensors only)
    dtypes = read_params_from_masters(stage_dir)
    sources = _param_sources(stage_dir, stored, dtypes)
    state = {
        key: torch.empty(tuple(stored[key].size), dtype=stored[key].properties.dtype)
        for key in sources.values()
    }
    load_tensors(state, stage_dir, alone=True)
    return {
        name: state[key] if key.startswith("param/") else state[key].to(dtypes[name])
        for name, key in sources.items()
    }


def _param_sources(stage_dir: str, stored: Mapping[str, Any], dtypes: Mapping[str, Any]) -> dict[str, str]:
    """Each parameter of a model-stage checkpoint, in its order -> the key it is read from: ``param/<name>``,
    or ``master/<name>`` for one stored as its master only (``dtypes``: those and their dtypes).

    A :class:`CheckpointError` names the file and key of a parameter that has neither, or whose
    dtype no file gives.
    """
    from nereus_lightning.emu.dcp_state import DCP_METADATA, PARAMS_FROM_MASTERS

    metadata, record = os.path.join(stage_dir, DCP_METADATA), os.path.join(stage_dir, PARAMS_FROM_MASTERS)
    sources: dict[str, str] = {}
    for key in stored:
        kind, _, name = key.partition("/")
        if kind == "param":
            sources[name] = key
        elif kind == "master" and f"param/{name}" not in stored:
            if name not in dtypes:
                raise CheckpointError(
                    f"{metadata}: holds {key!r} but not 'param/{name}', and {record} does not give the "
                    "parameter's dtype (missing, or it does not name it)"
                )
            sources[name] = key
    for name in dtypes:
        if name not in sources:
            raise CheckpointError(f"{metadata}: holds neither 'param/{name}' nor 'master/{name}' ({record})")
    return sources


def model_of(config: Any, dtype: Any) -> Any:
    import transformers as tf

    value_model = any(a.endswith("ForTokenClassification") for a in (config.architectures or ()))
    auto = tf.AutoModelForTokenClassification if value_model else tf.AutoModelForCausalLM
    return auto.from_config(config, dtype=dtype)


def export_model(stage_dir: str, folder: str, config: Any = None, config_file: str | None = None) -> str:
    """Write ``folder/model.safetensors`` from the model-stage checkpoint ``stage_dir`` (``config``: the
    model's transformers config, read from ``config_file``; None: ``folder``'s ``config.json``, for a
    checkpoint being written).

    Before any tensor is allocated, every parameter of a model of ``config`` (built on the meta device)
    must have the shape the checkpoint stores, and the stored sizes are backed by its data files
    (:func:`~nereus_lightning.emu.dcp_metadata.check_metadata`).
    """
    import torch
    import transformers as tf

    from nereus_lightning.emu.dcp_state import read_dcp_metadata, read_params_from_masters
    from nereus_lightning.models.sharding import placement, tp_plan_of, tp_slices

    config = config if config is not None else tf.AutoConfig.from_pretrained(folder, trust_remote_code=False)
    stored: Mapping[str, Any] = read_dcp_metadata(stage_dir).state_dict_metadata  # (tensors only)
    sources = _param_sources(stage_dir, stored, read_params_from_masters(stage_dir))
    with torch.device("meta"):
        shapes = {n: tuple(p.shape) for n, p in model_of(config, torch.float32).named_parameters()}
    config_file = config_file or os.path.join(folder, "config.json")
    _check_shapes(stage_dir, config_file, shapes, {n: tuple(stored[k].size) for n, k in sources.items()})
    params = logical_params(stage_dir)
    model = model_of(config, next(iter(params.values())).dtype)
    own = dict(model.named_parameters())  # tied weights appear once
    plan = tp_plan_of(config)
    with torch.no_grad():
        for name, param in own.items():
            p = placement(name, plan)
            if p.fused is None:
                param.copy_(params[name])
            else:  # DCP holds a fused projection's rows in group order (one interval per TP shard)
                param[tp_slices(tuple(param.shape), p, 1, 0)] = params[name]
    bars = tf.utils.logging.is_progress_bar_enabled()
    tf.utils.logging.disable_progress_bar()  # a bar per checkpoint would break the training console
    try:
        model.save_pretrained(folder, safe_serialization=True)
    finally:
        if bars:
            tf.utils.logging.enable_progress_bar()
    return folder


def _check_shapes(stage_dir: str, config_file: str, want: dict[str, tuple], have: dict[str, tuple]) -> None:
    """Refuse a config whose parameters are not the stored ones (names and shapes), naming the first."""
    missing, unexpected = sorted(set(want) - set(have)), sorted(set(have) - set(want))
    if missing or unexpected:
        raise NereusConfigError(
            f"ckpt_path: {stage_dir!r} does not match the config {config_file!r} "
            f"(missing {missing[:4]}, unexpected {unexpected[:4]})"
        )
    for name, shape in want.items():
        if have[name] != shape:
            raise CheckpointError(
                f"{config_file}: gives {name} the shape {shape}, but {stage_dir} stores {have[name]}; "
                "the config and the tensors do not belong together"
            )


def write_hf_into(ckpt_dir: str) -> dict[str, str]:
    """``hf/<model>/model.safetensors`` of every trainable model, in a checkpoint being written (its configs
    already in ``hf/<model>/``; trusted: this process wrote it)."""
    done = {}
    for role, stage in TRAINED.items():
        stage_dir, folder = os.path.join(ckpt_dir, "emu", stage), os.path.join(ckpt_dir, HF_DIR, role)
        if os.path.isdir(stage_dir) and os.path.isdir(folder):
            done[role] = export_model(stage_dir, folder)
    return done


#: The files of ``hf/<model>/`` an export copies (configs and tokenizer files; never code).
COPIED = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "spiece.model",
)


def export_hf(ckpt_dir: str, output: str) -> dict[str, str]:
    """Hugging Face folders ``output/<model>/`` of every trainable model in the checkpoint ``ckpt_dir``.

    The checkpoint is verified first (every file's SHA-256, no symbolic link anywhere:
    :func:`~nereus_lightning.lightning.checkpoint.read_checkpoint`); each model's ``config.json`` must name
    a registered family and no custom code (``auto_map``) before transformers reads it; only regular
    config and tokenizer files it lists are copied (:data:`COPIED`); each folder is written under a hidden
    name inside ``output`` and renamed into place, so nothing is written outside ``output``.
    """
    from nereus_lightning.lightning.checkpoint import read_checkpoint

    stored = read_checkpoint(ckpt_dir)
    root = Path(stored.path)
    roles = {
        role: stage
        for role, stage in TRAINED.items()
        if f"{HF_DIR}/{role}/config.json" in stored.files
        and any(n.startswith(f"emu/{stage}/") for n in stored.files)
    }
    if not roles:
        raise NereusConfigError(
            f"ckpt_path: {ckpt_dir!r} holds no trainable model with its config (emu/actor_train and "
            f"{HF_DIR}/actor/config.json, or the critic's); it was not written by nereus-train"
        )
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    if out.resolve() == root or root in out.resolve().parents:
        raise NereusConfigError(f"output: {output!r} lies inside the checkpoint; give a folder outside it")
    done = {}
    for role, stage in roles.items():
        done[role] = _export_role(root, role, stage, stored.files, out)
    return done


def _export_role(root: Path, role: str, stage: str, files: Mapping[str, Any], out: Path) -> str:
    """``out/<role>``: written under a hidden name, renamed into place when complete (removed on failure)."""
    config_file = root / HF_DIR / role / "config.json"
    config = checked_config(config_file)
    partial = out / f".{role}.partial"
    remove(partial)
    partial.mkdir()
    try:
        for name in COPIED:
            if f"{HF_DIR}/{role}/{name}" in files:
                _copy_regular(root / HF_DIR / role / name, partial / name)
        export_model(str(root / "emu" / stage), str(partial), config, str(config_file))
        replace_path(partial, out / role)
    except BaseException:
        remove(partial)
        raise
    return str(out / role)


def checked_config(file: Path) -> Any:
    """The transformers config in ``file``, built only for a registered family without custom code."""
    import json

    import transformers as tf

    from nereus_lightning.spec.families import family_of

    try:
        values = json.loads(file.read_text())
        if not isinstance(values, dict):
            raise ValueError("not a JSON object")
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{file}: damaged ({type(exc).__name__}: {exc})") from exc
    if "auto_map" in values:
        raise CheckpointError(
            f"{file}: auto_map names custom model code ({values['auto_map']!r:.120}); nereus-export runs "
            "no code "
            "from a checkpoint: export from a checkpoint of a registered family"
        )
    family_of(values, field=str(file))
    model_type = values.pop("model_type")
    return tf.AutoConfig.for_model(model_type, **values)


def _copy_regular(source: Path, target: Path) -> None:
    """Copy the regular file ``source`` (no symbolic link followed) to ``target`` (created, not followed)."""
    fd = os.open(source, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb") as src:
        out = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        with os.fdopen(out, "wb") as dst:
            shutil.copyfileobj(src, dst)
