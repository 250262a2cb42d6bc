"""The model families the body computes exactly: one registry that every entry point asks.

Pure facts about transformers configs (no torch): which ``model_type`` values are registered, which
of their projections are fused (one weight holding q|k|v or gate|up, cut by whole head groups), and
which ``base_model_tp_plan`` styles the body implements. A family enters the registry only with its
test (``tests/models/test_families.py`` checks every entry against the unsharded transformers
model); the registry keeps what is known to need special handling (fused projections, experts).

Any other ``model_type`` is admitted by proof: the body's exactness self-check
(``proof.admission``) runs a tiny random model of its config class at every layout a plan may use
and caches its verdict (``spec.verdicts``); :func:`family_of` then admits it as a generic family
whose facts are read from its config. :func:`family_of` refuses everything else (no verdict yet, a
failed verdict with its layout and difference, an unimplemented TP style, an architecture other
than a causal LM or a token-classification value model), naming the family, the cause and the way out.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from nereus_lightning.spec.errors import NereusConfigError
from nereus_lightning.spec.verdicts import (
    CHECKED_LAYOUTS,
    cached_verdict,
    on_trial_now,
    transformers_version,
)

#: A fused projection ``[q | k | v]`` (rows along the output dim), cut by key/value-head group.
QKV = "qkv"
#: A fused projection ``[gate | up]``, cut by MLP column.
GATE_UP = "gate_up"


@dataclass(frozen=True)
class Family:
    """A registered model family: its transformers ``model_type`` and what cutting it needs beyond Llama.

    ``fused`` maps base-model module patterns (as in ``base_model_tp_plan``) to :data:`QKV` or
    :data:`GATE_UP`. ``qkv_bias`` / ``qk_norm``: the family always has q/k/v biases / per-head q and k
    norms (for the parameter count of ``ModelSpec``). ``admitted``: ``"registry"`` or ``"proof"``
    (a verdict of the self-check); ``layouts``: the layouts a proof covers (empty: any layout).
    """

    model_type: str
    fused: tuple[tuple[str, str], ...] = ()
    qkv_bias: bool = False
    qk_norm: bool = False
    admitted: str = "registry"
    layouts: tuple[str, ...] = ()

    def fused_kind(self, module: str) -> str | None:
        """The fused kind of base-model module ``module`` (e.g. ``layers.3.self_attn.qkv_proj``), or None."""
        return next((kind for pattern, kind in self.fused if fnmatch.fnmatchcase(module, pattern)), None)


_PHI3_FUSED = (("layers.*.self_attn.qkv_proj", QKV), ("layers.*.mlp.gate_up_proj", GATE_UP))

#: The registry, by ``model_type``. Embedding scales, logit soft-capping and sandwich norms need no
#: entry: the sharded forward runs the family's own modules and head.
FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in (
        Family("llama"),
        Family("mistral"),
        Family("qwen2", qkv_bias=True),
        Family("qwen3", qk_norm=True),
        Family("phi3", fused=_PHI3_FUSED),
        Family("gemma"),
        Family("gemma2"),
        # Mixtures of experts: the experts and the router are kept whole on every TP rank (expert
        # parallelism is a later layout dimension); ModelSpec prices their total and active parameters.
        Family("mixtral"),
        Family("qwen3_moe", qk_norm=True),
    )
}

#: ``base_model_tp_plan`` styles the body implements, and how.
TP_STYLES: dict[str, str] = {
    "colwise": "cut along the output dim; each rank keeps its own heads or MLP columns",
    "rowwise": "cut along the input dim; the partial products are summed over TP",
    "rowwise_split_input": "as rowwise: its input is already this rank's slice",
    "replicated_with_grad_allreduce": "replicated; its gradient is summed over TP",
    "embedding_rowwise": "cut along the vocabulary",
    "colwise_gather_output": (
        "its module's output is needed whole (e.g. OLMo2's q/k norms span all heads): the parent "
        "module (attention or MLP) is kept whole on every TP rank"
    ),
    "local_params": "a container whose own parameter entries carry the styles (e.g. attention sinks)",
}
#: Styles a projection that its family declares fused may carry: it is cut by whole head groups,
#: so every rank computes its own heads' q, k, v (or its own columns' gate and up) either way.
FUSED_STYLES = ("colwise", "colwise_gather_output")

#: Config keys of mixture-of-experts blocks: the expert count, and the experts each token uses.
EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
TOP_K_KEYS = ("num_experts_per_tok", "moe_topk", "top_k")
#: Architectures the body builds: a causal LM, or a value model (token classification).
ARCHITECTURE_SUFFIXES = ("ForCausalLM", "ForTokenClassification")


def supported_families() -> tuple[str, ...]:
    """The registered ``model_type`` values, sorted."""
    return tuple(sorted(FAMILIES))


def generic_family(config: Any, admitted: str = "proof", layouts: tuple[str, ...] = ()) -> Family:
    """The facts of an unregistered family read from its config: fused projections by their
    conventional names in its TP plan, biases, per-head q/k norms. Only a proof makes them trusted."""
    plan = _get(config, "base_model_tp_plan") or {}
    fused = tuple(
        (pattern, QKV if pattern.endswith("qkv_proj") else GATE_UP)
        for pattern in plan
        if pattern.endswith(("self_attn.qkv_proj", "mlp.gate_up_proj"))
    )
    return Family(
        str(_get(config, "model_type")),
        fused=fused,
        qkv_bias=bool(_get(config, "attention_bias")),
        qk_norm=any(p.endswith("q_norm") for p in plan),
        admitted=admitted,
        layouts=layouts,
    )


def _admitted(config: Any, model_type: str, field: str) -> Family:
    """The generic family of an unregistered ``model_type`` when the self-check admitted it; else refuse."""
    if on_trial_now(model_type):
        return generic_family(config, admitted="trial")
    version = transformers_version()
    verdict = cached_verdict(model_type, version)
    way_out = (
        f"run `nereus-check-model model.config=<its folder or config.json>` once: it checks the family "
        f"on {len(CHECKED_LAYOUTS)} layouts, TP1/2 x PP1/2, and caches the verdict"
    )
    if verdict is None:
        raise refusal(
            model_type,
            f"it is not in the registry of families computed exactly (spec.families) and has no "
            f"self-check verdict for transformers {version}; {way_out}",
            field,
        )
    failed = verdict.failure
    if failed is not None:
        layout, why = failed
        raise refusal(
            model_type,
            f"the exactness self-check (transformers {version}) failed at {layout}: {why.reason}",
            field,
        )
    return generic_family(config, layouts=verdict.exact_layouts)


def _get(config: Any, key: str) -> Any:
    return config.get(key) if isinstance(config, Mapping) else getattr(config, key, None)


def refusal(model_type: object, what: str, field: str = "model.config") -> NereusConfigError:
    """The error for a config the body cannot compute exactly: its family, what is unsupported, what is."""
    return NereusConfigError(
        f"{field}: model family {model_type!r} is not supported: {what}; "
        f"supported families: {', '.join(supported_families())}"
    )


def check_styles(family: Family, plan: Mapping[str, str], field: str = "model.config") -> None:
    """Refuse a ``base_model_tp_plan`` entry whose style the body does not implement for that module."""
    for module, style in plan.items():
        if style in TP_STYLES or (family.fused_kind(module) is not None and style in FUSED_STYLES):
            continue
        fused = f"; fused projections ({', '.join(p for p, _ in family.fused)}) also take {FUSED_STYLES}"
        raise refusal(
            family.model_type,
            f"TP style {style!r} of {module} is not implemented (implemented: "
            f"{', '.join(TP_STYLES)}{fused if family.fused else ''})",
            field,
        )


def family_of(config: Any, field: str = "model.config") -> Family:
    """The registered family of a transformers config (a config object or its dict); refuses anything else.

    An unregistered family is admitted by a cached exact verdict of the self-check (its facts then
    come from :func:`generic_family`). Raises :class:`~nereus_lightning.spec.errors.NereusConfigError`
    naming the family, what is unsupported (no or a failed verdict, TP style, architecture) and the
    supported families, before anything is built or moved.
    """
    model_type = _get(config, "model_type")
    if not model_type:
        raise refusal(None, "the config names no model_type", field)
    family = FAMILIES.get(str(model_type)) or _admitted(config, str(model_type), field)
    other = [a for a in _get(config, "architectures") or () if not a.endswith(ARCHITECTURE_SUFFIXES)]
    if other:
        raise refusal(
            model_type,
            f"architecture {other[0]} (only causal LMs and token-classification value models are built)",
            field,
        )
    check_styles(family, _get(config, "base_model_tp_plan") or {}, field)
    return family
