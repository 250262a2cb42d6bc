"""`ShardedCausalLM`: one rank's piece (one TP shard of one PP stage) of a transformers causal LM.

The decoder layers, norms and rotary embedding are transformers' own modules, built from a
config whose heads, KV heads and intermediate size are divided by ``tp`` (so RoPE variants,
Qwen2 biases and Qwen3 q/k norms behave exactly as in transformers). Around them sit the
Megatron-style TP collectives of :mod:`.tp_ops`: a vocabulary-parallel embedding, an
identity/all-reduce before the attention and MLP inputs, row-parallel ``o_proj`` / ``down_proj``
that all-reduce their output (and add their replicated bias once), and a vocabulary-parallel
LM head. Parameter names are the model's global names (``model.layers.5.mlp.up_proj.weight``).

Parameters are the very tensors passed in (an EMU's shards): an ``nn.Parameter`` is used as is;
a plain tensor is wrapped in an ``nn.Parameter`` that shares its storage, so in-place optimizer
updates are seen by the owner either way.
"""

from __future__ import annotations

import copy
import functools
import sys
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from nereus_lightning.models.groups import ReplicaComm
from nereus_lightning.models.sharding import layer_range, placement, pp_stages, tp_plan_of, tp_slices
from nereus_lightning.models.tp_ops import copy_to_tp, gather_from_tp, reduce_from_tp
from nereus_lightning.plan.layout import Layout
from nereus_lightning.spec.errors import require
from nereus_lightning.spec.model import ModelSpec


def validate_layout(config: Any, layout: Layout) -> None:
    """Reject a layout that would split a head, a KV head, the MLP or the vocabulary, or exceed the layers."""
    spec = ModelSpec.from_hf_config(config)
    spec.validate_tp(layout.tp)
    spec.validate_pp(layout.pp)
    for field, size in (("intermediate_size", spec.intermediate), ("vocab_size", spec.vocab)):
        require(
            size % layout.tp == 0,
            "layout.tp",
            f"tp={layout.tp} does not divide {field}={size} of {spec.name}",
        )


def has_value_head(config: Any) -> bool:
    """Whether ``config`` describes a value model: transformers token classification (``score`` replaces ``lm_head``).

    The critic and the reward model are such models with ``num_labels == 1``, as in verl; their
    config names a ``*ForTokenClassification`` architecture.
    """
    return any(a.endswith("ForTokenClassification") for a in getattr(config, "architectures", None) or ())


def is_tied(config: Any) -> bool:
    """Whether the LM head is the input embedding (never for a value model: it has no LM head)."""
    return bool(getattr(config, "tie_word_embeddings", False)) and not has_value_head(config)


def _modules_of(config: Any) -> tuple[type, type, type]:
    """transformers' decoder-layer, RMSNorm and rotary classes for ``config``'s model family."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        lm_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError as exc:
        raise NotImplementedError(f"{type(config).__name__} has no transformers causal-LM class") from exc
    prefix = lm_class.__name__.removesuffix("ForCausalLM")
    module = sys.modules[lm_class.__module__]
    names = (f"{prefix}DecoderLayer", f"{prefix}RMSNorm", f"{prefix}RotaryEmbedding")
    missing = [n for n in names if not hasattr(module, n)]
    if missing:
        raise NotImplementedError(
            f"{lm_class.__name__}: no {missing} in {module.__name__}; not a Llama-like model"
        )
    return tuple(getattr(module, n) for n in names)  # type: ignore[return-value]


def local_config(config: Any, tp: int) -> Any:
    """A copy of ``config`` describing one TP shard: heads, KV heads and intermediate divided by ``tp``."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    local = copy.deepcopy(config)
    local.num_attention_heads = config.num_attention_heads // tp
    local.num_key_value_heads = (
        getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    ) // tp
    local.intermediate_size = config.intermediate_size // tp
    local.head_dim = head_dim
    local._attn_implementation = config._attn_implementation or "sdpa"
    return local


def shard_state(
    model_or_state: nn.Module | Mapping[str, Tensor], config: Any, layout: Layout, pp_rank: int, tp_rank: int
) -> dict[str, Tensor]:
    """Rank (pp_rank, tp_rank)'s shards of a full model, keyed by global name (contiguous copies)."""
    validate_layout(config, layout)
    if isinstance(model_or_state, nn.Module):
        state = dict(model_or_state.named_parameters())  # tied weights appear once, as the embedding
    else:
        state = dict(model_or_state)
        if is_tied(config):
            state.pop("lm_head.weight", None)
    plan, tied = tp_plan_of(config), is_tied(config)
    out: dict[str, Tensor] = {}
    for name, full in state.items():
        p = placement(name, plan)
        if pp_rank in pp_stages(p, config.num_hidden_layers, layout.pp, tied):
            out[name] = full.detach()[tp_slices(tuple(full.shape), p, layout.tp, tp_rank)].clone()
    return out


class VocabParallelEmbedding(nn.Module):
    """Embedding whose rows ``[vocab_start, vocab_start + rows)`` live here; summed over TP."""

    def __init__(
        self, weight: nn.Parameter, vocab_start: int, padding_idx: int | None, comm: ReplicaComm
    ) -> None:
        super().__init__()
        self.weight = weight
        self.vocab_start = vocab_start
        rows = weight.shape[0]
        local_pad = None if padding_idx is None else padding_idx - vocab_start
        self.padding_idx = local_pad if local_pad is not None and 0 <= local_pad < rows else None
        self.comm = comm

    def forward(self, input_ids: Tensor) -> Tensor:
        """Embeddings of global token ids (full rows on every TP rank)."""
        if self.comm.layout.tp == 1:
            return F.embedding(input_ids, self.weight, self.padding_idx)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight, self.padding_idx)
        out = out * (~outside).unsqueeze(-1).to(out.dtype)
        return reduce_from_tp(out, self.comm.tp_group)


class RowParallelLinear(nn.Module):
    """A linear layer cut along its input: partial products summed over TP, then the bias once."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, comm: ReplicaComm) -> None:
        super().__init__()
        self.weight = weight
        self.bias = bias
        self.comm = comm

    def forward(self, x: Tensor) -> Tensor:
        """``all_reduce(x @ W_local^T) + b``."""
        out = reduce_from_tp(
            F.linear(x, self.weight), self.comm.tp_group if self.comm.layout.tp > 1 else None
        )
        return out if self.bias is None else out + self.bias


class LMHead(nn.Module):
    """The untied LM head's vocabulary shard (``lm_head.weight``)."""

    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.weight = weight


class ValueHead(nn.Module):
    """A value model's ``score`` head (``[num_labels, hidden]`` and its bias), replicated over TP."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None) -> None:
        super().__init__()
        self.weight = weight
        self.bias = bias


def _as_param(t: Tensor) -> nn.Parameter:
    return t if isinstance(t, nn.Parameter) else nn.Parameter(t, requires_grad=True)


def _copy_input_hook(group: dist.ProcessGroup):  # noqa: ANN202
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if args:
            return (copy_to_tp(args[0], group), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": copy_to_tp(kwargs["hidden_states"], group)}

    return hook


class ShardedCausalLM(nn.Module):
    """One rank of a sharded replica of a Llama / Qwen2 / Qwen3 / Mistral causal LM.

    Args:
        config: the FULL model's transformers config (``attn_implementation`` is kept; default sdpa).
        comm: this rank's :class:`~nereus_lightning.models.groups.ReplicaComm` (layout, position, groups).
        shards: this rank's tensors keyed by global parameter name, cut by ``sharding.tp_slices`` and
            restricted to this stage by ``sharding.pp_stages`` (exactly what :func:`shard_state` returns).
            They become the module's parameters without copies.
    """

    def __init__(self, config: Any, comm: ReplicaComm, shards: Mapping[str, Tensor]) -> None:
        super().__init__()
        layout = comm.layout
        validate_layout(config, layout)
        self.config, self.comm = config, comm
        self.local_config = lcfg = local_config(config, layout.tp)
        self.layer_ids = layer_range(config.num_hidden_layers, layout.pp, comm.pp_rank)
        layer_cls, norm_cls, rotary_cls = _modules_of(config)
        vocab_rows = config.vocab_size // layout.tp
        tied = is_tied(config)
        self.value_head = has_value_head(config)
        with torch.device("meta"):
            skeleton = self._skeleton(layer_cls, norm_cls, lcfg, vocab_rows, tied)
        expected = {n: tuple(p.shape) for n, p in skeleton.named_parameters()}
        given = {n: tuple(t.shape) for n, t in shards.items()}
        require(
            expected.keys() == given.keys(),
            "shards",
            f"stage {comm.pp_rank} of {layout} needs {sorted(expected.keys() - given.keys())} "
            f"and does not hold {sorted(given.keys() - expected.keys())}",
        )
        wrong = {n: (given[n], s) for n, s in expected.items() if given[n] != s}
        require(not wrong, "shards", f"shard shapes (given, expected) differ: {wrong}")
        devices = {t.device for t in shards.values()}
        require(
            len(devices) == 1, "shards", f"all shards must be on one device, got {sorted(map(str, devices))}"
        )
        params = {n: _as_param(t) for n, t in shards.items()}
        device = devices.pop()
        self.model = nn.Module()
        if "model.embed_tokens.weight" in params:
            self.model.embed_tokens = VocabParallelEmbedding(
                params["model.embed_tokens.weight"], comm.tp_rank * vocab_rows, config.pad_token_id, comm
            )
        self.model.layers = skeleton.model.layers
        for module in skeleton.model.layers.values():
            for part, proj in (("self_attn", "o_proj"), ("mlp", "down_proj")):
                parent = getattr(module, part)
                row = RowParallelLinear(getattr(parent, proj).weight, getattr(parent, proj).bias, comm)
                setattr(parent, proj, row)
                if layout.tp > 1:
                    parent.register_forward_pre_hook(_copy_input_hook(comm.tp_group), with_kwargs=True)
        if comm.is_last_stage:
            self.model.norm = skeleton.model.norm
            if self.value_head:
                self.score = ValueHead(params["score.weight"], params.get("score.bias"))
            elif not tied:
                self.lm_head = LMHead(params["lm_head.weight"])
        for name, param in params.items():
            owner, _, leaf = name.rpartition(".")
            setattr(self.get_submodule(owner), leaf, param)
        with torch.device(device):
            self.rotary_emb = rotary_cls(config=lcfg)
        self.tp_partial = tuple(n for n in params if _tp_partial(n, config))
        left = [n for n, t in (*self.named_parameters(), *self.named_buffers()) if t.is_meta]
        assert not left, f"tensors left unassigned on the meta device: {left}"
        self.eval()  # no dropout: sharded and unsharded runs must agree

    def _skeleton(self, layer_cls: type, norm_cls: type, lcfg: Any, vocab_rows: int, tied: bool) -> nn.Module:
        root = nn.Module()
        root.model = nn.Module()
        if self.comm.is_first_stage or (tied and self.comm.is_last_stage):
            root.model.embed_tokens = LMHead(nn.Parameter(torch.empty(vocab_rows, lcfg.hidden_size)))
        root.model.layers = nn.ModuleDict({str(i): layer_cls(lcfg, i) for i in self.layer_ids})
        if self.comm.is_last_stage:
            root.model.norm = norm_cls(lcfg.hidden_size, eps=lcfg.rms_norm_eps)
            if self.value_head:
                labels = int(getattr(lcfg, "num_labels", 1))
                bias = getattr(lcfg, "token_classification_bias", True)
                root.score = ValueHead(
                    nn.Parameter(torch.empty(labels, lcfg.hidden_size)),
                    nn.Parameter(torch.empty(labels)) if bias else None,
                )
            elif not tied:
                root.lm_head = LMHead(nn.Parameter(torch.empty(vocab_rows, lcfg.hidden_size)))
        return root

    @classmethod
    def from_model(cls, model: nn.Module, comm: ReplicaComm) -> ShardedCausalLM:
        """Slice a full transformers causal LM (copies this rank's shards)."""
        config = model.config  # type: ignore[attr-defined]
        return cls(config, comm, shard_state(model, config, comm.layout, comm.pp_rank, comm.tp_rank))

    @property
    def vocab_start(self) -> int:
        """First global token id of this rank's vocabulary slice."""
        return self.comm.tp_rank * (self.config.vocab_size // self.comm.layout.tp)

    def head_weight(self) -> Tensor:
        """The LM head's vocabulary shard (the embedding's when tied)."""
        return self.model.embed_tokens.weight if is_tied(self.config) else self.lm_head.weight

    def _masks(
        self, hidden: Tensor, attention_mask: Tensor | None, position_ids: Tensor, cache: Any = None
    ) -> dict[str, Any]:
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        cfg = self.local_config
        kwargs = dict(
            config=cfg, inputs_embeds=hidden, attention_mask=attention_mask, position_ids=position_ids
        )
        kwargs[_cache_kwarg()] = cache
        types = set(getattr(cfg, "layer_types", None) or ())
        sliding = "sliding_attention" in types or (
            not types and getattr(cfg, "sliding_window", None) is not None
        )
        kinds = {"full_attention": create_causal_mask}
        if sliding:
            kinds["sliding_attention"] = create_sliding_window_causal_mask
        masks: dict[str, Any] = {}
        for kind, make in kinds.items():
            # With a cache, size the mask by one of THIS stage's layers: the cache holds only those.
            extra = {} if cache is None else {"layer_idx": self._first_layer_of(kind)}
            masks[kind] = make(**kwargs, **extra)
        return masks

    def _first_layer_of(self, kind: str) -> int:
        types = getattr(self.local_config, "layer_types", None)
        return next((i for i in self.layer_ids if not types or types[i] == kind), self.layer_ids[0])

    def _layer_mask(self, masks: dict[str, Any], index: int) -> Any:
        types = getattr(self.local_config, "layer_types", None)
        if types:
            return masks[types[index]]
        return masks.get("sliding_attention", masks["full_attention"])

    def stage(
        self,
        input_ids: Tensor,
        hidden_states: Tensor | None = None,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        cache: Any = None,
    ) -> Tensor:
        """This stage's output hidden states ``[B, S, H]`` (after the final norm on the last stage).

        ``input_ids`` ``[B, S]`` are needed on every stage (shapes, masks); ``hidden_states`` is the
        previous stage's output (required unless this is the first stage). ``cache``: a
        transformers KV cache (e.g. ``DynamicCache``) indexed by global layer number; this stage
        reads and extends the entries of its own layers only, and ``input_ids`` are then the new
        tokens while ``attention_mask`` covers past and new ones (as transformers ``generate`` passes them).
        """
        if self.comm.is_first_stage:
            hidden = self.model.embed_tokens(input_ids)
        else:
            require(
                hidden_states is not None, "hidden_states", "stages after the first need the previous output"
            )
            hidden = hidden_states
        if position_ids is None:
            past = 0 if cache is None else cache.get_seq_length(self.layer_ids[0])
            position_ids = torch.arange(past, past + input_ids.shape[1], device=hidden.device).unsqueeze(0)
        masks = self._masks(hidden, attention_mask, position_ids, cache)
        position_embeddings = self.rotary_emb(hidden, position_ids)
        with_cache = {}
        if cache is not None:
            name = _layer_cache_kwarg(type(self.model.layers[str(self.layer_ids[0])]))
            require(
                supports_kv_cache() and name is not None,
                "cache",
                "this transformers version cannot size masks by a stage's own cache layers; decode without a cache",
            )
            with_cache = {name: cache, "use_cache": True}
        for i in self.layer_ids:
            hidden = self.model.layers[str(i)](
                hidden,
                attention_mask=self._layer_mask(masks, i),
                position_ids=position_ids,
                position_embeddings=position_embeddings,
                **with_cache,
            )
        if self.comm.is_last_stage:
            hidden = self.model.norm(hidden)
        return hidden

    @property
    def out_features(self) -> int:
        """Width of the head's output: the vocabulary, or a value model's ``num_labels``."""
        return int(getattr(self.config, "num_labels", 1)) if self.value_head else int(self.config.vocab_size)

    def local_logits(self, hidden: Tensor) -> Tensor:
        """This rank's vocabulary slice of the logits ``[B, S, V/tp]`` (last stage only).

        A value model returns its values ``[B, S, num_labels]`` whole on every TP rank (the head is
        replicated and sees the full hidden state, so every TP rank computes the same values).
        """
        if self.value_head:
            return F.linear(hidden, self.score.weight, self.score.bias)
        group = self.comm.tp_group if self.comm.layout.tp > 1 else None
        return F.linear(copy_to_tp(hidden, group), self.head_weight())

    def full_logits(self, local: Tensor) -> Tensor:
        """All-gather local logits over TP into ``[B, S, V]`` (differentiable); a value model's values as they are."""
        if self.value_head:
            return local
        group = self.comm.tp_group if self.comm.layout.tp > 1 else None
        return gather_from_tp(local, group, self.comm.tp_ranks, self.comm.tp_rank)

    def forward(
        self,
        input_ids: Tensor,
        hidden_states: Tensor | None = None,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        cache: Any = None,
    ) -> Tensor:
        """Hidden states to send on (non-last stages) or local vocabulary-slice logits (last stage)."""
        hidden = self.stage(input_ids, hidden_states, attention_mask, position_ids, cache)
        return self.local_logits(hidden) if self.comm.is_last_stage else hidden

    def sync_grads(self) -> None:
        """Complete this replica's gradients after backward (before any DP averaging).

        Sums over TP the gradients of replicated tensors that only saw this rank's heads
        (Qwen3 ``q_norm`` / ``k_norm``), and sums a tied embedding's gradient over the first
        and last stage copies.
        """
        named = dict(self.named_parameters())
        if self.comm.layout.tp > 1:
            grads = [named[n].grad for n in self.tp_partial if named[n].grad is not None]
            _all_reduce_flat(grads, self.comm.tp_group)
        if self.comm.tied_group is not None:
            weight = self.model.embed_tokens.weight
            if weight.grad is None:
                weight.grad = torch.zeros_like(weight)
            _all_reduce_flat([weight.grad], self.comm.tied_group)


@functools.cache
def _cache_kwarg() -> str:
    """transformers renamed the masks' ``past_key_values`` argument to ``cache`` (5.2x)."""
    import inspect

    from transformers.masking_utils import create_causal_mask

    return "cache" if "cache" in inspect.signature(create_causal_mask).parameters else "past_key_values"


@functools.cache
def _layer_cache_kwarg(layer_cls: type) -> str | None:
    """The KV-cache argument of a decoder layer's forward (None: the layer takes none by name)."""
    import inspect

    params = inspect.signature(layer_cls.forward).parameters
    return next((n for n in ("cache", "past_key_values", "past_key_value") if n in params), None)


@functools.cache
def supports_kv_cache() -> bool:
    """Whether a stage can keep a KV cache of its own layers: the installed transformers sizes a mask
    by a given cache layer (``create_causal_mask(..., layer_idx=)``, 5.2x). Without it, decoding
    re-runs the whole sequence (:class:`~nereus_lightning.models.generation.ShardedGenerator`)."""
    import inspect

    from transformers.masking_utils import create_causal_mask

    params = inspect.signature(create_causal_mask).parameters
    return "layer_idx" in params and "cache_position" not in params


def _tp_partial(name: str, config: Any) -> bool:
    """Replicated over TP but fed only by this rank's heads/columns (inside attention or MLP)."""
    p = placement(name, tp_plan_of(config))
    if p.tp_dim is not None or p.kind != "block":
        return False
    inside = ".self_attn." in name or ".mlp." in name
    return inside and not any(f".{row}." in name for row in ("o_proj", "down_proj"))


def _all_reduce_flat(tensors: list[Tensor], group: dist.ProcessGroup, average: bool = False) -> None:
    """All-reduce ``tensors`` in place through one flat buffer per dtype."""
    by_dtype: dict[torch.dtype, list[Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for ts in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in ts])
        dist.all_reduce(flat, group=group)
        if average:
            flat /= dist.get_world_size(group)
        offset = 0
        for t in ts:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()
