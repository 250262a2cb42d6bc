"""Build the role models of a job (actor and reference: causal LMs; critic and reward: value models) from presets, dicts or local paths."""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from nereus_lightning.spec.errors import NereusConfigError
from nereus_lightning.spec.families import family_of
from nereus_lightning.spec.model import MODEL_PRESETS, ModelSpec


def hf_config_of(spec: ModelSpec, vocab_size: int | None = None, pad_token_id: int | None = None) -> Any:
    """A transformers Llama / Qwen config with ``spec``'s numbers (``vocab_size`` overrides the spec's)."""
    import transformers as tf

    common = dict(
        hidden_size=spec.hidden,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        intermediate_size=spec.intermediate,
        vocab_size=vocab_size or spec.vocab,
        max_position_embeddings=min(spec.max_position, 4096),
        tie_word_embeddings=spec.tie_embeddings,
        pad_token_id=pad_token_id,
        head_dim=spec.head_dim,
    )
    if spec.qk_norm:
        return tf.Qwen3Config(**common)
    if spec.qkv_bias:
        return tf.Qwen2Config(**common)
    return tf.LlamaConfig(**common)


def _config_of(
    source: Mapping[str, Any] | ModelSpec | str | Any, vocab_size: int | None, pad_token_id: int | None
) -> Any:
    """A transformers config from a preset name, a ``ModelSpec``, a config dict or a config."""
    import transformers as tf

    if isinstance(source, str):
        if source not in MODEL_PRESETS:
            raise NereusConfigError(
                f"model: unknown preset {source!r}; known presets: {', '.join(sorted(MODEL_PRESETS))} (or a local model folder)"
            )
        source = MODEL_PRESETS[source]
    if isinstance(source, ModelSpec):
        return hf_config_of(source, vocab_size, pad_token_id)
    if isinstance(source, Mapping):
        data = dict(source)
        model_type = data.pop("model_type", "llama")
        return tf.AutoConfig.for_model(model_type, **data)
    return source


def build_causal_lm(
    source: str | Mapping[str, Any] | ModelSpec | Any,
    seed: int,
    vocab_size: int | None = None,
    pad_token_id: int | None = None,
) -> nn.Module:
    """A causal LM in fp32 from a preset name, a ``ModelSpec``, a transformers config (or dict), or a local path.

    Presets and configs get random weights drawn from ``seed`` (no downloads); a path loads weights.
    """
    import transformers as tf

    if isinstance(source, str) and os.path.isdir(source):
        family_of(tf.AutoConfig.from_pretrained(source), "model")  # refused before any weight loads
        return tf.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    config = _config_of(source, vocab_size, pad_token_id)
    family_of(config, "model")
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.float().eval()


# A value model (critic, reward model) is token classification with one label, as verl's critic:
# ``score`` (Linear(hidden, 1)) replaces the LM head, no dropout, and no embedding tying.
_VALUE_MODEL = {"num_labels": 1, "classifier_dropout": 0.0, "tie_word_embeddings": False}


def build_value_model(
    source: str | Mapping[str, Any] | ModelSpec | Any,
    seed: int,
    vocab_size: int | None = None,
    pad_token_id: int | None = None,
) -> nn.Module:
    """A value model in fp32 (transformers ``*ForTokenClassification``, one label) from the same sources as :func:`build_causal_lm`.

    A local causal-LM folder loads its body; the ``score`` head then starts from ``seed``'s draw.
    """
    import transformers as tf

    torch.manual_seed(seed)
    if isinstance(source, str) and os.path.isdir(source):
        family_of(tf.AutoConfig.from_pretrained(source), "model")  # refused before any weight loads
        model = tf.AutoModelForTokenClassification.from_pretrained(
            source, dtype=torch.float32, **_VALUE_MODEL
        )
    else:
        config = copy.deepcopy(_config_of(source, vocab_size, pad_token_id))
        family_of(config, "model")
        for key, value in _VALUE_MODEL.items():
            setattr(config, key, value)
        model = tf.AutoModelForTokenClassification.from_config(config, dtype=torch.float32)
    model.config.architectures = [
        type(model).__name__
    ]  # marks it a value model (models.sharded.has_value_head)
    return model.float().eval()


def frozen_copy(model: nn.Module) -> nn.Module:
    """A deep copy with gradients off (the reference policy)."""
    ref = copy.deepcopy(model)
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref.eval()
