"""The tiny transformers models every test (and the multi-GPU script) builds: one factory.

:func:`tiny_config` names the test models (and takes any other transformers ``model_type`` at
the same tiny shape); any config field can be overridden, e.g. the EMU tests' smaller shape
(:data:`SMALL`) or a model folder's vocabulary. :func:`tiny_model` gives the model with seeded
random weights through :func:`~nereus_lightning.proof.selfcheck.tiny_model_of`, the same draw
``nereus-check-model`` uses (every 1-D tensor gets noise, so a mistake in a replicated tensor
shows).
"""

from __future__ import annotations

from typing import Any

import torch

from nereus_lightning.models import ReplicaComm, replica_groups
from nereus_lightning.plan.layout import Layout

VOCAB = 256
PAD = 200  # the padding id of "gqa_tied" (its embedding row gets no gradient from lookups)
#: The EMU tests' shape: their checks are about moving state, so the smaller the faster.
SMALL: dict[str, Any] = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "max_position_embeddings": 64,
    "pad_token_id": None,
}

# Per kind: its model_type and what sets it apart from the common shape.
KINDS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {"num_attention_heads": 4, "num_key_value_heads": 4, "num_hidden_layers": 4}),
    "qwen2": ("qwen2", {"num_attention_heads": 8, "num_key_value_heads": 4, "num_hidden_layers": 4}),
    "gqa_tied": (  # Llama GQA, tied, a pad id in the last vocabulary shard under TP 2 and 4
        "llama",
        {
            "num_attention_heads": 8,
            "num_key_value_heads": 4,
            "intermediate_size": 160,
            "num_hidden_layers": 4,
            "tie_word_embeddings": True,
            "pad_token_id": PAD,
        },
    ),
    "qwen3": (  # q/k norm, tied
        "qwen3",
        {
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "num_hidden_layers": 2,
            "tie_word_embeddings": True,
        },
    ),
    "mistral": (  # a sliding window shorter than the test sequences
        "mistral",
        {"num_attention_heads": 4, "num_key_value_heads": 4, "num_hidden_layers": 4, "sliding_window": 5},
    ),
}
COMMON: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "vocab_size": VOCAB,
    "max_position_embeddings": 128,
    "attn_implementation": "eager",
}


def tiny_config(kind: str, **fields: Any) -> Any:
    """A tiny config of ``kind`` with ``fields`` overriding its values.

    Kinds: "llama" (MHA), "qwen2" (q/k/v bias, GQA), "gqa_tied" (Llama GQA, tied, pad id),
    "qwen3" (q/k norm, tied), "mistral" (sliding window 5); any other transformers
    ``model_type`` at the common shape.
    """
    import transformers as tf

    model_type, own = KINDS.get(kind, (kind, {}))
    return tf.AutoConfig.for_model(model_type, **{**COMMON, **own, **fields})


def tiny_model(kind: str, seed: int = 0, **fields: Any) -> torch.nn.Module:
    """The model of ``tiny_config(kind, **fields)`` with weights drawn from ``seed`` (eval mode, fp32)."""
    from nereus_lightning.testing.shrink import tiny_model_of

    return tiny_model_of(tiny_config(kind, **fields), seed)


def my_replica(rank: int, world: int, layout: Layout, tied: bool) -> tuple[int, ReplicaComm]:
    """Cover the world with replicas of ``layout`` (groups made on all ranks); this rank's index and comm."""
    size = layout.size
    replicas = [tuple(range(i * size, (i + 1) * size)) for i in range(world // size)]
    replica_groups(replicas, layout, tied=tied)
    index = rank // size
    dp = tuple(r[rank % size] for r in replicas)
    return index, ReplicaComm.of(replicas[index], layout, rank, tied=tied, dp_ranks=dp)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|."""
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())
