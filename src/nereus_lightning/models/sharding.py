"""Where each parameter of a transformers causal LM lives under a ``Layout(tp, pp)``.

TP follows the model's own ``base_model_tp_plan`` (plus the causal-LM head's plan): colwise
tensors are cut along dim 0, rowwise weights along dim 1 (their bias is replicated), the
embedding along the vocabulary (dim 0), everything else is replicated. Cuts are equal
contiguous chunks, so a shard under ``tp`` is itself cut into ``k`` chunks under ``k * tp``:
new rank ``r`` holds chunk ``r % k`` of old rank ``r // k``'s shard. PP assigns contiguous layer
ranges; the embedding goes to the first stage, the final norm and the LM head to the last
(a tied LM head lives with the embedding on both stages).

A fused projection (:class:`Fused`: one weight holding q|k|v or gate|up, as the family declares in
``spec.families``) is cut by whole groups (a key/value head with its query heads, an MLP column), so
each rank computes its own heads. Its rows are held in *group order*: group 0's rows of every
part, then group 1's, and so on. Then every rank's shard is one contiguous chunk at every TP degree
(and splits and merges stay contiguous intervals); :func:`tp_slices` maps a chunk to the model's own
rows (the HF order), and the module puts its output back into part order. A value model (transformers token
classification with one label: ``score`` replaces ``lm_head``, as verl's critic) keeps its
``score`` head replicated over TP on the last stage. Names stay the model's global names.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from nereus_lightning.spec.errors import require
from nereus_lightning.spec.families import GATE_UP, QKV, check_styles, family_of

# The Llama plan, used when a config carries none (the same for Qwen2/Qwen3/Mistral).
DEFAULT_TP_PLAN: dict[str, str] = {
    "model.embed_tokens": "embedding_rowwise",
    "model.layers.*.self_attn.q_proj": "colwise",
    "model.layers.*.self_attn.k_proj": "colwise",
    "model.layers.*.self_attn.v_proj": "colwise",
    "model.layers.*.self_attn.o_proj": "rowwise",
    "model.layers.*.mlp.gate_proj": "colwise",
    "model.layers.*.mlp.up_proj": "colwise",
    "model.layers.*.mlp.down_proj": "rowwise",
    "lm_head": "colwise_gather_output",
}

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")

#: The style of a module kept whole on every TP rank (its parameters replicated, built from the full
#: config): the parent of a projection whose output the family needs whole (``colwise_gather_output``
#: on an unfused projection, e.g. OLMo2's attention, whose q/k norms span all heads).
WHOLE = "whole"


@dataclass(frozen=True)
class Fused:
    """The TP style of a fused column-parallel projection: its parts' widths, cut by whole groups.

    ``parts``: the widths of the stacked sub-projections along the output dim, in the model's order
    (q, k, v: ``(heads * head_dim, kv_heads * head_dim, kv_heads * head_dim)``; gate, up:
    ``(intermediate, intermediate)``). ``groups``: how many groups each part is cut into (KV heads;
    MLP columns). TP must divide ``groups``.
    """

    parts: tuple[int, ...]
    groups: int

    @property
    def group_widths(self) -> tuple[int, ...]:
        """Rows of each part in one group."""
        return tuple(width // self.groups for width in self.parts)

    def rows(self, first_group: int, num_groups: int) -> list[int]:
        """The model's row indices of groups ``[first_group, first_group + num_groups)``, in group order."""
        offsets = [sum(self.parts[:i]) for i in range(len(self.parts))]
        out: list[int] = []
        for g in range(first_group, first_group + num_groups):
            for offset, width in zip(offsets, self.group_widths, strict=True):
                out.extend(range(offset + g * width, offset + (g + 1) * width))
        return out


Style = str | Fused


@dataclass(frozen=True)
class Placement:
    """How one parameter is cut: ``tp_dim`` (None = replicated over TP), its PP owner, its fused layout."""

    name: str
    tp_dim: int | None
    layer: int | None  # transformer block index, None outside the blocks
    kind: str  # "embed", "block", "final_norm", "lm_head", "value_head"
    fused: Fused | None = None


def fused_style(kind: str, config: Any) -> Fused:
    """The :class:`Fused` style of ``config``'s fused projection ``kind`` (``spec.families.QKV``, ...)."""
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    if kind == QKV:
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
        return Fused((heads * head_dim, kv_heads * head_dim, kv_heads * head_dim), kv_heads)
    assert kind == GATE_UP, kind
    return Fused((int(config.intermediate_size),) * 2, int(config.intermediate_size))


def tp_plan_of(config: object | None) -> dict[str, Style]:
    """The full-name TP plan of a causal LM from its config (``base_model_tp_plan`` + LM head).

    Asks the family registry first (refusing an unsupported config or TP style); a projection its
    family declares fused gets its :class:`Fused` style.
    """
    plan: dict[str, Style] = dict(DEFAULT_TP_PLAN)
    if config is None:
        return plan
    family = family_of(config)
    base = getattr(config, "base_model_tp_plan", None)
    if base:
        check_styles(family, base)
        plan = {k: v for k, v in plan.items() if not k.startswith("model.layers.")}
        plan.update({f"model.{k}": v for k, v in base.items()})
    for pattern, kind in family.fused:
        plan[f"model.{pattern}"] = fused_style(kind, config)
    # Shared experts are kept whole, as the routed ones: their width is not the config's intermediate size.
    plan = {k: v for k, v in plan.items() if "shared_expert" not in k}
    return _whole_regions(plan)


def cut_parts(plan: Mapping[str, Style]) -> tuple[bool, bool]:
    """Whether ``plan`` cuts the blocks' attention (by heads) and their MLP (by intermediate columns)."""
    attention = mlp = False
    for key, style in plan.items():
        cuts = isinstance(style, Fused) or (
            isinstance(style, str) and style.startswith(("colwise", "rowwise"))
        )
        if not cuts or not key.startswith("model.layers."):
            continue
        if ".self_attn." in key or ".attn." in key or ".attention." in key:
            attention = True
        else:
            mlp = True
    return attention, mlp


def _whole_regions(plan: dict[str, Style]) -> dict[str, Style]:
    """Replace the entries of a block module holding a gathered unfused projection by one :data:`WHOLE`."""
    whole = {
        k.rpartition(".")[0]
        for k, v in plan.items()
        if v == "colwise_gather_output" and k.startswith("model.layers.")
    }
    if not whole:
        return plan
    out: dict[str, Style] = dict.fromkeys(sorted(whole), WHOLE)
    out.update({k: v for k, v in plan.items() if not any(k.startswith(f"{w}.") for w in whole)})
    return out


def style_of(module_name: str, plan: Mapping[str, Style]) -> Style | None:
    """The style of module ``module_name`` (a global name) in ``plan``; None when the plan names none."""
    for pattern, style in plan.items():
        if fnmatch.fnmatchcase(module_name, pattern):
            return style
    return None


def placement(name: str, plan: Mapping[str, Style] = DEFAULT_TP_PLAN) -> Placement:
    """The placement of parameter ``name`` (a global name such as ``model.layers.3.mlp.up_proj.weight``)."""
    module, _, leaf = name.rpartition(".")
    # A plan may name a parameter itself (attention sinks: one per head) as well as modules.
    style = style_of(name, plan) or style_of(module, plan) or ""
    fused = style if isinstance(style, Fused) else None
    kind = "" if isinstance(style, Fused) else style
    if fused is not None or kind.startswith("colwise") or kind == "embedding_rowwise":
        tp_dim: int | None = 0
    elif kind.startswith("rowwise"):
        tp_dim = 1 if leaf == "weight" else None
    else:
        tp_dim = None
    match = _LAYER.search(name)
    if match:
        return Placement(name, tp_dim, int(match.group(1)), "block", fused)
    if name.startswith("lm_head"):
        return Placement(name, tp_dim, None, "lm_head")
    if "embed_tokens" in name:
        return Placement(name, tp_dim, None, "embed")
    if name.startswith("score."):
        return Placement(name, None, None, "value_head")
    return Placement(name, tp_dim, None, "final_norm")


def layer_range(num_layers: int, pp: int, pp_rank: int) -> range:
    """Contiguous layers of pipeline stage ``pp_rank``; earlier stages take the remainder."""
    require(1 <= pp <= num_layers, "layout.pp", f"pp={pp} must be in 1..num_layers={num_layers}")
    base, extra = divmod(num_layers, pp)
    start = pp_rank * base + min(pp_rank, extra)
    return range(start, start + base + (1 if pp_rank < extra else 0))


def pp_stages(p: Placement, num_layers: int, pp: int, tied: bool = False) -> tuple[int, ...]:
    """The pipeline stages that hold parameter ``p`` (two for a tied embedding when pp > 1)."""
    if p.kind == "block":
        assert p.layer is not None
        for rank in range(pp):
            if p.layer in layer_range(num_layers, pp, rank):
                return (rank,)
        raise ValueError(f"{p.name}: layer {p.layer} outside 0..{num_layers - 1}")
    if p.kind == "embed":
        return (0, pp - 1) if tied and pp > 1 else (0,)
    return (pp - 1,)


def tp_slices(shape: tuple[int, ...], p: Placement, tp: int, tp_rank: int) -> tuple[slice | list[int], ...]:
    """The index of TP rank ``tp_rank``'s shard in the full tensor of ``shape`` (the model's own order).

    A slice per dim, except along a fused tensor's TP dim: there the list of its rows in group order
    (at every ``tp``, ``tp == 1`` included). Read a shard with ``full[index]``, write one with
    ``full[index] = shard``.
    """
    index: list[slice | list[int]] = [slice(None)] * len(shape)
    if p.fused is not None:
        groups = p.fused.groups
        require(groups % tp == 0, "layout.tp", f"tp={tp} does not divide the {groups} groups of {p.name}")
        index[0] = p.fused.rows(tp_rank * (groups // tp), groups // tp)
        return tuple(index)
    if p.tp_dim is None or tp == 1:
        return tuple(index)
    size = shape[p.tp_dim]
    require(size % tp == 0, "layout.tp", f"tp={tp} does not divide dim {p.tp_dim} ({size}) of {p.name}")
    chunk = size // tp
    index[p.tp_dim] = slice(tp_rank * chunk, (tp_rank + 1) * chunk)
    return tuple(index)


def shard_shape(shape: tuple[int, ...], p: Placement, tp: int) -> tuple[int, ...]:
    """The shape of one TP shard of a tensor of ``shape``."""
    if p.tp_dim is None or tp == 1:
        return tuple(shape)
    out = list(shape)
    out[p.tp_dim] //= tp
    return tuple(out)
