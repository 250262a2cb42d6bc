"""`ModelSpec`: the architecture numbers the cost model and the sharding rules need."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

from nereus_lightning.spec.errors import NereusConfigError, require, unknown_preset
from nereus_lightning.spec.families import EXPERT_KEYS, TOP_K_KEYS, family_of

DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2}


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer of a registered family (``spec.families``), described by its numbers."""

    name: str
    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    vocab: int
    intermediate: int
    head_dim: int = 0  # 0: hidden // num_heads
    tie_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    dtype: str = "bfloat16"
    max_position: int = 131072
    # Mixture of experts (0: a dense MLP): experts per layer, experts each token uses, one expert's
    # MLP width, and the width of an always-used shared expert.
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate: int = 0
    shared_intermediate: int = 0
    # A value model (critic, reward model: ``*ForTokenClassification``, as ``models.sharded.has_value_head``
    # tells): the outputs of its ``score`` head (weight and bias), which replaces the LM head and which
    # every TP rank of the last stage holds whole (``models.sharding``); 0: a causal LM.
    num_labels: int = 0

    def __post_init__(self) -> None:
        for field in ("num_layers", "hidden", "num_heads", "num_kv_heads", "vocab", "intermediate"):
            require(
                getattr(self, field) > 0, f"model.{field}", f"must be positive, got {getattr(self, field)}"
            )
        require(
            self.num_labels >= 0 and not (self.num_labels and self.tie_embeddings),
            "model.num_labels",
            f"must be >= 0 (and 0 with a tied head), got {self.num_labels} (tied: {self.tie_embeddings})",
        )
        require(self.head_dim >= 0, "model.head_dim", f"must be >= 0, got {self.head_dim}")
        require(
            self.num_heads % self.num_kv_heads == 0,
            "model.num_kv_heads",
            f"{self.num_kv_heads} does not divide num_heads={self.num_heads}",
        )
        if self.num_experts:
            require(
                0 < self.experts_per_token <= self.num_experts and self.expert_intermediate > 0,
                "model.experts_per_token",
                f"a mixture of {self.num_experts} experts needs 0 < experts_per_token <= num_experts "
                f"(got {self.experts_per_token}) and expert_intermediate > 0 "
                f"(got {self.expert_intermediate})",
            )
        require(self.dtype in DTYPE_BYTES, "model.dtype", f"{self.dtype!r} not in {sorted(DTYPE_BYTES)}")
        if self.head_dim == 0:
            require(
                self.hidden % self.num_heads == 0,
                "model.hidden",
                f"{self.hidden} is not divisible by num_heads={self.num_heads}; set head_dim",
            )
            object.__setattr__(self, "head_dim", self.hidden // self.num_heads)

    @property
    def dtype_bytes(self) -> int:
        """Bytes per parameter element in the training/inference dtype."""
        return DTYPE_BYTES[self.dtype]

    @property
    def q_dim(self) -> int:
        """Width of the query projection output."""
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Width of one of the key / value projection outputs."""
        return self.num_kv_heads * self.head_dim

    @property
    def layer_params(self) -> int:
        """Parameters of one transformer block (attention, MLP, two norms, optional biases and qk-norms)."""
        attn = self.hidden * (self.q_dim + 2 * self.kv_dim) + self.q_dim * self.hidden
        if self.qkv_bias:
            attn += self.q_dim + 2 * self.kv_dim
        if self.qk_norm:
            attn += 2 * self.head_dim
        return attn + self.mlp_params + 2 * self.hidden

    @property
    def mlp_params(self) -> int:
        """Parameters of one block's MLP: every expert and the router for a mixture of experts."""
        if not self.num_experts:
            return 3 * self.hidden * self.intermediate
        experts = self.num_experts * 3 * self.hidden * self.expert_intermediate
        return experts + self.num_experts * self.hidden + 3 * self.hidden * self.shared_intermediate

    @property
    def mlp_active_params(self) -> int:
        """Parameters of one block's MLP that one token multiplies by (its routed experts only)."""
        if not self.num_experts:
            return self.mlp_params
        experts = self.experts_per_token * 3 * self.hidden * self.expert_intermediate
        return experts + self.num_experts * self.hidden + 3 * self.hidden * self.shared_intermediate

    @property
    def tp_whole_layer_params(self) -> int:
        """Parameters of one block every TP rank holds whole: a mixture of experts' MLP (the body keeps
        experts, router and shared expert unsplit under TP); none for a dense model."""
        return self.mlp_params if self.num_experts else 0

    @property
    def active_params(self) -> int:
        """Parameters one token's forward pass uses (all of them for a dense model)."""
        return self.num_params - self.num_layers * (self.mlp_params - self.mlp_active_params)

    @property
    def embedding_params(self) -> int:
        """Input embedding parameters (the LM head counts separately unless tied)."""
        return self.vocab * self.hidden

    @property
    def lm_head_params(self) -> int:
        """LM head parameters; zero when tied to the embedding, and for a value model (it has none)."""
        return 0 if self.tie_embeddings or self.num_labels else self.vocab * self.hidden

    @property
    def value_head_params(self) -> int:
        """A value model's ``score`` head parameters (weight and bias); zero for a causal LM."""
        return self.num_labels * (self.hidden + 1)

    @property
    def num_params(self) -> int:
        """Total parameter count."""
        heads = self.lm_head_params + self.value_head_params
        return self.num_layers * self.layer_params + self.embedding_params + heads + self.hidden

    def kv_bytes_per_token(self) -> int:
        """KV-cache bytes for one token across all layers (K and V)."""
        return 2 * self.num_layers * self.kv_dim * self.dtype_bytes

    def validate_tp(self, tp: int) -> None:
        """Reject a TP degree that would split an attention head or KV head."""
        require(tp >= 1, "layout.tp", f"must be >= 1, got {tp}")
        require(
            self.num_heads % tp == 0,
            "layout.tp",
            f"tp={tp} does not divide num_heads={self.num_heads} of {self.name}",
        )
        require(
            self.num_kv_heads % tp == 0,
            "layout.tp",
            f"tp={tp} does not divide num_kv_heads={self.num_kv_heads} of {self.name}",
        )

    def validate_pp(self, pp: int) -> None:
        """Reject a PP degree larger than the number of layers."""
        require(pp >= 1, "layout.pp", f"must be >= 1, got {pp}")
        require(
            pp <= self.num_layers, "layout.pp", f"pp={pp} exceeds num_layers={self.num_layers} of {self.name}"
        )

    def with_name(self, name: str) -> ModelSpec:
        """A copy under another name."""
        return replace(self, name=name)

    def as_value_model(self, num_labels: int = 1) -> ModelSpec:
        """The value model of this architecture (``lightning.roles.build_value_model``): a ``score`` head
        of ``num_labels`` outputs in place of the LM head, none tied."""
        return replace(self, tie_embeddings=False, num_labels=num_labels)

    @classmethod
    def from_hf_config(cls, config: Any, name: str | None = None) -> ModelSpec:
        """Build from a transformers config object, a dict, or a path to a ``config.json`` (or its folder).

        Refuses a config whose family the body cannot compute exactly
        (:func:`~nereus_lightning.spec.families.family_of`).
        """
        if isinstance(config, (str, os.PathLike)):
            path = os.fspath(config)
            if os.path.isdir(path):
                path = os.path.join(path, "config.json")
            if not os.path.isfile(path):
                raise NereusConfigError(f"model.config: no config.json at {path!r}")
            with open(path) as f:
                config = json.load(f)
        family = family_of(config)
        if not isinstance(config, dict):
            config = config.to_dict()
        try:
            heads = int(config["num_attention_heads"])
            labels = _value_head_of(config)
            hidden = int(config["hidden_size"])
            spec = cls(
                name=name or str(config.get("_name_or_path") or config.get("model_type", "model")),
                num_layers=int(config["num_hidden_layers"]),
                hidden=hidden,
                num_heads=heads,
                num_kv_heads=int(config.get("num_key_value_heads") or heads),
                vocab=int(config["vocab_size"]),
                intermediate=int(config["intermediate_size"]),
                head_dim=int(config.get("head_dim") or hidden // heads),
                tie_embeddings=bool(config.get("tie_word_embeddings", False)) and not labels,
                qkv_bias=bool(config.get("attention_bias", False)) or family.qkv_bias,
                qk_norm=family.qk_norm,
                dtype=_dtype_name(config.get("torch_dtype") or config.get("dtype") or "bfloat16"),
                max_position=int(config.get("max_position_embeddings", 131072)),
                num_labels=labels,
                **_experts_of(config),
            )
        except KeyError as exc:
            raise NereusConfigError(
                f"model.config: missing key {exc.args[0]!r} in the transformers config"
            ) from exc
        return spec


def names_value_model(architectures: Iterable[str] | None) -> bool:
    """Whether a config's ``architectures`` name a value model: token classification, whose ``score``
    head replaces ``lm_head`` (the critic and the reward model, as in verl)."""
    return any(a.endswith("ForTokenClassification") for a in architectures or ())


def _value_head_of(config: dict[str, Any]) -> int:
    """``num_labels`` of a value model's config (:func:`names_value_model`); 0 for a causal LM."""
    if not names_value_model(config.get("architectures")):
        return 0
    # A config dict carries its labels as ``id2label``; transformers' default is two.
    return int(config.get("num_labels") or len(config.get("id2label") or ()) or 2)


def _experts_of(config: dict[str, Any]) -> dict[str, int]:
    """The mixture-of-experts fields of a transformers config dict (none for a dense model)."""
    experts = next((int(config[k]) for k in EXPERT_KEYS if config.get(k)), 0)
    if not experts:
        return {}
    width = int(config.get("moe_intermediate_size") or config["intermediate_size"])
    shared = config.get("shared_expert_intermediate_size") or 0
    if not shared and config.get("n_shared_experts"):
        shared = int(config["n_shared_experts"]) * width
    return {
        "num_experts": experts,
        "experts_per_token": next((int(config[k]) for k in TOP_K_KEYS if config.get(k)), 0),
        "expert_intermediate": width,
        "shared_intermediate": int(shared),
    }


def _dtype_name(value: Any) -> str:
    text = str(value).replace("torch.", "")
    return text if text in DTYPE_BYTES else "bfloat16"


# Published architecture numbers (the models' config.json files).
MODEL_PRESETS: dict[str, ModelSpec] = {
    "llama3_8b": ModelSpec("Llama-3.1-8B", 32, 4096, 32, 8, 128256, 14336, max_position=131072),
    "llama3_70b": ModelSpec("Llama-3.3-70B", 80, 8192, 64, 8, 128256, 28672, max_position=131072),
    "qwen3_14b": ModelSpec(
        "Qwen3-14B", 40, 5120, 40, 8, 151936, 17408, head_dim=128, qk_norm=True, max_position=40960
    ),
    "qwen3_32b": ModelSpec(
        "Qwen3-32B", 64, 5120, 64, 8, 151936, 25600, head_dim=128, qk_norm=True, max_position=40960
    ),
    # The shape of the issue-31 measurements (reference/gpu-facts.md): 151,936-token vocabulary, tied head.
    "qwen2_0_5b": ModelSpec(
        "Qwen2-0.5B", 24, 896, 14, 2, 151936, 4864, tie_embeddings=True, qkv_bias=True, max_position=131072
    ),
    # Tiny models for tests and the embedded default (random weights, built from configs).
    "tiny_llama": ModelSpec("tiny-llama", 4, 64, 4, 4, 256, 128, dtype="float32", max_position=512),
    "tiny_gqa": ModelSpec(
        "tiny-gqa-tied", 4, 64, 8, 4, 256, 160, tie_embeddings=True, dtype="float32", max_position=512
    ),
    "tiny_qwen2": ModelSpec(
        "tiny-qwen2", 4, 64, 4, 2, 256, 128, qkv_bias=True, dtype="float32", max_position=512
    ),
}


def model_preset(name: str) -> ModelSpec:
    """The preset called ``name``; unknown names list the known ones."""
    if name not in MODEL_PRESETS:
        raise unknown_preset("model", name, list(MODEL_PRESETS))
    return MODEL_PRESETS[name]
