"""Where each parameter of a transformers causal LM lives under a ``Layout(tp, pp)``.

TP follows the model's own ``base_model_tp_plan`` (plus the causal-LM head's plan): colwise
tensors are cut along dim 0, rowwise weights along dim 1 (their bias is replicated), the
embedding along the vocabulary (dim 0), everything else is replicated. Cuts are equal
contiguous chunks, so a shard under ``tp`` is itself cut into ``k`` chunks under ``k * tp``:
new rank ``r`` holds chunk ``r % k`` of old rank ``r // k``'s shard. PP assigns contiguous layer
ranges; the embedding goes to the first stage, the final norm and the LM head to the last
(a tied LM head lives with the embedding on both stages). A value model (transformers token
classification with one label: ``score`` replaces ``lm_head``, as verl's critic) keeps its
``score`` head replicated over TP on the last stage. Names stay the model's global names.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Mapping
from dataclasses import dataclass

from nereus_lightning.spec.errors import require

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


@dataclass(frozen=True)
class Placement:
    """How one parameter is cut: ``tp_dim`` (None = replicated over TP) and its PP owner."""

    name: str
    tp_dim: int | None
    layer: int | None  # transformer block index, None outside the blocks
    kind: str  # "embed", "block", "final_norm", "lm_head", "value_head"


def tp_plan_of(config: object | None) -> dict[str, str]:
    """The full-name TP plan of a causal LM from its config (``base_model_tp_plan`` + LM head)."""
    plan = dict(DEFAULT_TP_PLAN)
    base = getattr(config, "base_model_tp_plan", None) if config is not None else None
    if base:
        plan = {k: v for k, v in plan.items() if not k.startswith("model.layers.")}
        plan.update({f"model.{k}": v for k, v in base.items()})
    return plan


def _style(module_name: str, plan: Mapping[str, str]) -> str | None:
    for pattern, style in plan.items():
        if fnmatch.fnmatchcase(module_name, pattern):
            return style
    return None


def placement(name: str, plan: Mapping[str, str] = DEFAULT_TP_PLAN) -> Placement:
    """The placement of parameter ``name`` (a global name such as ``model.layers.3.mlp.up_proj.weight``)."""
    module, _, leaf = name.rpartition(".")
    style = _style(module, plan) or ""
    if style.startswith("colwise") or style == "embedding_rowwise":
        tp_dim: int | None = 0
    elif style.startswith("rowwise"):
        tp_dim = 1 if leaf == "weight" else None
    else:
        tp_dim = None
    match = _LAYER.search(name)
    if match:
        return Placement(name, tp_dim, int(match.group(1)), "block")
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


def tp_slices(shape: tuple[int, ...], p: Placement, tp: int, tp_rank: int) -> tuple[slice, ...]:
    """The index of TP rank ``tp_rank``'s shard in the full tensor of ``shape``."""
    index = [slice(None)] * len(shape)
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
