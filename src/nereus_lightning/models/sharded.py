"""`ShardedCausalLM`: one rank's piece (one TP shard of one PP stage) of a transformers causal LM.

Every module is the family's own, built by transformers from a config whose heads, KV heads,
intermediate size and vocabulary are divided by ``tp``: the decoder layers (so RoPE variants,
biases, q/k norms, sandwich norms and attention soft-capping behave exactly as in transformers),
the embedding with its scale, the final norm, and the head: the local logits come from the
family's own ``*ForCausalLM`` / ``*ForTokenClassification`` forward run on this stage's hidden
states, so logit scaling and soft-capping are inherited, not re-implemented. Only the registered
families (``spec.families``) are built; the registry test checks each against transformers.

Around the family's modules sit the Megatron-style TP collectives of :mod:`.tp_ops`, by the plan's
style (:func:`~nereus_lightning.models.sharding.tp_plan_of`): the embedding becomes
vocabulary-parallel, the inputs of attention and MLP an identity/all-reduce, row-parallel
projections all-reduce their output (and add their replicated bias once), fused projections put
their group-ordered output back into part order, and the head computes this rank's vocabulary
slice. The modules keep their class's forward; TP is added by switching each module to a subclass
of its own class (as FSDP2 does), so parameter names stay the model's global names
(``model.layers.5.mlp.up_proj.weight``).

Parameters are the very tensors passed in (an EMU's shards): an ``nn.Parameter`` is used as is;
a plain tensor is wrapped in an ``nn.Parameter`` that shares its storage, so in-place optimizer
updates are seen by the owner either way.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Collection, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import Tensor, nn

from nereus_lightning.models.groups import ReplicaComm
from nereus_lightning.models.packing import Documents, packed_attention_for, packing_refusal, varlen_of
from nereus_lightning.models.sharding import (
    Fused,
    Style,
    cut_parts,
    layer_range,
    placement,
    pp_stages,
    style_of,
    tp_plan_of,
    tp_slices,
)
from nereus_lightning.models.tp_ops import copy_to_tp, gather_from_tp, reduce_from_tp
from nereus_lightning.plan.layout import Layout
from nereus_lightning.spec.errors import NereusConfigError, require
from nereus_lightning.spec.families import family_of, refusal
from nereus_lightning.spec.model import ModelSpec, names_value_model


def validate_layout(config: Any, layout: Layout) -> None:
    """Reject an unsupported family, or a layout that splits a head, a KV head, the MLP or the vocabulary.

    A layout with more pipeline stages than layers is refused as well.
    """
    spec = ModelSpec.from_hf_config(config)  # asks the family registry
    family = family_of(config)
    if family.layouts:  # admitted by proof: only the TP and PP degrees its self-check verified
        tps = {int(n[2 : n.index("pp")]) for n in family.layouts if n.startswith("tp")}
        pps = {int(n[n.index("pp") + 2 :]) for n in family.layouts if n.startswith("tp")}
        require(
            layout.tp in tps and layout.pp in pps,
            "layout",
            f"{layout} is beyond what the self-check verified for {family.model_type} "
            f"({', '.join(sorted(family.layouts))}); plan within them",
        )
    spec.validate_tp(layout.tp)
    spec.validate_pp(layout.pp)
    for field, size in (("intermediate_size", spec.intermediate), ("vocab_size", spec.vocab)):
        require(
            size % layout.tp == 0,
            "layout.tp",
            f"tp={layout.tp} does not divide {field}={size} of {spec.name}",
        )


def has_value_head(config: Any) -> bool:
    """Whether ``config`` describes a value model: token classification (``score`` replaces ``lm_head``).

    The critic and the reward model are such models with ``num_labels == 1``, as in verl; their
    config names a ``*ForTokenClassification`` architecture.
    """
    return names_value_model(getattr(config, "architectures", None))


def is_tied(config: Any) -> bool:
    """Whether the LM head is the input embedding (never for a value model: it has no LM head)."""
    return bool(getattr(config, "tie_word_embeddings", False)) and not has_value_head(config)


def local_config(config: Any, tp: int, plan: Mapping[str, Style] | None = None) -> Any:
    """A copy of ``config`` describing one TP shard: heads, KV heads, intermediate and vocabulary over ``tp``.

    Heads are divided only where ``plan`` (default: the config's own) cuts attention, and the
    intermediate size only where it cuts the MLP: a part the plan leaves uncut (a mixture's experts,
    OLMo2's attention whose norms span all heads) is built whole on every TP rank. Its
    ``pad_token_id`` is None (the padding row lives on one vocabulary shard only; the embedding is
    told its local padding row).
    """
    attention, mlp = cut_parts(tp_plan_of(config) if plan is None else plan)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    heads_tp, mlp_tp = (tp if attention else 1), (tp if mlp else 1)
    local = copy.deepcopy(config)
    local.num_attention_heads = config.num_attention_heads // heads_tp
    local.num_key_value_heads = (
        getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    ) // heads_tp
    local.intermediate_size = config.intermediate_size // mlp_tp
    local.vocab_size = config.vocab_size // tp
    local.head_dim = head_dim
    local.pad_token_id = None
    local._attn_implementation = config._attn_implementation or "sdpa"
    return local


def shard_state(
    model_or_state: nn.Module | Mapping[str, Tensor], config: Any, layout: Layout, pp_rank: int, tp_rank: int
) -> dict[str, Tensor]:
    """Rank (pp_rank, tp_rank)'s shards of a full model, keyed by global name (contiguous copies)."""
    validate_layout(config, layout)
    state: dict[str, Tensor]
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


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Build modules with their parameters on the meta device and their buffers where they are made.

    The parameters are replaced by a rank's shards; the buffers (rotary frequencies, embedding
    scales) are computed by the family's own constructors.
    """
    register = nn.Module.register_parameter

    def on_meta(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(self, name, param)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def family_model(local: Any, value_head: bool) -> Any:
    """The family's own causal LM (or token-classification value model) for config ``local``.

    Its parameters are on the meta device, its buffers on the CPU.
    """
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    auto = AutoModelForTokenClassification if value_head else AutoModelForCausalLM
    try:
        with torch.device("cpu"), _parameters_on_meta():
            return auto.from_config(local)
    except ValueError as exc:  # transformers: no such class for this config
        kind = "token-classification (value model)" if value_head else "causal-LM"
        raise refusal(local.model_type, f"transformers has no {kind} class for it ({exc})") from exc


@functools.cache
def _vocab_parallel(embedding_cls: type) -> type:
    """``embedding_cls`` holding rows ``[vocab_start, vocab_start + num_embeddings)``; summed over TP."""

    class VocabParallel(embedding_cls):
        vocab_start: int
        comm: ReplicaComm

        def forward(self, input_ids: Tensor) -> Tensor:
            """The family's embedding (scale included) of global token ids, full rows on every TP rank."""
            if self.comm.layout.tp == 1:
                return super().forward(input_ids)
            local = input_ids - self.vocab_start
            outside = (local < 0) | (local >= self.num_embeddings)
            out = super().forward(local.masked_fill(outside, 0))
            out = out * (~outside).unsqueeze(-1).to(out.dtype)
            return reduce_from_tp(out, self.comm.tp_group)

    VocabParallel.__name__ = VocabParallel.__qualname__ = f"VocabParallel{embedding_cls.__name__}"
    return VocabParallel


class RowParallelLinear(nn.Linear):
    """A linear layer cut along its input: partial products summed over TP, then the bias once."""

    comm: ReplicaComm

    def forward(self, x: Tensor) -> Tensor:
        """``all_reduce(x @ W_local^T) + b``."""
        out = reduce_from_tp(F.linear(x, self.weight), self.comm.tp_collectives)
        return out if self.bias is None else out + self.bias


class GroupedColwiseLinear(nn.Linear):
    """A fused projection holding whole groups (:class:`~.sharding.Fused`), rows in group order.

    Its output is put back into part order (``[q | k | v]`` or ``[gate | up]`` of this rank's
    groups), which is what the family's module slices.
    """

    group_widths: tuple[int, ...]

    def forward(self, x: Tensor) -> Tensor:
        """The family's fused output for this rank's groups."""
        out = F.linear(x, self.weight, self.bias)
        grouped = out.unflatten(-1, (-1, sum(self.group_widths)))
        return torch.cat([part.flatten(-2) for part in grouped.split(self.group_widths, dim=-1)], dim=-1)


def _switch(module: nn.Module, cls: type, name: str, config: Any, **attrs: Any) -> None:
    """Give ``module`` the TP behaviour of ``cls`` (a subclass of its own class), keeping its parameters."""
    base = cls.__mro__[1]
    if type(module) is not base:
        what = f"{name} is a {type(module).__name__}, not the {base.__name__} its TP style needs"
        raise refusal(config.model_type, what)
    module.__class__ = cls
    for key, value in attrs.items():
        setattr(module, key, value)


class _Given(nn.Module):
    """Stands in for the decoder inside the family's head forward: returns the hidden states it is given."""

    def forward(self, *args: Any, inputs_embeds: Tensor, **kwargs: Any) -> Any:
        """The given ``inputs_embeds`` as the decoder's last hidden state (no router logits: no aux loss)."""
        from transformers.modeling_outputs import MoeModelOutputWithPast

        return MoeModelOutputWithPast(last_hidden_state=inputs_embeds)


def _as_param(t: Tensor) -> nn.Parameter:
    return t if isinstance(t, nn.Parameter) else nn.Parameter(t, requires_grad=True)


def _copy_input_hook(group: dist.ProcessGroup | None):  # noqa: ANN202
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if args:
            return (copy_to_tp(args[0], group), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": copy_to_tp(kwargs["hidden_states"], group)}

    return hook


class ShardedCausalLM(nn.Module):
    """One rank of a sharded replica of a causal LM (or value model) of a registered family.

    Args:
        config: the FULL model's transformers config (``attn_implementation`` is kept; default sdpa).
        comm: this rank's :class:`~nereus_lightning.models.groups.ReplicaComm` (layout, position, groups).
        shards: this rank's tensors keyed by global parameter name, cut by ``sharding.tp_slices`` and
            restricted to this stage by ``sharding.pp_stages`` (exactly what :func:`shard_state` returns).
            They become the module's parameters without copies.
    """

    # The family's own modules, reached by their family-specific names (embed_tokens, layers, norm, ...).
    model: Any
    family_head: Any
    local_config: Any

    def __init__(self, config: Any, comm: ReplicaComm, shards: Mapping[str, Tensor]) -> None:
        super().__init__()
        layout = comm.layout
        validate_layout(config, layout)
        self.config, self.comm = config, comm
        self.layer_ids = layer_range(config.num_hidden_layers, layout.pp, comm.pp_rank)
        self.value_head = has_value_head(config)
        self.recompute = False  # activation recompute in training forwards (see :meth:`stage`)
        self.layers = "compiled"  # how packed forwards run their layers (:data:`LAYER_MODES`, :meth:`stage`)
        plan = tp_plan_of(config)
        tied = is_tied(config)
        family = family_model(local_config(config, layout.tp, plan), self.value_head)
        self.local_config = family.config
        stage = {
            n: tuple(p.shape)
            for n, p in family.named_parameters()
            if comm.pp_rank in pp_stages(placement(n, plan), config.num_hidden_layers, layout.pp, tied)
        }
        given = {n: tuple(t.shape) for n, t in shards.items()}
        require(
            stage.keys() == given.keys(),
            "shards",
            f"stage {comm.pp_rank} of {layout} needs {sorted(stage.keys() - given.keys())} "
            f"and does not hold {sorted(given.keys() - stage.keys())}",
        )
        wrong = {n: (given[n], s) for n, s in stage.items() if given[n] != s}
        require(not wrong, "shards", f"shard shapes (given, expected) differ: {wrong}")
        devices = {t.device for t in shards.values()}
        require(
            len(devices) == 1, "shards", f"all shards must be on one device, got {sorted(map(str, devices))}"
        )
        device = devices.pop()
        self._keep_stage(family, stage.keys())
        # The layers' KV-cache argument, read here rather than in stage() (which torch.compile traces).
        # The ignore: mypy checks a class passed to a functools.cache function against Hashable
        # through its instances' unbound __hash__ (a false positive; classes hash).
        first = type(self.model.layers[str(self.layer_ids[0])])
        self._cache_argument = _layer_cache_kwarg(first) if supports_kv_cache() else None  # type: ignore[arg-type]
        for name, tensor in shards.items():
            owner, _, leaf = name.rpartition(".")
            setattr(self.get_submodule(owner), leaf, _as_param(tensor))
        for module in self.modules():
            for key, buffer in module._buffers.items():
                if buffer is not None:
                    module._buffers[key] = buffer.to(device)
        regions = self._add_tp(config, plan)
        if comm.is_last_stage:
            if tied:
                family.lm_head.weight = self.model.embed_tokens.weight
            family.model = _Given()
            # Not a submodule: its head's parameters are this module's own (named once).
            self.__dict__["family_head"] = family.eval()
        self.tp_partial = tuple(n for n, _ in self.named_parameters() if _tp_partial(n, plan, regions))
        left = [n for n, t in (*self.named_parameters(), *self.named_buffers()) if t.is_meta]
        assert not left, f"tensors left unassigned on the meta device: {left}"
        self.eval()  # no dropout: sharded and unsharded runs must agree

    def _keep_stage(self, family: Any, names: Collection[str]) -> None:
        """Take this stage's modules from ``family``: its layers, and the embedding, norm, head it holds."""
        body = family.model
        body.layers = nn.ModuleDict({str(i): body.layers[i] for i in self.layer_ids})
        for child, module in list(body.named_children()):
            params = [f"model.{child}.{n}" for n, _ in module.named_parameters()]
            if child != "layers" and params and not any(n in names for n in params):
                delattr(body, child)
        self.model = body
        if self.comm.is_last_stage:
            if self.value_head:
                self.score = family.score
            elif not is_tied(self.config):
                self.lm_head = family.lm_head

    def _add_tp(self, config: Any, plan: Mapping[str, Style]) -> tuple[str, ...]:
        """Switch the family's modules to their TP behaviour by the plan's style; returns the TP regions.

        A TP region is the parent of column-parallel projections (attention, MLP): its input is the
        identity/all-reduce of :func:`~.tp_ops.copy_to_tp`.
        """
        comm, tp = self.comm, self.comm.layout.tp
        if hasattr(self.model, "embed_tokens"):
            embed = self.model.embed_tokens
            pad = config.pad_token_id
            local_pad = None if pad is None else pad - self.vocab_start
            _switch(
                embed,
                _vocab_parallel(type(embed)),  # type: ignore[arg-type]  # as in forward: classes hash
                "model.embed_tokens",
                config,
                vocab_start=self.vocab_start,
                comm=comm,
            )
            embed.padding_idx = (
                local_pad if local_pad is not None and 0 <= local_pad < embed.num_embeddings else None
            )
        regions: dict[str, nn.Module] = {}
        for name, module in self.named_modules():
            style = style_of(name, plan) if name.startswith("model.layers.") else None
            if isinstance(style, Fused):
                _switch(module, GroupedColwiseLinear, name, config, group_widths=style.group_widths)
            elif isinstance(style, str) and style.startswith("rowwise"):
                _switch(module, RowParallelLinear, name, config, comm=comm)
            if isinstance(style, Fused) or (isinstance(style, str) and style.startswith("colwise")):
                parent = name.rpartition(".")[0]
                regions[parent] = self.get_submodule(parent)
        if tp > 1:
            for parent in regions.values():
                parent.register_forward_pre_hook(_copy_input_hook(comm.tp_group), with_kwargs=True)
        return tuple(regions)

    @classmethod
    def from_model(cls, model: nn.Module, comm: ReplicaComm) -> ShardedCausalLM:
        """Slice a full transformers causal LM (copies this rank's shards)."""
        config = model.config
        return cls(config, comm, shard_state(model, config, comm.layout, comm.pp_rank, comm.tp_rank))

    @property
    def vocab_start(self) -> int:
        """First global token id of this rank's vocabulary slice."""
        return self.comm.tp_rank * (self.config.vocab_size // self.comm.layout.tp)

    def _masks(
        self,
        hidden: Tensor,
        attention_mask: Tensor | dict[str, Tensor] | None,
        position_ids: Tensor,
        cache: Any = None,
    ) -> dict[str, Any]:
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        if isinstance(attention_mask, dict):  # prepared by the caller, one per attention kind
            return attention_mask
        cfg = self.local_config
        kwargs = dict(
            config=cfg, inputs_embeds=hidden, attention_mask=attention_mask, position_ids=position_ids
        )
        kwargs[_cache_kwarg()] = cache
        kinds = {"full_attention": create_causal_mask}
        if "sliding_attention" in attention_kinds(cfg):
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
        attention_mask: Tensor | dict[str, Tensor] | None = None,
        position_ids: Tensor | None = None,
        cache: Any = None,
        documents: Documents | None = None,
    ) -> Tensor:
        """This stage's output hidden states ``[B, S, H]`` (after the final norm on the last stage).

        ``input_ids`` ``[B, S]`` are needed on every stage (shapes, masks); ``hidden_states`` is the
        previous stage's output (required unless this is the first stage). ``cache``: a
        transformers KV cache (e.g. ``DynamicCache``) indexed by global layer number; this stage
        reads and extends the entries of its own layers only, and ``input_ids`` are then the new
        tokens while ``attention_mask`` covers past and new ones (as transformers ``generate`` passes them).
        ``attention_mask`` may also be the layers' 4D masks keyed by :func:`attention_kinds` (as
        transformers' own models accept them), for a cache the mask helpers do not know.
        ``documents``: ``input_ids`` is one packed row of these sequences (:func:`~.packing.pack`,
        with its ``position_ids``); attention stays within each sequence.
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
        if documents is None:
            masks = self._masks(hidden, attention_mask, position_ids, cache)
        else:
            require(
                cache is None and attention_mask is None, "documents", "a packed row takes no mask or cache"
            )
            if (why := packing_refusal(self.local_config)) is not None:
                raise NereusConfigError(f"documents: {self.config.model_type} cannot run packed: {why}")
            masks = dict.fromkeys(attention_kinds(self.local_config))
        position_embeddings = self._position_embeddings(hidden, position_ids)
        with_cache: dict[str, Any] = {}
        if cache is not None:
            name = self._cache_argument
            if name is None:
                raise NereusConfigError(
                    "cache: this transformers version cannot size masks by a stage's own cache layers; "
                    "decode without a cache"
                )
            with_cache = {name: cache, "use_cache": True}
        # Activation recompute (the plan's ``Candidate.recompute``): each layer keeps only its input
        # and runs again in the backward pass; TP collectives inside rerun in the same order on every rank.
        recompute = self.recompute and cache is None and torch.is_grad_enabled()
        args = (hidden, masks, position_ids, position_embeddings, recompute)
        if documents is None:
            hidden = self._layers(*args, with_cache, scoped=False)
        elif (varlen := varlen_of(documents, hidden.device, hidden.dtype)) is not None and self._compiles(
            recompute
        ):
            with packed_attention_for(self.local_config):
                hidden = self._compiled_layers(*args, {"nereus_varlen": varlen})
        else:
            packed = {"nereus_documents": documents, "nereus_varlen": varlen}
            hidden = self._layers(*args, packed, scoped=True)
        if self.comm.is_last_stage:
            hidden = self.model.norm(hidden)
        return hidden

    def _compiles(self, recompute: bool) -> bool:
        """Whether a packed forward on the varlen kernel runs its layers through :func:`compiled_layer`.

        Not under activation recompute: a checkpoint traced by torch.compile refuses layers with side
        effects (transformers' hub kernels set a context variable), and falling back inside it would
        recompute other tensors than the forward saved.
        """
        return self.layers == "compiled" and not recompute

    def _compiled_layers(self, *args: Any) -> Tensor:
        """:meth:`_layers` through :func:`compiled_layer`; a compiler failure names the way out."""
        from torch._dynamo.exc import BackendCompilerFailed

        try:
            return self._layers(*args, scoped=False, compiled=True)
        except BackendCompilerFailed as exc:  # e.g. no C compiler or Triton for inductor
            raise NereusConfigError(
                "algorithm.layers: torch.compile could not compile the decoder layers "
                f"({exc.inner_exception!r}); set algorithm.layers=eager to run them as written"
            ) from exc

    def _layers(
        self,
        hidden: Tensor,
        masks: dict[str, Any],
        position_ids: Tensor,
        position_embeddings: Any,
        recompute: bool,
        extra: dict[str, Any],
        *,
        scoped: bool,
        compiled: bool = False,
    ) -> Tensor:
        """This stage's decoder layers on ``hidden``; ``extra`` goes to every layer (a cache, or the
        packed row's attention arguments), each on :func:`packed_attention_for` where ``scoped`` and
        through :func:`compiled_layer` where ``compiled``."""
        run = compiled_layer() if compiled else ShardedCausalLM._layer
        for i in self.layer_ids:
            layer = self.model.layers[str(i)]
            kwargs = dict(
                attention_mask=self._layer_mask(masks, i),
                position_ids=position_ids,
                position_embeddings=(
                    position_embeddings[self.local_config.layer_types[i]]
                    if isinstance(position_embeddings, dict)
                    else position_embeddings
                ),
                **extra,
            )
            if recompute:
                hidden = torch.utils.checkpoint.checkpoint(
                    self._layer, layer, hidden, scoped, use_reentrant=False, **kwargs
                )
            else:
                hidden = run(self, layer, hidden, scoped, **kwargs)
        return hidden

    def _position_embeddings(self, hidden: Tensor, position_ids: Tensor) -> Any:
        """The family's rotary embedding; per attention kind where its RoPE differs by layer type (Gemma3)."""
        rotary = self.model.rotary_emb
        if not _rotary_per_layer_type(type(rotary)):  # type: ignore[arg-type]  # classes hash (see __init__)
            return rotary(hidden, position_ids)
        kinds = {self.local_config.layer_types[i] for i in self.layer_ids}
        return {kind: rotary(hidden, position_ids, kind) for kind in sorted(kinds)}

    def _layer(self, layer: nn.Module, hidden: Tensor, scoped: bool, **kwargs: Any) -> Tensor:
        """One decoder layer, on the packed attention where ``scoped`` (also when recomputed)."""
        if not scoped:
            return layer(hidden, **kwargs)
        with packed_attention_for(self.local_config):
            return layer(hidden, **kwargs)

    @property
    def out_features(self) -> int:
        """Width of the head's output: the vocabulary, or a value model's ``num_labels``."""
        return int(getattr(self.config, "num_labels", 1)) if self.value_head else int(self.config.vocab_size)

    def local_logits(self, hidden: Tensor) -> Tensor:
        """This rank's vocabulary slice of the logits ``[B, S, V/tp]`` (last stage only).

        A value model returns its values ``[B, S, num_labels]`` whole on every TP rank (the head is
        replicated and sees the full hidden state, so every TP rank computes the same values).
        """
        if not self.value_head:
            hidden = copy_to_tp(hidden, self.comm.tp_collectives)
        # A mixture of experts' head would add its router loss; the RL losses are the caller's.
        no_aux = {"output_router_logits": False} if hasattr(self.config, "output_router_logits") else {}
        return self.family_head(inputs_embeds=hidden, **no_aux).logits

    def full_logits(self, local: Tensor) -> Tensor:
        """All-gather local logits over TP into ``[B, S, V]`` (differentiable); a value model's as is."""
        if self.value_head:
            return local
        group = self.comm.tp_collectives
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
            assert self.comm.tp_group is not None  # only a single-rank replica has none
            grads = [g for n in self.tp_partial if (g := named[n].grad) is not None]
            all_reduce_flat(grads, self.comm.tp_group)
        if self.comm.tied_group is not None:
            weight = self.model.embed_tokens.weight
            if weight.grad is None:
                weight.grad = torch.zeros_like(weight)
            all_reduce_flat([weight.grad], self.comm.tied_group)


#: How a packed forward runs its decoder layers (``algorithm.layers``): ``"compiled"`` (the default)
#: each layer through :func:`compiled_layer` where the varlen attention kernel runs (a CUDA GPU) and no
#: activation recompute is planned, as written elsewhere; ``"eager"`` always as written.
LAYER_MODES = ("eager", "compiled")


@functools.cache
def compiled_layer() -> Any:
    """:meth:`ShardedCausalLM._layer` through ``torch.compile``, the token count dynamic from the start.

    One wrapper for every layer: the layers of a family share its code and take their parameters as
    graph inputs, so one compile serves them all (a stage compiles in seconds, not once per layer or
    as one graph of the whole stack). Inductor fuses each layer's norms, rotary embedding, activation
    and residual adds: an eager layer launches about sixty kernels per pass, which bounds a small
    model's training by the host. TP collectives break the graph and run eagerly.
    """
    return torch.compile(ShardedCausalLM._layer, dynamic=True)


def attention_kinds(config: Any) -> tuple[str, ...]:
    """The attention kinds of a family's layers: full, and sliding where some layers slide."""
    types = set(getattr(config, "layer_types", None) or ())
    sliding = "sliding_attention" in types or (
        not types and getattr(config, "sliding_window", None) is not None
    )
    return ("full_attention", "sliding_attention") if sliding else ("full_attention",)


@functools.cache
def _rotary_per_layer_type(rotary_cls: type[nn.Module]) -> bool:
    """Whether a family's rotary embedding is computed per layer type (its forward takes ``layer_type``)."""
    import inspect

    return "layer_type" in inspect.signature(rotary_cls.forward).parameters


@functools.cache
def _cache_kwarg() -> str:
    """transformers renamed the masks' ``past_key_values`` argument to ``cache`` (5.2x)."""
    import inspect

    from transformers.masking_utils import create_causal_mask

    return "cache" if "cache" in inspect.signature(create_causal_mask).parameters else "past_key_values"


@functools.cache
def _layer_cache_kwarg(layer_cls: type[nn.Module]) -> str | None:
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


def _tp_partial(name: str, plan: Mapping[str, Style], regions: tuple[str, ...]) -> bool:
    """Replicated over TP but fed by this rank's heads/columns only (in a TP region, as Qwen3's q/k norms).

    A row-parallel bias is not: it is added once, after the sum over TP.
    """
    if placement(name, plan).tp_dim is not None:
        return False
    module = name.rpartition(".")[0]
    style = style_of(module, plan)
    if isinstance(style, str) and style.startswith("rowwise"):
        return False
    return any(name.startswith(f"{region}.") for region in regions)


#: Bytes of one flat buffer of the flat collectives (:func:`all_reduce_flat`, ``models.zero``): they move
#: their tensors in consecutive buckets of at most this size, so their transient memory is bounded
#: whatever the model's size (``plan.memory.FLAT_BUCKET_BYTES`` mirrors it; a test pins them equal).
FLAT_BUCKET_BYTES = 256 * 2**20


def flat_buckets(sizes: Sequence[int], limit: int) -> list[list[tuple[int, int, int]]]:
    """The concatenation of tensors of ``sizes`` elements cut into consecutive buckets of at most ``limit``
    elements: each bucket a list of pieces ``(tensor index, start, stop)``, a tensor cut where a bucket
    ends. Sizes alone decide the cut, so ranks holding the same shapes form the same buckets."""
    buckets: list[list[tuple[int, int, int]]] = [[]]
    room = limit
    for index, size in enumerate(sizes):
        start = 0
        while start < size:
            if room == 0:
                buckets.append([])
                room = limit
            stop = min(size, start + room)
            buckets[-1].append((index, start, stop))
            room -= stop - start
            start = stop
    return [bucket for bucket in buckets if bucket]


def all_reduce_flat(tensors: list[Tensor], group: dist.ProcessGroup, average: bool = False) -> None:
    """All-reduce the contiguous ``tensors`` in place through flat buffers of at most
    :data:`FLAT_BUCKET_BYTES` (one dtype each)."""
    by_dtype: dict[torch.dtype, list[Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for ts in by_dtype.values():
        flats = [t.view(-1) for t in ts]
        for bucket in flat_buckets([f.numel() for f in flats], FLAT_BUCKET_BYTES // ts[0].element_size()):
            flat = torch.cat([flats[i][lo:hi] for i, lo, hi in bucket])
            dist.all_reduce(flat, group=group)
            if average:
                flat /= dist.get_world_size(group)
            offset = 0
            for i, lo, hi in bucket:
                flats[i][lo:hi].copy_(flat[offset : offset + hi - lo])
                offset += hi - lo
