"""`StateSchema`: the full shapes of a model's parameters and where each shard of them lives.

A schema is what every rank must agree on to move state without asking anyone: the global
parameter names (``named_parameters`` order, so a tied LM head appears once, as the
embedding), their full shapes and dtypes, the TP plan, and the counts that bound a layout.
Regions are computed from :mod:`nereus_lightning.models.sharding`, the single source of truth
for how a transformers causal LM is cut.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from nereus_lightning.models.optim import ADAMW_KEYS, adamw_dtype, adamw_keys, shaped_adamw_keys
from nereus_lightning.models.sharding import Placement, Style, placement, pp_stages, tp_plan_of
from nereus_lightning.plan.layout import Layout
from nereus_lightning.spec.errors import require
from nereus_lightning.spec.families import family_of

# Optimizer tensors of an fp32 parameter (torch AdamW names); ``step`` is a 0-d fp32 tensor, never
# cut. A bf16/fp16 parameter also has an fp32 ``master`` and fp32 moments: the per-parameter keys
# are ``StateSchema.optim_keys(name)`` (defined once, by ``models.optim.adamw_keys``).
OPTIM_KEYS: tuple[str, ...] = ADAMW_KEYS
SHAPED_OPTIM_KEYS: tuple[str, ...] = ("exp_avg", "exp_avg_sq")
#: Bytes per element by dtype name.
ITEMSIZE = {"float32": 4, "float64": 8, "bfloat16": 2, "float16": 2, "int64": 8, "int32": 4, "uint8": 1}


@dataclass(frozen=True)
class StateSchema:
    """Names, full shapes and dtypes of a causal LM's parameters, plus its TP plan and layer/head counts."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]  # torch dtype names, e.g. "float32"
    tp_plan: tuple[tuple[str, Style], ...]
    num_layers: int
    num_heads: int
    num_kv_heads: int
    tied: bool = False

    def __post_init__(self) -> None:
        require(
            len(self.names) == len(self.shapes) == len(self.dtypes),
            "schema",
            f"{len(self.names)} names, {len(self.shapes)} shapes, {len(self.dtypes)} dtypes",
        )

    @classmethod
    def of(cls, config: Any, model_or_state: Any | None = None) -> StateSchema:
        """The schema of a transformers causal LM from its ``config`` (and optionally the model or its state
        dict).

        Without a model, one is instantiated on the meta device (no memory) to read the shapes.
        Refuses a family the body cannot compute exactly (:func:`~nereus_lightning.spec.families.family_of`)
        before reading anything.
        """
        import torch

        family_of(config)

        if model_or_state is None:
            from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

            from nereus_lightning.models.sharded import has_value_head

            auto = AutoModelForTokenClassification if has_value_head(config) else AutoModelForCausalLM
            with torch.device("meta"):
                model_or_state = auto.from_config(config)
        if isinstance(model_or_state, Mapping):
            tensors = dict(model_or_state)
        else:
            tensors = dict(model_or_state.named_parameters())
        tied = bool(getattr(config, "tie_word_embeddings", False))
        if tied:
            tensors.pop("lm_head.weight", None)  # the embedding, held once under its own name
        heads = int(config.num_attention_heads)
        kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
        return cls(
            names=tuple(tensors),
            shapes=tuple(tuple(t.shape) for t in tensors.values()),
            dtypes=tuple(str(t.dtype).removeprefix("torch.") for t in tensors.values()),
            tp_plan=tuple(tp_plan_of(config).items()),
            num_layers=int(config.num_hidden_layers),
            num_heads=heads,
            num_kv_heads=kv_heads,
            tied=tied,
        )

    @cached_property
    def placements(self) -> dict[str, Placement]:
        """Placement (TP dim, layer, kind) of every parameter."""
        plan = dict(self.tp_plan)
        return {name: placement(name, plan) for name in self.names}

    @cached_property
    def shape_of(self) -> dict[str, tuple[int, ...]]:
        """Full shape by name."""
        return dict(zip(self.names, self.shapes, strict=True))

    @cached_property
    def dtype_name_of(self) -> dict[str, str]:
        """Parameter dtype name by name."""
        return dict(zip(self.names, self.dtypes, strict=True))

    def dtype_of(self, name: str) -> Any:
        """The torch dtype of parameter ``name``."""
        import torch

        return getattr(torch, self.dtype_name_of[name])

    def optim_keys(self, name: str) -> tuple[str, ...]:
        """The AdamW tensors of parameter ``name``: moments (+ ``master`` below fp32), then ``step``."""
        return adamw_keys(self.dtype_name_of[name])

    def shaped_optim_keys(self, name: str) -> tuple[str, ...]:
        """The AdamW tensors of ``name`` shaped like it (cut with
        it): the moments, + ``master`` below fp32.
        """
        return shaped_adamw_keys(self.dtype_name_of[name])

    def shaped_keys(self, name: str, trains: bool) -> tuple[str, ...]:
        """The tensors of ``name`` shaped like the parameter: ``"param"`` (+ :meth:`shaped_optim_keys`)."""
        return ("param", *self.shaped_optim_keys(name)) if trains else ("param",)

    def state_keys(self, name: str, trains: bool) -> tuple[str, ...]:
        """Every state tensor of ``name``: ``"param"``, and for a training unit :meth:`optim_keys`."""
        return ("param", *self.optim_keys(name)) if trains else ("param",)

    def key_dtype(self, name: str, key: str) -> Any:
        """The torch dtype of state tensor ``key`` of ``name`` (``step`` fp32; AdamW's fp32 below fp32)."""
        import torch

        if key == "param":
            return self.dtype_of(name)
        if key == "step":
            return torch.float32
        return getattr(torch, adamw_dtype(self.dtype_name_of[name]))

    def element_bytes(self, name: str, trains: bool) -> int:
        """Bytes per element of ``name`` over its shaped tensors (bf16 training: 2 + 3 x 4 = 14)."""
        dtype = self.dtype_name_of[name]
        n = ITEMSIZE.get(dtype, 4)
        if trains:
            n += len(self.shaped_optim_keys(name)) * ITEMSIZE.get(adamw_dtype(dtype), 4)
        return n

    def validate(self, layout: Layout) -> None:
        """Reject a layout that would split a head, a KV head or a cut dimension, or exceed the layers."""
        tp, pp = layout.tp, layout.pp
        require(
            self.num_heads % tp == 0,
            "layout.tp",
            f"tp={tp} does not divide num_heads={self.num_heads}; pick a divisor",
        )
        require(
            self.num_kv_heads % tp == 0,
            "layout.tp",
            f"tp={tp} does not divide num_kv_heads={self.num_kv_heads}; pick a divisor",
        )
        require(
            pp <= self.num_layers,
            "layout.pp",
            f"pp={pp} exceeds num_layers={self.num_layers}; use pp <= {self.num_layers}",
        )
        require(tp & (tp - 1) == 0, "layout.tp", f"tp={tp} must be a power of two")
        require(pp & (pp - 1) == 0, "layout.pp", f"pp={pp} must be a power of two")
        for name, shape in zip(self.names, self.shapes, strict=True):
            dim = self.placements[name].tp_dim
            if dim is not None:
                require(
                    shape[dim] % tp == 0,
                    "layout.tp",
                    f"tp={tp} does not divide dim {dim} ({shape[dim]}) of {name}",
                )

    def stage_names(self, layout: Layout, pp_rank: int) -> tuple[str, ...]:
        """The parameters held by pipeline stage ``pp_rank`` under ``layout`` (schema order)."""
        by_pp = self._stage_names
        if layout.pp not in by_pp:
            stages: list[list[str]] = [[] for _ in range(layout.pp)]
            for name in self.names:
                for rank in pp_stages(self.placements[name], self.num_layers, layout.pp, self.tied):
                    stages[rank].append(name)
            by_pp[layout.pp] = tuple(tuple(names) for names in stages)
        return by_pp[layout.pp][pp_rank]

    @cached_property
    def _stage_names(self) -> dict[int, tuple[tuple[str, ...], ...]]:
        """Per PP degree, every stage's parameters (filled by :meth:`stage_names`)."""
        return {}

    def interval(self, name: str, layout: Layout, tp_rank: int) -> tuple[int, int]:
        """The ``[lo, hi)`` range along the TP dim that ``tp_rank`` holds (the whole extent when not cut).

        Replicated tensors use their first dim's extent (or (0, 1) for scalars) so that every
        region is one interval.
        """
        shape = self.shape_of[name]
        dim = self.placements[name].tp_dim
        if dim is None:
            return (0, shape[0] if shape else 1)
        chunk = shape[dim] // layout.tp
        return (tp_rank * chunk, (tp_rank + 1) * chunk)

    def shard_shape(self, name: str, layout: Layout) -> tuple[int, ...]:
        """Shape of one shard of ``name`` under ``layout``."""
        shape = list(self.shape_of[name])
        dim = self.placements[name].tp_dim
        if dim is not None:
            shape[dim] //= layout.tp
        return tuple(shape)
