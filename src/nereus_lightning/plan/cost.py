"""The cost model: time and peak memory of one model-stage under one candidate.

Times are built as *ideal* seconds per operation class (peak FLOP/s, HBM and link bandwidth)
and divided by the calibrated efficiency of each class (see ``calibration.py``). A model-stage
is as slow as its slowest replica, which gets ``ceil(sequences / dp)`` sequences.

- Generation = prefill (compute-bound GEMMs + attention) + decode, batch ``micro_batch``
  sequences per replica at a time; the wave lasts as long as its p95 response. Each decode step
  reads the weights and the KV cache it attends over once (``max(FLOPs / peak, bytes / HBM)``):
  the static decoder attends over its whole preallocated cache every step, vLLM over the
  running context (:func:`decode_context`). Each step also pays the fixed cost of its kernels
  (class ``launch``, :data:`DECODE_KERNELS_PER_LAYER`): a replayed CUDA graph of fused kernels
  saves the host's launch work, but at decode sizes every kernel still takes about a launch's time
  on the GPU.
- Inference = forward passes of ``micro_batch`` sequences through a pipeline.
- Training = 1F1B pipeline, ``(a + pp - 1)`` micro-batch slots per optimizer step, then the DP
  gradient all-reduce and the AdamW update, for every mini-batch and PPO epoch. A ZeRO-sharded
  replica (``Layout.shard``) runs ``a`` micro-batches on each shard rank; its collectives in the
  shard group come once per optimizer step at every ZeRO stage, as the body runs them
  (``models.zero.ZeroShards``): the whole gradients the micro-batches accumulated are summed once
  (ZeRO-1: an all-reduce; ZeRO-2/3: a reduce-scatter into row blocks) and the weights all-gathered
  once (ZeRO-1/2 after the update; ZeRO-3 before the next pass, which holds them whole throughout:
  ``memory.gathered_bytes``), :func:`_optimizer_step`.
- Each operation is priced per stage kind (``training.gemm``, ``inference.gemm``...): a training
  step's GEMMs run at another efficiency than a forward-only pass's, and each measured stage
  calibrates its own classes only.
- TP all-reduces per block, PP sends per micro-batch and DP all-reduces are priced on the link
  each group spans (``comm.py``).
- Every eager forward-like pass (a slot's forward, backward and recompute; a prefill) also pays
  ``layers * KERNELS_PER_LAYER * launch_s`` of kernel launches, independent of the batch: priced
  as GEMM time (it scales with the GEMM efficiency), it is why fewer, larger micro-batches run
  faster.
- Memory: a training model-stage keeps its state (weights, gradients, AdamW) resident on its
  GPUs for the whole step; a generation or inference model-stage loads its weights from host
  memory when its stage starts and drops them after (``offload`` time), and runs next to the
  training state resident on the same GPUs. The terms are ``memory.py``'s.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from functools import lru_cache

from nereus_lightning.plan import compute, memory
from nereus_lightning.plan.calibration import Calibration, op_class, qualified
from nereus_lightning.plan.comm import GroupLink, Links, allgather_time, allreduce_time, p2p_time
from nereus_lightning.plan.layout import Layout
from nereus_lightning.spec.cluster import ClusterSpec
from nereus_lightning.spec.errors import NereusConfigError, require
from nereus_lightning.spec.model import ModelSpec
from nereus_lightning.spec.workload import GenerationEngine, ModelStage, Workload

#: Host <-> GPU bandwidth per GPU (PCIe Gen4 x16) for loading and offloading idle state.
HOST_BW = 25e9
#: HBM bytes per parameter of one AdamW update (read weights, grads, fp32 master + 2 moments; write back).
ADAMW_BYTES_PER_PARAM = 32
#: Kernels one transformer layer launches per forward-like pass in an eager framework (norms,
#: QKV / output / MLP GEMMs, rotary, attention, activation, residual adds: ~10-20). With
#: ``ClusterSpec.launch_s`` this is the fixed host cost of a pass, paid whatever its batch.
KERNELS_PER_LAYER = 16
#: Kernels one layer runs per decode step, replayed as a CUDA graph of fused kernels (the built-in
#: engine's inductor graph, vLLM's own): the QKV, output, gate-up and down GEMMs, attention, the
#: rotary embedding with the cache write, the activation, and the norm with its residual add. At
#: decode sizes each takes about a launch's time on the GPU, whatever the batch.
DECODE_KERNELS_PER_LAYER = 8
Ideal = dict[str, float]


@dataclass(frozen=True)
class StageWork:
    """What one model-stage must do in one RL step (sequence counts and lengths)."""

    name: str
    kind: str  # "generation", "inference" or "training"
    role: str  # "actor", "critic", "reference" or "reward"
    model: ModelSpec
    sequences: int
    prompt_len: float  # a mean
    response_len: float
    response_len_p95: float
    mini_batches: int = 1
    epochs: int = 1
    micro_batch_min: int = 1
    micro_batch_max: int = 16
    engine: GenerationEngine = memory.BUILTIN_ENGINE  # generation: the rollout engine that holds its memory
    gpu_memory: float = 0.0  # generation: bytes per GPU (what an engine reserving a share takes it of)
    rounds: float = 1.0  # generation: rounds per step (dynamic sampling generates the batch again)
    trains: bool = field(init=False, compare=False, repr=False)  # holds gradients and optimizer state

    def __post_init__(self) -> None:
        # Hashed on every memoised cost lookup: compute the (nested) field hash once.
        object.__setattr__(self, "trains", self.kind == "training")
        object.__setattr__(self, "_hash", hash(tuple(getattr(self, f.name) for f in fields(self) if f.init)))

    def __hash__(self) -> int:
        return self._hash  # type: ignore[attr-defined]

    @property
    def lm_head(self) -> bool:
        """Whether the model computes vocabulary logits (a causal LM: actor, reference); a value model
        (critic, reward: ``ModelSpec.num_labels``) has a ``score`` head of a few outputs instead."""
        return not self.model.num_labels

    @property
    def mean_len(self) -> float:
        """Mean tokens per sequence (prompt + response): drives time."""
        return self.prompt_len + self.response_len

    @property
    def max_len(self) -> float:
        """p95 tokens per sequence: drives memory (a packed micro-batch holds up to
        ``micro_batch * max_len`` tokens)."""
        return self.prompt_len + self.response_len_p95

    @property
    def mini_batch_size(self) -> int:
        """Sequences per optimizer step."""
        return self.sequences // self.mini_batches

    @property
    def reserved(self) -> float:
        """Bytes per GPU the generation engine takes whatever its batch (vLLM's share; 0: what it needs)."""
        return memory.engine_reserved_bytes(self.engine, self.gpu_memory)


def stage_work(
    ms: ModelStage, models: Mapping[str, ModelSpec], workload: Workload, gpu_memory: float = 0.0
) -> StageWork:
    """The work of model-stage ``ms`` of ``workload`` with the role -> model mapping ``models``.

    ``gpu_memory`` (bytes per GPU) prices a generation engine that reserves a share of each GPU.
    """
    if ms.model not in models:
        raise NereusConfigError(
            f"models: no model for role {ms.model!r} (model-stage {ms.name}); give {sorted(models)}"
        )
    sequences = workload.prompts_per_step if ms.name == "actor_greedy_gen" else workload.sequences_per_step
    if ms.stage == "training" and sequences % workload.mini_batches:
        raise NereusConfigError(
            f"workload.mini_batches: {workload.mini_batches} does not divide the {sequences} sequences per "
            "step"
        )
    engine = workload.generation_engine if ms.stage == "generation" else memory.BUILTIN_ENGINE
    require(
        not engine.reserves or gpu_memory > 0,
        "stage_work",
        f"{ms.name}: pricing {engine.kind}'s gpu_memory_utilization needs the GPU's memory (gpu_memory)",
    )
    return StageWork(
        ms.name,
        ms.stage,
        ms.model,
        models[ms.model],
        sequences,
        workload.prompt_len,
        workload.response_len,
        workload.response_len_p95,
        workload.mini_batches,
        workload.ppo_epochs,
        workload.micro_batch_min,
        workload.micro_batch_max,
        engine,
        gpu_memory if engine.reserves else 0.0,
        workload.generation_rounds if ms.stage == "generation" else 1.0,
    )


def replica_sequences(work: StageWork, dp: int) -> int | None:
    """Sequences of the busiest of ``dp`` data-parallel ranks, or None when ``dp`` cannot split the batch.

    The data-parallel ranks are the replicas, times the shard degree of a sharded training layout
    (each shard rank runs micro-batches of its own). Training keeps the global batch fixed
    (``dp * b * a`` = mini-batch size), so ``dp`` must divide the mini-batch; generation and
    inference only need one sequence per replica.
    """
    if work.trains:
        return work.mini_batch_size // dp if work.mini_batch_size % dp == 0 else None
    return -(-work.sequences // dp) if dp <= work.sequences else None


def micro_batch_options(work: StageWork, layout: Layout, per_replica: int, cap: float) -> tuple[int, ...]:
    """Per-replica micro-batch sizes the planner considers for a replica with ``per_replica`` sequences.

    Generation: the one decode batch :func:`generation_batch` (none if not even one sequence
    fits). Training: sizes in [micro_batch_min, micro_batch_max] that divide the share (so
    ``dp * b * a`` stays the mini-batch). Inference: powers of two in those bounds and the
    largest allowed size.
    """
    if work.kind == "generation":
        batch = generation_batch(work, layout, per_replica, cap)
        return (batch,) if batch else ()
    lo, hi = work.micro_batch_min, min(work.micro_batch_max, per_replica)
    if work.trains:
        return tuple(b for b in range(lo, hi + 1) if per_replica % b == 0)
    if lo > per_replica:
        return (per_replica,)
    return tuple(sorted({1 << k for k in range(hi.bit_length()) if lo <= 1 << k <= hi} | {hi}))


def _add(total: Ideal, part: Mapping[str, float], times: float = 1.0) -> None:
    for name, seconds in part.items():
        if seconds:
            total[name] = total.get(name, 0.0) + times * seconds


def _comm(cls: str, link: GroupLink, seconds: float) -> Ideal:
    return {op_class(cls, link.inter): seconds} if seconds else {}


def _pipeline_stage(work: StageWork, pp: int) -> tuple[int, bool]:
    """(layers, has LM head) of the slowest pipeline stage: the first holds the extra layers, the last the
    head.
    """
    first = compute.stage_layers(work.model, pp, 0)
    last = compute.stage_layers(work.model, pp, pp - 1)
    head = work.lm_head
    if pp == 1:
        return first, head
    first_flops = compute.gemm_flops_per_token(work.model, first, False)
    last_flops = compute.gemm_flops_per_token(work.model, last, head)
    return (last, head) if last_flops > first_flops else (first, False)


@dataclass(frozen=True)
class Affine:
    """Ideal seconds per class for a batch of ``n`` sequences: ``fixed + per_seq * n`` per class,
    plus (generation only) ``steps * max(decode_flops * n, decode_fixed + decode_per_seq * n)``,
    the decode roofline in seconds (compute vs HBM reads of weights and KV cache).

    Every term of a slot or a wave is affine in the batch except the roofline's max, so the
    planner evaluates thousands of batch sizes from one set of coefficients.
    """

    fixed: tuple[tuple[str, float], ...]
    per_seq: tuple[tuple[str, float], ...]
    steps: int = 0
    decode_flops: float = 0.0
    decode_fixed: float = 0.0
    decode_per_seq: float = 0.0

    def at(self, n: int) -> Ideal:
        """The ideal seconds per class for ``n`` sequences."""
        out: Ideal = {}
        _add(out, dict(self.fixed))
        _add(out, dict(self.per_seq), n)
        if self.steps:
            _add(
                out,
                {
                    "decode": self.steps
                    * max(self.decode_flops * n, self.decode_fixed + self.decode_per_seq * n)
                },
            )
        return out


def _affine(parts: list[tuple[str, float, float]], **decode: float) -> Affine:
    fixed: Ideal = {}
    per_seq: Ideal = {}
    for name, a, b in parts:
        _add(fixed, {name: a})
        _add(per_seq, {name: b})
    return Affine(tuple(fixed.items()), tuple(per_seq.items()), **decode)  # type: ignore[arg-type]


def _launch_time(layers: int, cluster: ClusterSpec) -> float:
    """Seconds of kernel launches of one forward-like pass through ``layers`` layers."""
    return layers * KERNELS_PER_LAYER * cluster.launch_s


def _comm_part(
    collective: str, link: GroupLink, times: float, fn, bytes_per_seq: float
) -> tuple[str, float, float]:
    """A collective of ``bytes_per_seq * n`` bytes as (class, fixed, per-sequence) seconds."""
    one, two = fn(bytes_per_seq), fn(2 * bytes_per_seq)
    return op_class(collective, link.inter), times * (2 * one - two), times * (two - one)


#: Forward-like passes of host work and launches a micro-batch trained with activation recompute
#: pays: the recomputed forward runs under autograd's saved-tensor hooks, which cost about as much
#: again as the forward itself (measured: the README's "Long responses"); its FLOPs are one forward
#: more (``compute.training_multiplier``).
RECOMPUTE_LAUNCH_PASSES = 6


@lru_cache(maxsize=1 << 14)
def slot_affine(
    work: StageWork, layout: Layout, recompute: bool, links: Links, cluster: ClusterSpec
) -> Affine:
    """One micro-batch through the slowest pipeline stage (training: fwd + bwd; inference: fwd)."""
    model, tp = work.model, layout.tp
    layers, head = _pipeline_stage(work, layout.pp)
    tokens = work.mean_len  # per sequence
    mult = compute.training_multiplier(recompute) if work.trains else 1.0
    gemm = mult * tokens * compute.gemm_flops_per_token(model, layers, head) / tp / cluster.peak_flops
    attn = (
        mult
        * tokens
        * compute.attention_flops_per_token(model, layers, work.mean_len / 2)
        / tp
        / cluster.peak_flops
    )
    act = tokens * model.hidden * model.dtype_bytes
    # Forward-like passes (backward = 2), 2 all-reduces per block and one set of launches each.
    passes = (4 if recompute else 3) if work.trains else 1
    launches = (RECOMPUTE_LAUNCH_PASSES if recompute else 3) if work.trains else 1
    parts = [("gemm", launches * _launch_time(layers, cluster), gemm), ("attention", 0.0, attn)]
    if tp > 1:
        parts.append(
            _comm_part(
                "allreduce",
                links.tp,
                2 * layers * passes,
                lambda b: allreduce_time(b, tp, links.tp, cluster),
                act,
            )
        )
    if layout.pp > 1:
        parts.append(
            _comm_part(
                "p2p", links.pp, 2 if work.trains else 1, lambda b: p2p_time(b, links.pp, cluster), act
            )
        )
    return _affine(parts)


def decode_context(work: StageWork) -> float:
    """KV-cache slots a decode step attends over per sequence, averaged over the rollout.

    The static decoder attends over its whole preallocated cache at every step (its masks hide
    the slots not written yet, but the kernel reads them all); vLLM over the running context,
    the prompt plus half the mean response.
    """
    if work.engine.paged:
        return work.prompt_len + work.response_len / 2
    return work.engine.cache_tokens(work.prompt_len, work.response_len_p95)


@lru_cache(maxsize=1 << 14)
def wave_affine(work: StageWork, layout: Layout, links: Links, cluster: ClusterSpec) -> Affine:
    """Generation of a batch on one replica: prefill, then p95-response decode steps.

    A decode step goes through all ``L`` layers (every pipeline stage in turn): it pays their
    kernels' fixed cost and reads all weights and the KV cache of :func:`decode_context`.
    """
    model, tp, pp = work.model, layout.tp, layout.pp
    L, h, peak, nbytes = model.num_layers, model.hidden, cluster.peak_flops, model.dtype_bytes
    P = work.prompt_len
    gemm = (P * compute.gemm_flops_per_token(model, L, False) + 2.0 * model.vocab * h) / tp / peak
    attn = P * compute.attention_flops_per_token(model, L, P / 2) / tp / peak
    steps = math.ceil(work.response_len_p95)
    context = decode_context(work)
    flops = compute.gemm_flops_per_token(model, L, True) + compute.attention_flops_per_token(
        model, L, context
    )
    parts = [
        ("gemm", _launch_time(L, cluster), gemm),  # the prefill's launches
        ("attention", 0.0, attn),
        ("launch", steps * L * DECODE_KERNELS_PER_LAYER * cluster.launch_s, 0.0),  # the decode steps
    ]
    if tp > 1:
        allreduce = lambda b: allreduce_time(b, tp, links.tp, cluster)  # noqa: E731
        parts.append(_comm_part("allreduce", links.tp, 2 * L, allreduce, P * h * nbytes))  # prefill
        parts.append(_comm_part("allreduce", links.tp, 2 * L * steps, allreduce, h * nbytes))  # decode
    if pp > 1:
        send = lambda b: p2p_time(b, links.pp, cluster)  # noqa: E731
        parts.append(_comm_part("p2p", links.pp, pp - 1, send, P * h * nbytes))
        parts.append(_comm_part("p2p", links.pp, (pp - 1) * steps, send, h * nbytes))
    return _affine(
        parts,
        steps=steps,
        decode_flops=flops / tp / peak,
        decode_fixed=compute.weight_bytes(model.num_params, model) / tp / cluster.hbm_bw,
        decode_per_seq=memory.kv_cache_bytes(model, context, L, tp) / cluster.hbm_bw,
    )


def _slot(
    work: StageWork, layout: Layout, micro_batch: int, recompute: bool, links: Links, cluster: ClusterSpec
) -> Ideal:
    """One micro-batch of ``micro_batch`` sequences through the slowest pipeline stage."""
    return slot_affine(work, layout, recompute, links, cluster).at(micro_batch)


def _wave(work: StageWork, layout: Layout, batch: int, links: Links, cluster: ClusterSpec) -> Ideal:
    """Generation of ``batch`` sequences on one replica."""
    return wave_affine(work, layout, links, cluster).at(batch)


def _offload(work: StageWork, layout: Layout) -> Ideal:
    """Loading a generation/inference model-stage's weights from host memory before its stage and
    dropping them after; training state stays resident on its GPUs (too big to move every step)."""
    if work.trains:
        return {}
    return {"offload": 2 * memory.state_bytes_per_gpu(work.model, False, layout) / HOST_BW}


def _stage_params(work: StageWork, layout: Layout) -> float:
    """Parameters of one GPU of the largest pipeline stage (its TP cut, before any ZeRO sharding)."""
    return max(memory.rank_params(work.model, layout, r) for r in {0, layout.pp - 1})


def _optimizer_step(work: StageWork, layout: Layout, dp: int, links: Links, cluster: ClusterSpec) -> Ideal:
    """Per optimizer step: the gradient sync, the HBM-bound AdamW update of the rank's share of the
    state, and (sharded) the all-gather of the weights in the shard group.

    Unsharded, the gradients are all-reduced over the ``dp`` replicas. Sharded (HSDP), the whole
    gradients the step's micro-batches accumulated are summed in the shard group once (ZeRO-1
    all-reduces them, ZeRO-2/3 reduce-scatter them into row blocks), each row block is all-reduced
    over the replicas, and the weights are all-gathered once: ZeRO-1/2 after the update, ZeRO-3
    before the next step's pass (``models.zero.ZeroShards.step`` and ``gather``).
    """
    params, nbytes, d = _stage_params(work, layout), work.model.dtype_bytes, layout.shard
    grads = params * nbytes
    step: Ideal = {"optimizer": params / d * ADAMW_BYTES_PER_PARAM / cluster.hbm_bw}
    _add(step, _comm("allreduce", links.dp, allreduce_time(grads / d, dp, links.dp, cluster)))
    if layout.zero:
        gather = allgather_time(grads, d, links.shard, cluster)  # = a reduce-scatter of the same bytes
        if layout.zero == 1:
            _add(step, _comm("allreduce", links.shard, allreduce_time(grads, d, links.shard, cluster)))
        else:
            _add(step, _comm("allgather", links.shard, gather))
        _add(step, _comm("allgather", links.shard, gather))
    return step


def ideal_time(
    work: StageWork,
    layout: Layout,
    dp: int,
    micro_batch: int,
    recompute: bool,
    links: Links,
    cluster: ClusterSpec,
) -> Ideal:
    """Ideal seconds per operation class (``<kind>.<operation>``) of one RL step of ``work``."""
    per_replica = replica_sequences(work, dp * layout.shard)
    if per_replica is None:
        raise NereusConfigError(
            f"{work.name}: dp={dp} x shard={layout.shard} cannot split {work.sequences} sequences "
            f"({work.kind})"
        )
    total: Ideal = {}
    if work.kind == "generation":
        full, rest = divmod(per_replica, micro_batch)
        _add(total, _wave(work, layout, micro_batch, links, cluster), full * work.rounds)
        if rest:
            _add(total, _wave(work, layout, rest, links, cluster), work.rounds)
    else:
        count = -(-per_replica // micro_batch)
        slots = count + layout.pp - 1
        if work.trains:
            step = dict(_slot(work, layout, micro_batch, recompute, links, cluster))
            for name in step:
                step[name] *= slots
            _add(step, _optimizer_step(work, layout, dp, links, cluster))
            _add(total, step, work.epochs * work.mini_batches)
        else:
            _add(total, _slot(work, layout, micro_batch, False, links, cluster), slots)
    _add(total, _offload(work, layout))
    return qualified(work.kind, total)


def latency(ideal: Mapping[str, float], calibration: Calibration | None = None) -> float:
    """Predicted seconds: each class's ideal time divided by its calibrated efficiency."""
    cal = calibration or _DEFAULT
    return sum(seconds / cal.efficiency(name) for name, seconds in ideal.items())


def rank_peak_memory(
    work: StageWork, layout: Layout, dp: int, micro_batch: int, recompute: bool
) -> tuple[float, ...]:
    """Peak bytes on one GPU of each pipeline stage (index = pp rank)."""
    per_replica = replica_sequences(work, dp * layout.shard) or 1
    if work.kind == "generation":
        return tuple(
            max(b, work.reserved) for b in _rank_memory(work, layout, min(micro_batch, per_replica), False, 0)
        )
    if work.kind == "inference":
        return _rank_memory(work, layout, micro_batch, False, 0)
    micro_batches = -(-per_replica // micro_batch)
    return _rank_memory(work, layout, micro_batch, recompute, min(micro_batches, layout.pp))


@lru_cache(maxsize=1 << 16)
def _rank_memory(
    work: StageWork,
    layout: Layout,
    batch: int,
    recompute: bool,
    micro_batches: int,
    ranks: tuple[int, ...] | None = None,
) -> tuple[float, ...]:
    model = work.model
    ranks = tuple(range(layout.pp)) if ranks is None else ranks
    if work.kind == "generation":
        return tuple(
            memory.generation_peak_bytes(
                model, layout, r, batch, work.prompt_len, work.response_len_p95, work.engine
            )
            for r in ranks
        )
    if work.kind == "inference":
        return tuple(
            memory.inference_peak_bytes(model, layout, r, batch, work.max_len, work.lm_head) for r in ranks
        )
    return tuple(
        memory.training_peak_bytes(
            model, layout, r, batch, work.max_len, micro_batches, recompute, work.lm_head
        )
        for r in ranks
    )


def peak_memory(work: StageWork, layout: Layout, dp: int, micro_batch: int, recompute: bool) -> float:
    """Peak bytes on the most-loaded GPU of a replica: always the first or the last pipeline stage.

    The first stage holds the most layers, the embedding and the most in-flight micro-batches;
    the last holds the LM head and the logits; middle stages hold no more than the first.
    """
    share = replica_sequences(work, dp * layout.shard) or 1
    ends = (0, layout.pp - 1) if layout.pp > 1 else (0,)
    if work.kind == "generation":
        return max(work.reserved, *_rank_memory(work, layout, min(micro_batch, share), False, 0, ends))
    if work.kind == "inference":
        return max(_rank_memory(work, layout, micro_batch, False, 0, ends))
    return max(
        _rank_memory(work, layout, micro_batch, recompute, min(-(-share // micro_batch), layout.pp), ends)
    )


@lru_cache(maxsize=1 << 14)
def wave_memory(work: StageWork, layout: Layout) -> tuple[tuple[float, float], ...]:
    """Generation's own peak bytes on the first and the last pipeline rank as ``(fixed, per
    sequence)``: affine in the batch (weights and workspace, then KV cache, prefill or logits per
    sequence); an engine that reserves a share of the GPU holds at least that."""
    ends = (0, layout.pp - 1) if layout.pp > 1 else (0,)
    base = _rank_memory(work, layout, 0, False, 0, ends)
    one = _rank_memory(work, layout, 1, False, 0, ends)
    return tuple((b0, b1 - b0) for b0, b1 in zip(base, one, strict=True))


def wave_peak(work: StageWork, layout: Layout, batch: int) -> float:
    """:func:`peak_memory` of a generation replica decoding ``batch`` sequences, from :func:`wave_memory`."""
    return max(work.reserved, *(fixed + per_seq * batch for fixed, per_seq in wave_memory(work, layout)))


@lru_cache(maxsize=1 << 14)
def generation_batch(work: StageWork, layout: Layout, per_replica: int, cap: float) -> int:
    """Sequences a generation replica decodes at once: as many as fit under ``cap`` (like vLLM's
    KV-cache-filling continuous batching), at most its share; 0 when not even one fits.

    Generation memory is affine in the batch on every pipeline rank, so the largest batch is
    solved in closed form and then checked exactly. An engine that reserves a share of the GPU
    (vLLM) fills that share instead, when it fits under ``cap``.
    """
    cap = memory.generation_budget(work.reserved, cap)
    ends = (0, layout.pp - 1) if layout.pp > 1 else (0,)
    fit = per_replica
    for fixed, per_seq in wave_memory(work, layout):
        fit = min(fit, int((cap - fixed) // per_seq) if cap >= fixed else -1)
    while fit > 0 and max(_rank_memory(work, layout, fit, False, 0, ends)) > cap:
        fit -= 1
    return max(fit, 0)


_DEFAULT = Calibration()


def clear_cost_caches() -> None:
    """Drop every memoised cost piece (benchmarks measure cold planning; long simulations bound memory)."""
    from nereus_lightning.plan import comm

    for cached in (
        slot_affine,
        wave_affine,
        wave_memory,
        _rank_memory,
        generation_batch,
        comm.canonical_links,
        memory._layer_params,
    ):
        cached.cache_clear()
