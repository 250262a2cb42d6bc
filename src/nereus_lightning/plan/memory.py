"""Per-GPU memory of a model-stage replica: state, activations, KV cache, logits, workspace.

Every term is a small function of the model's numbers, so each can be checked by hand. Sizes
are bytes on the most-loaded GPU of a pipeline stage; TP divides everything it shards (we
assume sequence parallelism, so norm and residual activations are divided by TP as well).

Generation depends on the rollout engine (``spec.workload.GenerationEngine``): the built-in one
holds what its batch needs; vLLM takes its ``gpu_memory_utilization`` share of each GPU whatever
the batch (:func:`engine_reserved_bytes`) and decodes as many sequences as fit in that share, their
KV cache in whole blocks (:func:`generation_budget`).
"""

from __future__ import annotations

from functools import lru_cache

from nereus_lightning.plan.compute import kv_bytes_per_token_layer, stage_layers
from nereus_lightning.plan.layout import Layout
from nereus_lightning.spec.cluster import ClusterSpec
from nereus_lightning.spec.model import ModelSpec
from nereus_lightning.spec.workload import GenerationEngine

#: The built-in rollout engine (transformers generate / the static decoder).
BUILTIN_ENGINE = GenerationEngine()

#: AdamW moments (exp_avg, exp_avg_sq) in fp32, per parameter (ZeRO-0).
ADAM_MOMENT_BYTES_PER_PARAM = 8
#: fp32 master weights, kept only when the weights themselves are below fp32.
MASTER_WEIGHT_BYTES_PER_PARAM = 4
GIB = 2**30
#: cuBLAS / NCCL workspaces and allocator fragmentation, per GPU.
WORKSPACE_BYTES = 1 * GIB
#: Fraction of GPU memory kept free by the feasibility check (Eq. 1 uses a 10% headroom).
MEMORY_HEADROOM = 0.10
#: Logits are materialised in fp32, twice (logits and their log-softmax / gradient).
LOGIT_BYTES_PER_ELEMENT = 8


@lru_cache(maxsize=256)
def _layer_params(model: ModelSpec) -> int:
    return model.layer_params


def max_stage_params(model: ModelSpec, pp: int) -> int:
    """Parameters of the largest pipeline stage (the first or the last)."""
    return max(stage_params(model, pp, r) for r in {0, pp - 1})


def memory_cap(cluster: ClusterSpec) -> float:
    """Bytes a plan may use per GPU: the GPU's memory less the headroom."""
    return cluster.gpu_memory * (1 - MEMORY_HEADROOM)


@lru_cache(maxsize=1 << 13)
def stage_params(model: ModelSpec, pp: int, pp_rank: int) -> int:
    """Parameters held by pipeline stage ``pp_rank`` (embedding first, final norm and LM head last)."""
    params = stage_layers(model, pp, pp_rank) * _layer_params(model)
    if pp_rank == 0:
        params += model.embedding_params
    if pp_rank == pp - 1:
        params += model.hidden + (
            model.lm_head_params if not model.tie_embeddings or pp == 1 else model.embedding_params
        )
    return params


@lru_cache(maxsize=256)
def optimizer_bytes_per_param(model: ModelSpec) -> int:
    """AdamW state per parameter: fp32 moments, plus fp32 master weights for bf16/fp16 weights.

    For an fp32 model this is 8 bytes (weights + moments = 3 x 4 bytes, what the EMU holds).
    """
    master = MASTER_WEIGHT_BYTES_PER_PARAM if model.dtype_bytes < 4 else 0
    return ADAM_MOMENT_BYTES_PER_PARAM + master


def rank_state_bytes(model: ModelSpec, trains: bool, layout: Layout, pp_rank: int) -> float:
    """Resident state on one GPU of pipeline stage ``pp_rank``: weights (+ grads and AdamW when training)."""
    per_param = model.dtype_bytes * (2 if trains else 1) + (optimizer_bytes_per_param(model) if trains else 0)
    return stage_params(model, layout.pp, pp_rank) / layout.tp * per_param


def boundary_state_bytes(model: ModelSpec, trains: bool, layout: Layout) -> float:
    """State a model-stage keeps on its most-loaded GPU at a safe boundary (between RL steps).

    Training state stays resident all step; generation and inference weights are loaded from
    host memory when their stage starts and dropped after (``cost._offload`` prices that), so they
    hold no GPU memory between steps. The planner and the transition DAG both use this rule.
    """
    return state_bytes_per_gpu(model, True, layout) if trains else 0.0


def state_bytes_per_gpu(model: ModelSpec, trains: bool, layout: Layout) -> float:
    """Resident state bytes on the most-loaded GPU of one replica.

    Inference holds weights; training adds gradients (weight dtype) and AdamW state.
    TP splits every stage's parameters evenly (replicated norms are negligible).
    """
    # The first stage holds at least as many layers as any middle one, plus the embedding.
    return max(rank_state_bytes(model, trains, layout, r) for r in {0, layout.pp - 1})


def activation_bytes_per_token_layer(model: ModelSpec) -> float:
    """Activations one token keeps in one block for the backward pass (flash attention, no scores).

    Attention keeps its norm input, the QKV input, q, k, v and the attention output (the o_proj
    input): 2h + 2q + 2kv. The MLP keeps its norm input, its input, gate, up, silu(gate) and the
    down-projection input: 2h + 4i.
    """
    h, q, kv, i = model.hidden, model.q_dim, model.kv_dim, model.intermediate
    return model.dtype_bytes * (4 * h + 2 * q + 2 * kv + 4 * i)


def checkpoint_bytes_per_token_layer(model: ModelSpec) -> float:
    """What activation recompute keeps per token and block: the block input only."""
    return model.dtype_bytes * model.hidden


def logits_bytes(model: ModelSpec, tokens: float, tp: int) -> float:
    """fp32 logits (and their log-softmax / gradient) for ``tokens`` tokens, vocabulary split over TP."""
    return tokens * model.vocab / tp * LOGIT_BYTES_PER_ELEMENT


def kv_cache_bytes(model: ModelSpec, tokens: float, layers: int, tp: int) -> float:
    """KV cache of ``tokens`` tokens over ``layers`` blocks, KV heads split over TP."""
    return tokens * layers * kv_bytes_per_token_layer(model) / tp


def training_activation_bytes(
    model: ModelSpec, layers: int, tokens: float, in_flight: int, tp: int, recompute: bool
) -> float:
    """Activations of a 1F1B pipeline stage holding ``in_flight`` micro-batches of ``tokens`` tokens."""
    if recompute:
        kept = in_flight * tokens * layers * checkpoint_bytes_per_token_layer(model)
        return (
            kept + tokens * activation_bytes_per_token_layer(model)
        ) / tp  # one block recomputed at a time
    return in_flight * tokens * layers * activation_bytes_per_token_layer(model) / tp


def training_peak_bytes(
    model: ModelSpec,
    layout: Layout,
    pp_rank: int,
    micro_batch: int,
    seq_len: float,
    micro_batches: int,
    recompute: bool,
    lm_head: bool,
) -> float:
    """Peak bytes on one GPU of pipeline stage ``pp_rank`` while training (1F1B schedule).

    Stage ``p`` of ``pp`` keeps ``min(pp - p, micro_batches)`` micro-batches in flight.
    """
    tokens = micro_batch * seq_len
    in_flight = min(layout.pp - pp_rank, micro_batches)
    layers = stage_layers(model, layout.pp, pp_rank)
    total = rank_state_bytes(model, True, layout, pp_rank) + WORKSPACE_BYTES
    total += training_activation_bytes(model, layers, tokens, in_flight, layout.tp, recompute)
    if lm_head and pp_rank == layout.pp - 1:
        total += logits_bytes(model, tokens, layout.tp)
    return total


def inference_peak_bytes(
    model: ModelSpec, layout: Layout, pp_rank: int, micro_batch: int, seq_len: float, lm_head: bool
) -> float:
    """Peak bytes on one GPU of stage ``pp_rank`` for a forward pass (one block's activations live)."""
    tokens = micro_batch * seq_len
    total = rank_state_bytes(model, False, layout, pp_rank) + WORKSPACE_BYTES
    total += tokens * activation_bytes_per_token_layer(model) / layout.tp
    if lm_head and pp_rank == layout.pp - 1:
        total += logits_bytes(model, tokens, layout.tp)
    return total


def generation_peak_bytes(
    model: ModelSpec,
    layout: Layout,
    pp_rank: int,
    batch: int,
    prompt_len: float,
    max_len: float,
    engine: GenerationEngine = BUILTIN_ENGINE,
) -> float:
    """Bytes one GPU of stage ``pp_rank`` needs to decode ``batch`` sequences of up to ``max_len`` tokens.

    Weights, the full KV cache (whole blocks with vLLM), the prefill's live block activations and
    last-token logits. An engine that reserves a share of the GPU holds
    :func:`engine_reserved_bytes` when that is more.
    """
    layers = stage_layers(model, layout.pp, pp_rank)
    total = rank_state_bytes(model, False, layout, pp_rank) + WORKSPACE_BYTES
    total += kv_cache_bytes(model, batch * engine.cache_tokens(max_len), layers, layout.tp)
    total += batch * prompt_len * activation_bytes_per_token_layer(model) / layout.tp
    if pp_rank == layout.pp - 1:
        total += logits_bytes(model, batch, layout.tp)
    return total


def engine_reserved_bytes(engine: GenerationEngine, gpu_memory: float) -> float:
    """Bytes the rollout engine takes on each of its GPUs whatever its batch (0: what the batch needs).

    vLLM sizes its KV cache so that weights, activations and cache fill ``gpu_memory_utilization``
    of the GPU's memory, and holds that from start-up (or wake-up) on.
    """
    return engine.gpu_memory_utilization * gpu_memory if engine.reserves else 0.0


def generation_budget(reserved: float, free: float) -> float:
    """Bytes a generation replica's batch may fill on a GPU with ``free`` bytes for it.

    The built-in engine (``reserved == 0``) grows into all of it; an engine that reserves a share
    fills its share, which must fit in ``free`` (else nothing fits: -1).
    """
    if reserved <= 0:
        return free
    return reserved if reserved <= free else -1.0
