"""`ShardedGenerator`: transformers ``generate`` (and a plain ``model(input_ids=...).logits`` call) over
one rank of a sharded replica.

Every rank of the replica wraps its :class:`~nereus_lightning.models.ShardedCausalLM` and calls
``generate`` (or the forward) with the same inputs. Each forward runs the TP/PP-sharded unit:
the TP ranks all-gather their vocabulary-parallel logits, and the last pipeline stage broadcasts
them to every rank of the replica, so every rank sees bitwise the same logits, picks the same
tokens and leaves transformers' decoding loop at the same step. With a KV cache (transformers'
default ``DynamicCache``, indexed by global layer number) each rank caches the keys and values of
its own layers only; later stages receive the hidden states of the new tokens only.

The forward is inference only (no autograd); training runs
:func:`~nereus_lightning.models.train_step`. This module imports
transformers; :mod:`nereus_lightning.models` does not import it.
"""

from __future__ import annotations

import copy
from typing import Any

from torch import Tensor
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from nereus_lightning.models.pipeline import MicroBatch, forward_logits
from nereus_lightning.models.sharded import ShardedCausalLM, supports_kv_cache

# The output's cache field (``cache`` since transformers 5.2x, ``past_key_values`` before).
_CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


class ShardedGenerator(PreTrainedModel, GenerationMixin):
    """A transformers causal LM whose forward runs one rank of a TP/PP-sharded replica.

    Args:
        unit: this rank's :class:`ShardedCausalLM` (its parameters are used, never copied).
    """

    base_model_prefix = "unit"
    main_input_name = "input_ids"
    _supports_sdpa = True
    _supports_flash_attn = True
    _supports_flex_attn = True
    _supports_attention_backend = True

    def __init__(self, unit: ShardedCausalLM) -> None:
        # A copy: PreTrainedModel may adjust its config (attention backend, generation defaults).
        config = copy.deepcopy(unit.config)
        if getattr(config, "_experts_implementation_internal", None) is not None:
            # The unit's experts compute; this wrapper has none, so it must not ask for a kernel for them.
            config._experts_implementation_internal = None
        super().__init__(config)
        self.unit = unit
        self.config.use_cache = supports_kv_cache()

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """transformers ``generate``; cache-free where transformers cannot keep a per-stage cache."""
        if not supports_kv_cache():
            kwargs["use_cache"] = False
        return super().generate(*args, **kwargs)

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        cache: Any = None,
        use_cache: bool | None = None,
        past_key_values: Any = None,
        logits_to_keep: int = 0,
        **kwargs: Any,
    ) -> Any:
        """Full-vocabulary logits ``[B, S, V]`` on every rank of the replica (``.logits``), and the cache.

        ``logits_to_keep`` > 0: only the last positions' logits (``generate`` asks for 1, so a
        prefill never holds a prompt's whole-vocabulary logits).
        """
        cache = cache if cache is not None else past_key_values
        if use_cache is False:
            cache = None
        if position_ids is None and attention_mask is not None and cache is None:
            position_ids = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)
        batch = MicroBatch(input_ids, attention_mask, position_ids)
        logits = forward_logits(self.unit, batch, where="all", cache=cache, last=logits_to_keep)
        return CausalLMOutputWithPast(logits=logits, **{_CACHE_FIELD: cache})
