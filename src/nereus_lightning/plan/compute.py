"""FLOP and byte counts of a decoder-only transformer (the ideal-time inputs of the cost model).

Conventions: one multiply-accumulate = 2 FLOPs; a backward pass costs twice its forward pass;
attention FLOPs are counted separately from GEMMs because they scale with context length and
run in different kernels (their efficiency is calibrated separately).
"""

from __future__ import annotations

from nereus_lightning.spec.model import ModelSpec


def layer_matmul_params(model: ModelSpec) -> int:
    """Weights of one block that one token multiplies by (QKV, output; gate, up, down of its experts)."""
    return (
        model.hidden * (model.q_dim + 2 * model.kv_dim) + model.q_dim * model.hidden + model.mlp_active_params
    )


def gemm_flops_per_token(model: ModelSpec, layers: int, lm_head: bool) -> float:
    """Forward GEMM FLOPs for one token through ``layers`` blocks (+ the LM head if ``lm_head``)."""
    params = layers * layer_matmul_params(model) + (model.vocab * model.hidden if lm_head else 0)
    return 2.0 * params


def attention_flops_per_token(model: ModelSpec, layers: int, context: float) -> float:
    """Forward attention FLOPs (QK^T and AV) for one query token attending to ``context`` tokens."""
    return 4.0 * context * model.q_dim * layers


def training_multiplier(recompute: bool) -> float:
    """Forward-pass equivalents of one training micro-batch: fwd + 2x bwd (+1 fwd when recomputing)."""
    return 4.0 if recompute else 3.0


def weight_bytes(params: float, model: ModelSpec) -> float:
    """Bytes of ``params`` parameters in the model's dtype."""
    return params * model.dtype_bytes


def kv_bytes_per_token_layer(model: ModelSpec) -> int:
    """KV-cache bytes one token adds to one layer (K and V)."""
    return 2 * model.kv_dim * model.dtype_bytes


def stage_layers(model: ModelSpec, pp: int, pp_rank: int) -> int:
    """Blocks held by pipeline stage ``pp_rank`` (earlier stages take the remainder)."""
    base, extra = divmod(model.num_layers, pp)
    return base + (1 if pp_rank < extra else 0)
