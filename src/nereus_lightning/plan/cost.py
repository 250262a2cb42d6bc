"""The cost model: time and peak memory of one model-stage under one candidate.

Times are built as *ideal* seconds per operation class (peak FLOP/s, HBM and link bandwidth)
and divided by the calibrated efficiency of each class (see ``calibration.py``). A model-stage
is as slow as its slowest replica, which gets ``ceil(sequences / dp)`` sequences.

- Generation = prefill (compute-bound GEMMs + attention) + decode (each step reads the weights
  and the KV cache once: ``max(FLOPs / peak, bytes / HBM)``), batch ``micro_batch`` sequences per
  replica at a time; the wave lasts as long as its p95 response.
- Inference = forward passes of ``micro_batch`` sequences through a pipeline.
- Training = 1F1B pipeline, ``(a + pp - 1)`` micro-batch slots per optimizer step, then the DP
  gradient all-reduce and the AdamW update, for every mini-batch and PPO epoch.
- TP all-reduces per block, PP sends per micro-batch and DP all-reduces are priced on the link
  each group spans (``comm.py``).
- Idle model-stages do not stay on the GPU: each model-stage loads its state from host memory
  when its stage starts and offloads it after (``offload`` time), so one GPU's peak memory is
  that of the model-stage running on it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache

from nereus_lightning.plan import compute, memory
from nereus_lightning.plan.calibration import Calibration, op_class
from nereus_lightning.plan.comm import GroupLink, Links, allreduce_time, p2p_time
from nereus_lightning.plan.layout import Layout
from nereus_lightning.spec.cluster import ClusterSpec
from nereus_lightning.spec.errors import NereusConfigError
from nereus_lightning.spec.model import ModelSpec
from nereus_lightning.spec.workload import ModelStage, Workload

#: Host <-> GPU bandwidth per GPU (PCIe Gen4 x16) for loading and offloading idle state.
HOST_BW = 25e9
#: HBM bytes per parameter of one AdamW update (read weights, grads, fp32 master + 2 moments; write back).
ADAMW_BYTES_PER_PARAM = 32
Ideal = dict[str, float]


@dataclass(frozen=True)
class StageWork:
    """What one model-stage must do in one RL step (sequence counts and lengths)."""

    name: str
    kind: str  # "generation", "inference" or "training"
    role: str  # "actor", "critic", "reference" or "reward"
    model: ModelSpec
    sequences: int
    prompt_len: int
    response_len: float
    response_len_p95: float
    mini_batches: int = 1
    epochs: int = 1
    micro_batch_min: int = 1
    micro_batch_max: int = 16

    @property
    def trains(self) -> bool:
        """Whether this model-stage holds gradients and optimizer state."""
        return self.kind == "training"

    @property
    def lm_head(self) -> bool:
        """Actor and reference need vocabulary logits; critic and reward have a scalar value head."""
        return self.role in ("actor", "reference")

    @property
    def mean_len(self) -> float:
        """Mean tokens per sequence (prompt + response): drives time."""
        return self.prompt_len + self.response_len

    @property
    def max_len(self) -> float:
        """p95 tokens per sequence: drives memory (batches are padded to their long sequences)."""
        return self.prompt_len + self.response_len_p95

    @property
    def mini_batch_size(self) -> int:
        """Sequences per optimizer step."""
        return self.sequences // self.mini_batches


def stage_work(ms: ModelStage, models: Mapping[str, ModelSpec], workload: Workload) -> StageWork:
    """The work of model-stage ``ms`` of ``workload`` with the role -> model mapping ``models``."""
    if ms.model not in models:
        raise NereusConfigError(f"models: no model for role {ms.model!r} (model-stage {ms.name}); give {sorted(models)}")
    sequences = workload.prompts_per_step if ms.name == "actor_greedy_gen" else workload.sequences_per_step
    if ms.stage == "training" and sequences % workload.mini_batches:
        raise NereusConfigError(
            f"workload.mini_batches: {workload.mini_batches} does not divide the {sequences} sequences per step"
        )
    return StageWork(
        ms.name, ms.stage, ms.model, models[ms.model], sequences, workload.prompt_len, workload.response_len,
        workload.response_len_p95, workload.mini_batches, workload.ppo_epochs, workload.micro_batch_min,
        workload.micro_batch_max,
    )


def replica_sequences(work: StageWork, dp: int) -> int | None:
    """Sequences of the busiest replica, or None when ``dp`` cannot split the batch.

    Training keeps the global batch fixed (``dp * b * a`` = mini-batch size), so ``dp`` must
    divide the mini-batch; generation and inference only need one sequence per replica.
    """
    if work.trains:
        return work.mini_batch_size // dp if work.mini_batch_size % dp == 0 else None
    return -(-work.sequences // dp) if dp <= work.sequences else None


def micro_batch_options(work: StageWork, per_replica: int) -> tuple[int, ...]:
    """Per-replica micro-batch (decode batch for generation) sizes the planner considers."""
    if work.kind == "generation":
        # Powers of two below the replica's share, and the whole share at once.
        return tuple(sorted({1 << k for k in range(per_replica.bit_length()) if 1 << k < per_replica} | {per_replica}))
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
    """(layers, has LM head) of the slowest pipeline stage: the first holds the extra layers, the last the head."""
    first = compute.stage_layers(work.model, pp, 0)
    last = compute.stage_layers(work.model, pp, pp - 1)
    head = work.lm_head
    if pp == 1:
        return first, head
    first_flops = compute.gemm_flops_per_token(work.model, first, False)
    last_flops = compute.gemm_flops_per_token(work.model, last, head)
    return (last, head) if last_flops > first_flops else (first, False)


@lru_cache(maxsize=1 << 16)
def _slot(work: StageWork, layout: Layout, micro_batch: int, recompute: bool, links: Links, cluster: ClusterSpec) -> Ideal:
    """One micro-batch through the slowest pipeline stage (training: fwd + bwd; inference: fwd)."""
    model, tp = work.model, layout.tp
    layers, head = _pipeline_stage(work, layout.pp)
    tokens = micro_batch * work.mean_len
    mult = compute.training_multiplier(recompute) if work.trains else 1.0
    gemm = mult * tokens * compute.gemm_flops_per_token(model, layers, head) / tp / cluster.peak_flops
    attn = mult * tokens * compute.attention_flops_per_token(model, layers, work.mean_len / 2) / tp / cluster.peak_flops
    act = tokens * model.hidden * model.dtype_bytes
    passes = (4 if recompute else 3) if work.trains else 1  # forward-like passes, 2 all-reduces per block each
    slot: Ideal = {"gemm": gemm, "attention": attn}
    if tp > 1:
        _add(slot, _comm("allreduce", links.tp, 2 * layers * passes * allreduce_time(act, tp, links.tp, cluster)))
    if layout.pp > 1:
        _add(slot, _comm("p2p", links.pp, (2 if work.trains else 1) * p2p_time(act, links.pp, cluster)))
    return slot


@lru_cache(maxsize=1 << 16)
def _wave(work: StageWork, layout: Layout, batch: int, links: Links, cluster: ClusterSpec) -> Ideal:
    """Generation of ``batch`` sequences on one replica: prefill, then p95-response decode steps."""
    model, tp, pp = work.model, layout.tp, layout.pp
    L, h, peak = model.num_layers, model.hidden, cluster.peak_flops
    prompt = batch * work.prompt_len
    wave: Ideal = {
        "gemm": (prompt * compute.gemm_flops_per_token(model, L, False) + batch * 2.0 * model.vocab * h) / tp / peak,
        "attention": prompt * compute.attention_flops_per_token(model, L, work.prompt_len / 2) / tp / peak,
    }
    steps = math.ceil(work.response_len_p95)
    context = work.prompt_len + work.response_len / 2
    flops = batch * (compute.gemm_flops_per_token(model, L, True) + compute.attention_flops_per_token(model, L, context))
    reads = compute.weight_bytes(model.num_params, model) + memory.kv_cache_bytes(model, batch * context, L, 1)
    wave["decode"] = steps * max(flops / tp / peak, reads / tp / cluster.hbm_bw)
    if tp > 1:
        per_step = 2 * L * allreduce_time(batch * h * model.dtype_bytes, tp, links.tp, cluster)
        _add(wave, _comm("allreduce", links.tp, 2 * L * allreduce_time(prompt * h * model.dtype_bytes, tp, links.tp, cluster)))
        _add(wave, _comm("allreduce", links.tp, steps * per_step))
    if pp > 1:
        send = (pp - 1) * (p2p_time(prompt * h * model.dtype_bytes, links.pp, cluster) + steps * p2p_time(batch * h * model.dtype_bytes, links.pp, cluster))
        _add(wave, _comm("p2p", links.pp, send))
    return wave


def _offload(work: StageWork, layout: Layout) -> Ideal:
    """Loading this model-stage's state from host memory before its stage and offloading it after."""
    return {"offload": 2 * memory.state_bytes_per_gpu(work.model, work.trains, layout) / HOST_BW}


def _optimizer_step(work: StageWork, layout: Layout, dp: int, links: Links, cluster: ClusterSpec) -> Ideal:
    """Per optimizer step: DP gradient all-reduce (weight dtype) and the HBM-bound AdamW update."""
    params = max(memory.stage_params(work.model, layout.pp, r) for r in range(layout.pp)) / layout.tp
    step: Ideal = {"decode": params * ADAMW_BYTES_PER_PARAM / cluster.hbm_bw}
    _add(step, _comm("allreduce", links.dp, allreduce_time(params * work.model.dtype_bytes, dp, links.dp, cluster)))
    return step


def ideal_time(
    work: StageWork, layout: Layout, dp: int, micro_batch: int, recompute: bool, links: Links, cluster: ClusterSpec
) -> Ideal:
    """Ideal seconds per operation class for one RL step of ``work`` under this candidate."""
    per_replica = replica_sequences(work, dp)
    if per_replica is None:
        raise NereusConfigError(f"{work.name}: dp={dp} cannot split {work.sequences} sequences ({work.kind})")
    total: Ideal = {}
    if work.kind == "generation":
        full, rest = divmod(per_replica, micro_batch)
        _add(total, _wave(work, layout, micro_batch, links, cluster), full)
        if rest:
            _add(total, _wave(work, layout, rest, links, cluster))
    else:
        slots = -(-per_replica // micro_batch) + layout.pp - 1
        if work.trains:
            step = dict(_slot(work, layout, micro_batch, recompute, links, cluster))
            for name in step:
                step[name] *= slots
            _add(step, _optimizer_step(work, layout, dp, links, cluster))
            _add(total, step, work.epochs * work.mini_batches)
        else:
            _add(total, _slot(work, layout, micro_batch, False, links, cluster), slots)
    _add(total, _offload(work, layout))
    return total


def latency(ideal: Mapping[str, float], calibration: Calibration | None = None) -> float:
    """Predicted seconds: each class's ideal time divided by its calibrated efficiency."""
    cal = calibration or _DEFAULT
    return sum(seconds / cal.efficiency(name) for name, seconds in ideal.items())


def rank_peak_memory(work: StageWork, layout: Layout, dp: int, micro_batch: int, recompute: bool) -> tuple[float, ...]:
    """Peak bytes on one GPU of each pipeline stage (index = pp rank)."""
    per_replica = replica_sequences(work, dp) or 1
    model = work.model
    if work.kind == "generation":
        batch = min(micro_batch, per_replica)
        return tuple(
            memory.generation_peak_bytes(model, layout, r, batch, work.prompt_len, work.max_len) for r in range(layout.pp)
        )
    if work.kind == "inference":
        return tuple(
            memory.inference_peak_bytes(model, layout, r, micro_batch, work.max_len, work.lm_head) for r in range(layout.pp)
        )
    micro_batches = -(-per_replica // micro_batch)
    return tuple(
        memory.training_peak_bytes(model, layout, r, micro_batch, work.max_len, micro_batches, recompute, work.lm_head)
        for r in range(layout.pp)
    )


_DEFAULT = Calibration()
