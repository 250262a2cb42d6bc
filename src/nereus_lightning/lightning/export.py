"""Hugging Face folders from Nereus checkpoints: ``save_pretrained`` (safetensors) plus the tokenizer.

A checkpoint keeps each trainable model's logical state in its training model-stage's DCP
directory (``emu/actor_train``, ``emu/critic_train``) and, written at save time, the model's
``config.json`` and tokenizer in ``hf/<model>/``. :func:`export_hf` reads the parameters back
on one process, whatever the layout they were saved from, and writes ``model.safetensors`` beside
them, so ``from_pretrained`` gives back the logical parameters bit for bit.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from typing import Any

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
    (:data:`~nereus_lightning.emu.checkpoint.PARAMS_FROM_MASTERS` names them and their dtype): each
    is its master rounded to that dtype, as the optimizer step rounds it.
    """
    import torch

    from nereus_lightning.emu.checkpoint import load_tensors, read_dcp_metadata, read_params_from_masters

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
    from nereus_lightning.emu.checkpoint import DCP_METADATA, PARAMS_FROM_MASTERS

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


def _model_of(config: Any, dtype: Any) -> Any:
    import transformers as tf

    value_model = any(a.endswith("ForTokenClassification") for a in (config.architectures or ()))
    auto = tf.AutoModelForTokenClassification if value_model else tf.AutoModelForCausalLM
    return auto.from_config(config, dtype=dtype)


def export_model(stage_dir: str, folder: str) -> str:
    """Write ``folder/model.safetensors`` from the model-stage checkpoint ``stage_dir`` (``folder`` holds the
    config).
    """
    import torch
    import transformers as tf

    from nereus_lightning.models.sharding import placement, tp_plan_of, tp_slices

    params = logical_params(stage_dir)
    config = tf.AutoConfig.from_pretrained(folder)
    model = _model_of(config, next(iter(params.values())).dtype)
    own = dict(model.named_parameters())  # tied weights appear once
    missing, unexpected = sorted(set(own) - set(params)), sorted(set(params) - set(own))
    if missing or unexpected:
        raise NereusConfigError(
            f"ckpt_path: {stage_dir!r} does not match the config in {folder!r} "
            f"(missing {missing[:4]}, unexpected {unexpected[:4]})"
        )
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


def export_hf(ckpt_dir: str, output: str | None = None) -> dict[str, str]:
    """Hugging Face folders of every trainable model in ``ckpt_dir``, under ``output`` (default
    ``ckpt_dir/hf``).
    """
    source = os.path.join(ckpt_dir, HF_DIR)
    target = output or source
    if not os.path.isdir(source):
        raise NereusConfigError(
            f"ckpt_path: {ckpt_dir!r} has no {HF_DIR}/ folder with the models' configs; "
            "it was not written by nereus-train (or not by this version)"
        )
    done = {}
    for role, stage in TRAINED.items():
        stage_dir = os.path.join(ckpt_dir, "emu", stage)
        if not os.path.isdir(stage_dir) or not os.path.isdir(os.path.join(source, role)):
            continue
        folder = os.path.join(target, role)
        if folder != os.path.join(source, role):
            shutil.copytree(os.path.join(source, role), folder, dirs_exist_ok=True)
        done[role] = export_model(stage_dir, folder)
    if not done:
        raise NereusConfigError(
            f"ckpt_path: {ckpt_dir!r} holds no trainable model (emu/actor_train, emu/critic_train)"
        )
    return done
