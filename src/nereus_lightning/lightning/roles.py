"""Role models: what a LightningModule gives `NereusStrategy`, and how a job builds them.

The module says which role models exist (actor, reference, critic, reward: full transformers
models) and holds the algorithm; the strategy cuts the models into every model-stage's Elastic
Model Units at setup and owns them from then on (transitions, weight sync, checkpoints, offload).
A module is a :class:`RoleModule` when it has the two methods below; ``RLModule`` is one, and so
is any LightningModule a user writes the same way.

The builders below make a job's role models (actor and reference: causal LMs; critic and reward:
value models) from presets, config dicts or local model folders, checked against the tokenizer.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeGuard, runtime_checkable

import torch
from torch import nn

from nereus_lightning.engines.base import Decoding
from nereus_lightning.engines.registry import ENGINES
from nereus_lightning.models.sharded import LAYER_MODES
from nereus_lightning.spec.errors import NereusConfigError
from nereus_lightning.spec.families import family_of
from nereus_lightning.spec.model import MODEL_PRESETS, ModelSpec
from nereus_lightning.spec.workload import Workload, workflow


@dataclass(frozen=True)
class RoleModels:
    """The role models of one RL algorithm and how their training model-stages learn.

    Args:
        algorithm: a registered algorithm (:mod:`nereus_lightning.spec.algorithms`): names the model-stages
            (:func:`~nereus_lightning.spec.workload.workflow`) and which of them train.
        models: role (``actor``, ``reference``, ``critic``, ``reward``) -> its full model; a role
            that is absent or None has no model-stage state (e.g. a function reward).
        learning_rates: trainable role -> the AdamW learning rate of its training model-stage.
        rollout_engine: the generation model-stages' engine kind, a name of
            :data:`~nereus_lightning.engines.registry.ENGINES` (``"hf"``: generation on the units'
            modules; ``"vllm"``: vLLM engines fed from the generation units).
        tokenizer: saved beside each trained model in the checkpoint's ``hf/<model>/`` folder.
        decoding: how generated responses end and are padded, for the strategy's rollout engines
            (None: the module generates without them).
        layers: how the units' packed passes run their decoder layers
            (:data:`~nereus_lightning.models.sharded.LAYER_MODES`; ``"compiled"``: through torch.compile
            where the varlen attention kernel runs).
    """

    algorithm: str
    models: Mapping[str, nn.Module | None]
    learning_rates: Mapping[str, float] = field(default_factory=dict)
    rollout_engine: str = "hf"
    tokenizer: Any = None
    decoding: Decoding | None = None
    layers: str = "compiled"

    def __post_init__(self) -> None:
        workflow(self.algorithm)  # an unknown algorithm fails here, naming the known ones
        roles = {m.model for m in workflow(self.algorithm)}
        unknown = sorted(set(self.present()) - roles)
        if unknown:
            raise ValueError(f"role models {unknown} are not roles of {self.algorithm!r} ({sorted(roles)})")
        if self.rollout_engine not in ENGINES:
            raise ValueError(f"rollout_engine {self.rollout_engine!r} is not one of {list(ENGINES)}")
        if self.layers not in LAYER_MODES:
            raise ValueError(f"layers {self.layers!r} is not one of {list(LAYER_MODES)}")

    def present(self) -> dict[str, nn.Module]:
        """The roles that have a model."""
        return {role: model for role, model in self.models.items() if model is not None}

    def configs(self) -> dict[str, Any]:
        """The transformers config of every role that has a model."""
        return {role: model.config for role, model in self.present().items()}

    def specs(self) -> dict[str, ModelSpec]:
        """``ModelSpec`` per role from the models' configs (what the planner and the transition brain price).

        The reference prices as the actor when it has no model of its own.
        """
        configs = self.configs()
        out = {role: ModelSpec.from_hf_config(config, name=role) for role, config in configs.items()}
        if "reference" not in out and "actor" in out:
            out["reference"] = out["actor"].with_name("reference")
        return out


@runtime_checkable
class RoleModule(Protocol):
    """A LightningModule :class:`~nereus_lightning.lightning.strategy.NereusStrategy` can run."""

    def role_models(self) -> RoleModels:
        """The role models (called once, at setup: the strategy then owns their state)."""
        ...

    def workload(self, step: int = 0) -> Workload:
        """The RL step's shape at ``step`` (batch, expected lengths): prices plans and transitions."""
        ...


# ---- building role models ------------------------------------------------------------------------
def is_model_folder(source: Any, key: str = "actor.path") -> TypeGuard[str | os.PathLike[str]]:
    """Whether ``source`` names a local model folder (a directory with a ``config.json``)."""
    if not isinstance(source, (str, os.PathLike)) or not os.path.isdir(source):
        return False
    if not os.path.isfile(os.path.join(source, "config.json")):
        raise NereusConfigError(f"{key}: {os.fspath(source)!r} is a folder without a config.json")
    return True


def model_config(
    source: Any, vocab_size: int | None = None, pad_token_id: int | None = None, key: str = "actor.path"
) -> Any:
    """The transformers config a role model is built from (a folder's ``config.json``, a preset, a dict, a
    config).
    """
    import transformers as tf

    if is_model_folder(source, key):
        return tf.AutoConfig.from_pretrained(source)
    return _config_of(source, vocab_size, pad_token_id, key)


def vocabulary_rows(tokenizer: Any, multiple: int = 8) -> int:
    """Embedding rows for a model built from a preset to this
    tokenizer: its size rounded up so TP splits it.
    """
    return -(-len(tokenizer) // multiple) * multiple


def load_tokenizer(source: str) -> Any:
    """A transformers tokenizer from a folder (``AutoTokenizer``); pad falls back to eos, as verl does."""
    import transformers as tf

    if not os.path.isdir(source):
        raise NereusConfigError(f"data.tokenizer: {source!r} is not a folder holding a tokenizer")
    try:
        tokenizer = tf.AutoTokenizer.from_pretrained(source)
    except Exception as exc:
        raise NereusConfigError(
            f"data.tokenizer: no tokenizer could be loaded from {source!r} ({type(exc).__name__}: {exc}); "
            "save one there with tokenizer.save_pretrained or point data.tokenizer at one"
        ) from exc
    if tokenizer.eos_token_id is None:
        raise NereusConfigError(
            f"data.tokenizer: the tokenizer in {source!r} has no eos token; generation needs one"
        )
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def check_vocabulary(tokenizer: Any, config: Any, role: str) -> None:
    """Refuse a tokenizer with more ids than the model has embedding rows (ids past them would be garbage)."""
    size = len(tokenizer)
    rows = int(config.vocab_size)
    if size > rows:
        raise NereusConfigError(
            f"data.tokenizer: the tokenizer has {size} tokens but the {role} model's vocabulary has {rows} "
            "embedding rows; use the tokenizer the model was trained with (or resize its embeddings)"
        )


def hf_config_of(spec: ModelSpec, vocab_size: int | None = None, pad_token_id: int | None = None) -> Any:
    """A transformers Llama / Qwen config with ``spec``'s numbers (``vocab_size`` overrides the spec's)."""
    import transformers as tf

    common: dict[str, Any] = dict(  # (each family's config takes these keyword arguments)
        hidden_size=spec.hidden,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        intermediate_size=spec.intermediate,
        vocab_size=vocab_size or spec.vocab,
        max_position_embeddings=min(spec.max_position, 4096),
        tie_word_embeddings=spec.tie_embeddings,
        pad_token_id=pad_token_id,
        head_dim=spec.head_dim,
    )
    if spec.qk_norm:
        return tf.Qwen3Config(**common)
    if spec.qkv_bias:
        return tf.Qwen2Config(**common)
    return tf.LlamaConfig(**common)


def _config_of(
    source: Mapping[str, Any] | ModelSpec | str | Any,
    vocab_size: int | None,
    pad_token_id: int | None,
    key: str = "actor.path",
) -> Any:
    """A transformers config from a preset name, a ``ModelSpec``, a config dict or a config."""
    import transformers as tf

    if isinstance(source, str):
        if os.path.sep in source or source.startswith("."):
            raise NereusConfigError(
                f"model path: {source!r} does not exist (give a folder saved with save_pretrained)"
            )
        if source not in MODEL_PRESETS:
            raise NereusConfigError(
                f"model: unknown preset {source!r}; known presets: {', '.join(sorted(MODEL_PRESETS))} (or a "
                "local model folder)"
            )
        source = MODEL_PRESETS[source]
    if isinstance(source, ModelSpec):
        return hf_config_of(source, vocab_size, pad_token_id)
    if isinstance(source, Mapping):
        data = dict(source)
        model_type = data.pop("model_type", "llama")
        return tf.AutoConfig.for_model(model_type, **data)
    return source


def build_causal_lm(
    source: str | Mapping[str, Any] | ModelSpec | Any,
    seed: int,
    vocab_size: int | None = None,
    pad_token_id: int | None = None,
    key: str = "actor.path",
) -> nn.Module:
    """A causal LM in fp32 from a preset name, a ``ModelSpec``, a transformers config (or dict), or a local
    path.

    Presets and configs get random weights drawn from ``seed`` (no downloads); a path loads weights.
    """
    import transformers as tf

    config = model_config(source, vocab_size, pad_token_id, key)
    family_of(config, key)  # refused before any weight loads
    if is_model_folder(source, key):
        return tf.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.float().eval()


# A value model (critic, reward model) is token classification with one label, as verl's critic:
# ``score`` (Linear(hidden, 1)) replaces the LM head, no dropout, and no embedding tying.
_VALUE_MODEL = {"num_labels": 1, "classifier_dropout": 0.0, "tie_word_embeddings": False}


def build_value_model(
    source: str | Mapping[str, Any] | ModelSpec | Any,
    seed: int,
    vocab_size: int | None = None,
    pad_token_id: int | None = None,
    key: str = "critic.path",
) -> nn.Module:
    """A value model in fp32 (transformers ``*ForTokenClassification``, one label) from the same sources as
    :func:`build_causal_lm`.

    A local causal-LM folder loads its body; the ``score`` head then starts from ``seed``'s draw.
    """
    import transformers as tf

    config = copy.deepcopy(model_config(source, vocab_size, pad_token_id, key))
    family_of(config, key)  # refused before any weight loads
    for name, value in _VALUE_MODEL.items():
        # On the config itself: passed to from_pretrained as keyword arguments, the fields a
        # family's config lacks (e.g. classifier_dropout) would reach its model's __init__ and fail.
        setattr(config, name, value)
    torch.manual_seed(seed)
    if is_model_folder(source, key):
        model = tf.AutoModelForTokenClassification.from_pretrained(source, config=config, dtype=torch.float32)
    else:
        model = tf.AutoModelForTokenClassification.from_config(config, dtype=torch.float32)
    model.config.architectures = [
        type(model).__name__
    ]  # marks it a value model (models.sharded.has_value_head)
    return model.float().eval()


def frozen_copy(model: nn.Module) -> nn.Module:
    """A deep copy with gradients off (the reference policy)."""
    ref = copy.deepcopy(model)
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref.eval()
