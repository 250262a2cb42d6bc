"""Tiny transformers causal LMs with seeded random weights, shared by the tests and the multi-GPU script."""

from __future__ import annotations

from typing import Any

import torch

VOCAB = 256
PAD = 200  # the padding id of "gqa_tied" (its embedding row gets no gradient from lookups)


def tiny_config(kind: str):
    """A tiny config of ``kind``.

    "llama" (MHA), "qwen2" (q/k/v bias, GQA), "gqa_tied" (Llama GQA, tied, pad id), "qwen3" (q/k
    norm, tied), "mistral" (sliding window 5).
    """
    import transformers as tf

    common: dict[str, Any] = dict(
        hidden_size=64, vocab_size=VOCAB, max_position_embeddings=128, attn_implementation="eager"
    )
    if kind == "llama":
        return tf.LlamaConfig(
            num_attention_heads=4, num_key_value_heads=4, intermediate_size=128, num_hidden_layers=4, **common
        )
    if kind == "qwen2":
        return tf.Qwen2Config(
            num_attention_heads=8, num_key_value_heads=4, intermediate_size=128, num_hidden_layers=4, **common
        )
    if kind == "gqa_tied":
        return tf.LlamaConfig(
            num_attention_heads=8,
            num_key_value_heads=4,
            intermediate_size=160,
            num_hidden_layers=4,
            tie_word_embeddings=True,
            pad_token_id=PAD,  # in the last vocabulary shard under TP 2 and 4
            **common,
        )
    if kind == "qwen3":
        return tf.Qwen3Config(
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size=128,
            num_hidden_layers=2,
            tie_word_embeddings=True,
            **common,
        )
    if kind == "mistral":  # a sliding window shorter than the test sequences
        return tf.MistralConfig(
            num_attention_heads=4,
            num_key_value_heads=4,
            intermediate_size=128,
            num_hidden_layers=4,
            sliding_window=5,
            **common,
        )
    raise ValueError(kind)


def tiny_model(kind: str, seed: int = 0):
    """The full model of ``tiny_config(kind)`` with weights drawn from ``seed`` (eval mode, fp32)."""
    import transformers as tf

    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(tiny_config(kind)).float().eval()
    # Non-trivial norm weights and biases, so mistakes in replicated tensors show up.
    with torch.no_grad():
        for _name, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))
    return model


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|."""
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())
