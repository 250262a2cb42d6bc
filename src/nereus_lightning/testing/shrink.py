"""A transformers config shrunk to a tiny one of the same family and features, and its seeded model.

What the self-check (:mod:`nereus_lightning.proof.selfcheck`) and the tests build: 4 layers, 4 or 8
heads of 16 dimensions, a 256-token vocabulary, the family's features kept (GQA, tying, biases,
sliding windows, soft-capping, fused projections, mixtures of experts).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch

from nereus_lightning.spec.families import family_of
from nereus_lightning.spec.verdicts import on_trial

VOCAB = 256
LAYERS = 4
HEAD_DIM = 16


def _has_list(value: Any) -> bool:
    if isinstance(value, Mapping):
        return any(_has_list(v) for v in value.values())
    return isinstance(value, list)


def tiny_config_of(config: Any) -> Any:
    """A tiny fp32 eager-attention config of ``config``'s family with its features, refused like the original.

    4 layers (their ``layer_types`` the first 4), 4 heads (MHA) or 8 heads over 4 KV heads (GQA),
    head dim 16 (kept when the RoPE parameters list per-dimension factors), a 256-token vocabulary,
    a sliding window of 6 tokens where the original has one.
    """
    with on_trial(config.model_type):
        family_of(config)
    data = copy.deepcopy(config.to_dict())
    heads = int(data["num_attention_heads"])
    gqa = int(data.get("num_key_value_heads") or heads) < heads
    tiny_heads, kv_heads = (8, 4) if gqa else (4, 4)
    rope = data.get("rope_parameters") or data.get("rope_scaling")
    head_dim = int(data.get("head_dim") or data["hidden_size"] // heads) if _has_list(rope) else HEAD_DIM
    data.update(
        num_attention_heads=tiny_heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        hidden_size=tiny_heads * head_dim,
        intermediate_size=2 * tiny_heads * head_dim,
        num_hidden_layers=LAYERS,
        vocab_size=VOCAB,
        dtype="float32",
    )
    if data.get("layer_types"):
        types = list(data["layer_types"][:LAYERS])
        missing = [t for t in dict.fromkeys(data["layer_types"]) if t not in types]
        types[LAYERS - len(missing[: LAYERS - 1]) :] = missing[: LAYERS - 1]  # mixed kinds stay mixed
        data["layer_types"] = types
    _shrink_experts(data)
    if data.get("sliding_window"):
        data["sliding_window"] = 6
    for offset, key in enumerate(("pad_token_id", "bos_token_id", "eos_token_id")):
        if isinstance(data.get(key), int) and data[key] >= VOCAB:
            data[key] = VOCAB - 56 + offset  # the padding row then lies in the last shard under TP 2 and 4
    tiny = type(config).from_dict(data)
    tiny._attn_implementation = "eager"
    return tiny


def _shrink_experts(data: dict[str, Any]) -> None:
    """A mixture of experts becomes 4 experts of width 32, 2 per token (a shared expert 32 wide)."""
    from nereus_lightning.spec.families import EXPERT_KEYS, TOP_K_KEYS

    if not any(data.get(k) for k in EXPERT_KEYS):
        return
    for key in EXPERT_KEYS:
        if data.get(key):
            data[key] = 4
    for key in TOP_K_KEYS:
        if data.get(key):
            data[key] = min(2, int(data[key]))
    for key in ("moe_intermediate_size", "shared_expert_intermediate_size"):
        if data.get(key):
            data[key] = 32


def value_config_of(config: Any) -> Any:
    """``config`` as its family's value model: token classification with one label, no dropout, untied."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    value = copy.deepcopy(config)
    lm = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]
    value.architectures = [lm.removesuffix("ForCausalLM") + "ForTokenClassification"]
    value.num_labels, value.classifier_dropout, value.tie_word_embeddings = 1, 0.0, False
    return value


def tiny_model_of(config: Any, seed: int = 0) -> torch.nn.Module:
    """The transformers model of ``config`` (causal LM or value model) with seeded random weights, fp32, eval.

    Every 1-D tensor (norm weights, biases) gets noise, so a mistake in a replicated tensor shows.
    """
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    from nereus_lightning.models.sharded import has_value_head

    auto = AutoModelForTokenClassification if has_value_head(config) else AutoModelForCausalLM
    torch.manual_seed(seed)
    model = auto.from_config(config).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))
    return model
