"""Per-GPU memory of a model-stage replica: state, activations, KV cache, logits, workspace.

Every term is a small function of the model's numbers, so each can be checked by hand. Sizes
are bytes on the most-loaded GPU of a pipeline stage; TP divides everything it shards (we
assume sequence parallelism, so norm and residual activations are divided by TP as well).

The terms follow what the body holds (``models``, ``rl``, the static decoder ``engines.static``):

- log-probs and entropy run the LM head over chunks of at most :func:`logit_chunk_rows` token
  rows (recomputed in backward), so no stage holds full-vocabulary logits of all its tokens;
- a micro-batch packs its sequences without padding under a budget of ``micro_batch * max_len``
  tokens, and attention runs per sequence (flash / SDPA, no T x T scores);
- training keeps what a transformers decoder layer with SDPA saves for backward
  (:func:`activation_bytes_per_token_layer`), or with recompute only each block's input plus one
  block's activations; the optimizer step adds the fp32 temporaries of one piece
  (:func:`optimizer_step_bytes`), the gradient collectives one flat bucket (:func:`collective_bytes`);
- the static decoder preallocates the KV cache of the whole rollout for its whole batch
  (``GenerationEngine.cache_tokens``) and computes ``[batch, V / tp]`` logits per step.

Generation depends on the rollout engine (``spec.workload.GenerationEngine``): the built-in one
holds what its batch needs; vLLM takes its ``gpu_memory_utilization`` share of each GPU whatever
the batch (:func:`engine_reserved_bytes`) and decodes as many sequences as fit in that share, their
KV cache in whole blocks (:func:`generation_budget`).
"""

from __future__ import annotations

import math
from dataclasses import replace
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
#: Fraction of GPU memory kept free by the feasibility check (Eq. 1 uses a 10% headroom).
MEMORY_HEADROOM = 0.10
#: Logit elements one rank computes at a time: the LM head runs over chunks of
#: ``LOGIT_CHUNK_ELEMENTS // (V / tp)`` token rows (``models.logprobs.LOGIT_CHUNK_ELEMENTS``,
#: mirrored: the brain imports no body module; a test pins them equal).
LOGIT_CHUNK_ELEMENTS = 2**26
#: fp32 copies of a chunk's logits alive beside the chunk itself (the upcast logits and their
#: log-softmax / gradient): a chunk element costs ``dtype_bytes + 4 * LOGIT_FP32_COPIES`` bytes.
LOGIT_FP32_COPIES = 2
#: Elements of one piece of an AdamW step (``models.optim.STEP_PIECE_ELEMENTS``, mirrored; a test pins
#: them equal): the step's fp32 temporaries are those of one piece.
STEP_PIECE_ELEMENTS = 2**26
#: Bytes of one flat buffer of the gradient collectives (``models.sharded.FLAT_BUCKET_BYTES``, mirrored; a
#: test pins them equal): they move the gradients and ZeRO's row blocks in buckets of this size.
FLAT_BUCKET_BYTES = 256 * 2**20


@lru_cache(maxsize=256)
def _layer_params(model: ModelSpec) -> int:
    return model.layer_params


def max_stage_params(model: ModelSpec, pp: int) -> int:
    """Parameters of the largest pipeline stage (the first or the last)."""
    return max(stage_params(model, pp, r) for r in {0, pp - 1})


def memory_cap(cluster: ClusterSpec) -> float:
    """Bytes the allocator may hold per GPU: the GPU's memory less the headroom and what the GPU
    holds outside the allocator (``ClusterSpec.reserved_memory``). Every peak here is allocator bytes
    (what ``torch.cuda.max_memory_allocated`` measures)."""
    return cluster.gpu_memory * (1 - MEMORY_HEADROOM) - cluster.reserved_memory


def full_memory(cluster: ClusterSpec) -> ClusterSpec:
    """``cluster`` as the cost model must see it to tell a real out-of-memory: its memory cap the
    whole GPU memory. The planner keeps a headroom below it (:data:`MEMORY_HEADROOM`); a
    step runs out of memory only when it needs more than the GPU has."""
    return replace(cluster, gpu_memory=cluster.gpu_memory / (1 - MEMORY_HEADROOM))


@lru_cache(maxsize=1 << 13)
def stage_params(model: ModelSpec, pp: int, pp_rank: int) -> int:
    """Parameters held by pipeline stage ``pp_rank`` (embedding first, final norm and LM or value head
    last)."""
    params = stage_layers(model, pp, pp_rank) * _layer_params(model)
    if pp_rank == 0:
        params += model.embedding_params
    if pp_rank == pp - 1:
        params += model.hidden + model.value_head_params
        params += model.lm_head_params if not model.tie_embeddings or pp == 1 else model.embedding_params
    return params


def rank_params(model: ModelSpec, layout: Layout, pp_rank: int) -> float:
    """Parameters one GPU of pipeline stage ``pp_rank`` holds: its TP shard of the stage, plus the parts
    every TP rank keeps whole (a mixture of experts' MLP: experts, router, shared expert; a value
    model's head)."""
    whole = stage_layers(model, layout.pp, pp_rank) * model.tp_whole_layer_params
    if pp_rank == layout.pp - 1:
        whole += model.value_head_params
    return (stage_params(model, layout.pp, pp_rank) - whole) / layout.tp + whole


@lru_cache(maxsize=256)
def optimizer_bytes_per_param(model: ModelSpec) -> int:
    """AdamW state per parameter: fp32 moments, plus fp32 master weights for bf16/fp16 weights.

    For an fp32 model this is 8 bytes (weights + moments = 3 x 4 bytes, what the EMU holds).
    """
    master = MASTER_WEIGHT_BYTES_PER_PARAM if model.dtype_bytes < 4 else 0
    return ADAM_MOMENT_BYTES_PER_PARAM + master


def _sharded(layout: Layout, stage: int) -> int:
    """The divisor of a state term that ZeRO stage ``stage`` and above cut into row blocks."""
    return layout.shard if layout.zero >= stage else 1


def rank_state_bytes(model: ModelSpec, trains: bool, layout: Layout, pp_rank: int) -> float:
    """State on one GPU of pipeline stage ``pp_rank`` while it trains: weights (+ grads and AdamW when
    training), each divided by the shard degree from its ZeRO stage on (AdamW from 1, gradients from
    2, weights from 3)."""
    params = rank_params(model, layout, pp_rank)
    if not trains:
        return params * model.dtype_bytes
    return params * (
        model.dtype_bytes / _sharded(layout, 3)
        + model.dtype_bytes / _sharded(layout, 2)
        + optimizer_bytes_per_param(model) / _sharded(layout, 1)
    )


def resident_rank_bytes(model: ModelSpec, layout: Layout, pp_rank: int) -> float:
    """Training state one GPU of pipeline stage ``pp_rank`` keeps outside its own training pass: weights
    and AdamW state, as its ZeRO stage shards them (the gradients exist from the backward to the
    optimizer step, then are dropped)."""
    return rank_params(model, layout, pp_rank) * (
        model.dtype_bytes / _sharded(layout, 3) + optimizer_bytes_per_param(model) / _sharded(layout, 1)
    )


def gathered_bytes(model: ModelSpec, layout: Layout, pp_rank: int) -> float:
    """Whole tensors a ZeRO-2/3 rank holds beyond its row blocks while it trains, as the body runs it
    (``models.zero``): the backward leaves the whole ``(tp, pp)`` gradients, reduce-scattered into row
    blocks only at the optimizer step (ZeRO >= 2), and a ZeRO-3 replica gathers its whole parameters
    next to their row blocks for the pass (released after the step). So during the pass a ZeRO-2 rank
    holds what a ZeRO-1 rank does, a ZeRO-3 rank that and its parameters' row blocks; the row blocks
    save memory between passes (:func:`resident_rank_bytes`)."""
    params = rank_params(model, layout, pp_rank)
    whole_grads = (1 - 1 / layout.shard) if layout.zero >= 2 else 0.0
    return params * model.dtype_bytes * (whole_grads + (layout.zero >= 3))


def boundary_state_bytes(model: ModelSpec, trains: bool, layout: Layout) -> float:
    """State a model-stage keeps on its most-loaded GPU at a safe boundary (between RL steps), and what
    the other stages run next to.

    Training state stays resident all step, less its gradients (:func:`resident_rank_bytes`);
    generation and inference weights are loaded from host memory when their stage starts and
    dropped after (``cost._offload`` prices that), so they hold no GPU memory between steps. The
    planner and the transition DAG both use this rule.
    """
    if not trains:
        return 0.0
    return max(resident_rank_bytes(model, layout, r) for r in {0, layout.pp - 1})


def state_bytes_per_gpu(model: ModelSpec, trains: bool, layout: Layout) -> float:
    """Resident state bytes on the most-loaded GPU of one replica.

    Inference holds weights; training adds gradients (weight dtype) and AdamW state.
    TP splits every stage's parameters evenly (replicated norms are negligible).
    """
    # The first stage holds at least as many layers as any middle one, plus the embedding.
    return max(rank_state_bytes(model, trains, layout, r) for r in {0, layout.pp - 1})


def norm_bytes_per_token(model: ModelSpec) -> float:
    """What one RMSNorm keeps per token for backward: its fp32 upcast input (4 bytes an element,
    saved by the variance and the scaling), the normalised value in the weight dtype (saved by the
    weight multiply) and its output (saved by the projections it feeds).

    For an fp32 model the upcast is the input itself; the count is the same.
    """
    return (4 + 2 * model.dtype_bytes) * model.hidden


def attention_bytes_per_token(model: ModelSpec) -> float:
    """What one attention block keeps per token beyond its norm: the rotated q and k and v (SDPA's
    inputs; GQA keys and values are not repeated), SDPA's output and its fp32 log-sum-exp per
    head, and the o_proj input (the output made contiguous: a second copy). With q/k norms, each
    keeps its fp32 upcast and normalised value as well."""
    q, kv = model.q_dim, model.kv_dim
    kept = model.dtype_bytes * (3 * q + 2 * kv) + 4 * model.num_heads
    if model.qk_norm:
        kept += (4 + model.dtype_bytes) * (q + kv)
    return kept


def mlp_bytes_per_token(model: ModelSpec) -> float:
    """What one gated MLP keeps per token beyond its norm: gate (silu's input), silu(gate) and up
    (the product's inputs) and the product (down_proj's input)."""
    return 4 * model.dtype_bytes * model.intermediate


def activation_bytes_per_token_layer(model: ModelSpec) -> float:
    """Activations one token keeps in one block for the backward pass (a transformers decoder
    layer with SDPA, no T x T scores): two norms, attention and MLP.

    The block's input is not kept (the first norm keeps its upcast instead). The final norm (one
    more norm per token, under 1% of the blocks') is left out.
    """
    return 2 * norm_bytes_per_token(model) + attention_bytes_per_token(model) + mlp_bytes_per_token(model)


def forward_bytes_per_token(model: ModelSpec) -> float:
    """Activations one token has alive in a forward pass without gradients (one block at a time).

    The MLP is the largest moment: the residual, the normed input, silu(gate), up and their
    product.
    """
    return model.dtype_bytes * (2 * model.hidden + 3 * model.intermediate)


def checkpoint_bytes_per_token_layer(model: ModelSpec) -> float:
    """What activation recompute keeps per token and block: the block input only."""
    return model.dtype_bytes * model.hidden


def logit_chunk_rows(model: ModelSpec, tp: int) -> int:
    """Token rows of one LM-head chunk: as many as :data:`LOGIT_CHUNK_ELEMENTS` holds of the rank's
    vocabulary slice, at least one (``models.logprobs.chunk_rows``)."""
    return max(1, LOGIT_CHUNK_ELEMENTS // math.ceil(model.vocab / tp))


def logits_bytes(model: ModelSpec, rows: float, tp: int) -> float:
    """Logits of ``rows`` token rows over the rank's vocabulary, in the weight dtype with their
    :data:`LOGIT_FP32_COPIES` fp32 copies."""
    return rows * math.ceil(model.vocab / tp) * (model.dtype_bytes + 4 * LOGIT_FP32_COPIES)


def chunked_logits_bytes(model: ModelSpec, tokens: float, tp: int) -> float:
    """Logits alive while log-probs / entropy of ``tokens`` tokens are computed: one chunk (recomputed
    in backward, so training holds no more)."""
    return logits_bytes(model, min(tokens, logit_chunk_rows(model, tp)), tp)


def kv_cache_bytes(model: ModelSpec, tokens: float, layers: int, tp: int) -> float:
    """KV cache of ``tokens`` tokens over ``layers`` blocks, KV heads split over TP."""
    return tokens * layers * kv_bytes_per_token_layer(model) / tp


def optimizer_step_bytes(model: ModelSpec, params: float) -> float:
    """Temporaries of one AdamW step over ``params`` parameters (activations are freed by then).

    The step runs over pieces of at most :data:`STEP_PIECE_ELEMENTS` elements
    (``models.optim.BoundedAdamW``); below fp32 a piece's gradients are upcast to fp32, and torch's
    foreach AdamW builds ``sqrt(exp_avg_sq)`` of the piece (fp32). Clipping's norm reads the same
    pieces.
    """
    upcast = 4 if model.dtype_bytes < 4 else 0
    return min(params, STEP_PIECE_ELEMENTS) * (upcast + 4)


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


def training_pass_bytes(
    model: ModelSpec,
    layout: Layout,
    pp_rank: int,
    micro_batch: int,
    seq_len: float,
    micro_batches: int,
    recompute: bool,
    lm_head: bool,
) -> float:
    """Activations (and the last stage's LM-head chunk) one GPU of pipeline stage ``pp_rank`` holds
    while training (1F1B schedule): stage ``p`` of ``pp`` keeps ``min(pp - p, micro_batches)``
    micro-batches in flight, each packed to ``micro_batch * seq_len`` tokens. ZeRO does not change it."""
    tokens = micro_batch * seq_len
    in_flight = min(layout.pp - pp_rank, micro_batches)
    layers = stage_layers(model, layout.pp, pp_rank)
    passes = training_activation_bytes(model, layers, tokens, in_flight, layout.tp, recompute)
    if lm_head and pp_rank == layout.pp - 1:
        passes += chunked_logits_bytes(model, tokens, layout.tp)
    return passes


def collective_bytes(model: ModelSpec, layout: Layout, params: float) -> float:
    """Flat buffers alive in a collective over the gradients or row blocks of ``params`` parameters: one
    bucket of at most :data:`FLAT_BUCKET_BYTES` (``models.sharded.all_reduce_flat``), and beside it under
    ZeRO the reduce-scatter's or all-gather's ``1 / shard`` side (``models.zero``)."""
    bucket = min(params * model.dtype_bytes, FLAT_BUCKET_BYTES)
    return bucket * (1 + 1 / layout.shard) if layout.zero else bucket


def step_phase_bytes(model: ModelSpec, layout: Layout, pp_rank: int) -> float:
    """Bytes beyond :func:`rank_state_bytes` one GPU of pipeline stage ``pp_rank`` holds from the end of its
    backward to the end of its optimizer step (activations freed), the larger of two moments:

    - the gradient collectives: the unsharded blocks (:func:`gathered_bytes`), under ZeRO the gradients'
      fresh row blocks beside the whole gradients, and the collective's buffers (:func:`collective_bytes`);
    - the AdamW step over the rank's share (:func:`optimizer_step_bytes`), next to a ZeRO-3 replica's
      whole parameters (released after the step).
    """
    params = rank_params(model, layout, pp_rank)
    grad_blocks = params * model.dtype_bytes / layout.shard if layout.zero else 0.0
    reduce = gathered_bytes(model, layout, pp_rank) + grad_blocks + collective_bytes(model, layout, params)
    whole_params = params * model.dtype_bytes if layout.zero >= 3 else 0.0
    return max(reduce, whole_params + optimizer_step_bytes(model, params / _sharded(layout, 1)))


def training_state_terms(model: ModelSpec, layout: Layout, pp_rank: int) -> tuple[float, float, float]:
    """(state, unsharded blocks, optimizer-step phase) of one GPU of pipeline stage ``pp_rank`` while
    training: :func:`rank_state_bytes`, :func:`gathered_bytes` and :func:`step_phase_bytes`."""
    return (
        rank_state_bytes(model, True, layout, pp_rank),
        gathered_bytes(model, layout, pp_rank),
        step_phase_bytes(model, layout, pp_rank),
    )


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
    """Peak bytes on one GPU of pipeline stage ``pp_rank`` while training: its state, then the larger
    of the pass (:func:`training_pass_bytes`, with ZeRO-2/3's unsharded blocks) and the optimizer step's
    phase, which comes after the activations are freed (:func:`training_state_terms`)."""
    passes = training_pass_bytes(
        model, layout, pp_rank, micro_batch, seq_len, micro_batches, recompute, lm_head
    )
    return training_peak_of(training_state_terms(model, layout, pp_rank), passes)


def training_peak_of(terms: tuple[float, float, float], passes: float) -> float:
    """The training peak from :func:`training_state_terms` and the pass's bytes: the state, then the
    larger of the pass with the unsharded blocks and the optimizer step's phase."""
    state, gathered, step = terms
    return state + max(passes + gathered, step)


def inference_peak_bytes(
    model: ModelSpec, layout: Layout, pp_rank: int, micro_batch: int, seq_len: float, lm_head: bool
) -> float:
    """Peak bytes on one GPU of stage ``pp_rank`` for a forward pass of a packed micro-batch of
    ``micro_batch * seq_len`` tokens (one block's activations alive, one LM-head chunk)."""
    tokens = micro_batch * seq_len
    total = rank_state_bytes(model, False, layout, pp_rank)
    total += tokens * forward_bytes_per_token(model) / layout.tp
    if lm_head and pp_rank == layout.pp - 1:
        total += chunked_logits_bytes(model, tokens, layout.tp)
    return total


def generation_peak_bytes(
    model: ModelSpec,
    layout: Layout,
    pp_rank: int,
    batch: int,
    prompt_len: float,
    new_tokens: float,
    engine: GenerationEngine = BUILTIN_ENGINE,
) -> float:
    """Bytes one GPU of stage ``pp_rank`` needs to decode ``batch`` sequences of ``prompt_len`` +
    ``new_tokens`` tokens.

    Weights and the KV cache the engine allocates (``GenerationEngine.cache_tokens``: the static
    decoder's whole rollout, vLLM's whole blocks), then the larger of the prefill's live block
    and a decode step's ``[batch, V / tp]`` logits (one after the other). An engine that reserves
    a share of the GPU holds :func:`engine_reserved_bytes` when that is more.
    """
    layers = stage_layers(model, layout.pp, pp_rank)
    total = rank_state_bytes(model, False, layout, pp_rank)
    total += kv_cache_bytes(model, batch * engine.cache_tokens(prompt_len, new_tokens), layers, layout.tp)
    prefill = batch * prompt_len * forward_bytes_per_token(model) / layout.tp
    logits = logits_bytes(model, batch, layout.tp) if pp_rank == layout.pp - 1 else 0.0
    return total + max(prefill, logits)


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
