"""Rollout engines over transformers: `generate` with a KV cache, and a cache-free loop over any logits.

Both sample as :mod:`nereus_lightning.engines.base` says (per-sample seeded Gumbel draws), so they give the
same responses.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from nereus_lightning.engines.base import RolloutOutput, finish_rollout, make_picker
from nereus_lightning.spec.errors import NereusConfigError


class HFGenerateEngine:
    """The default engine: any module with transformers' ``generate``.

    An unsharded actor, or one rank of a TP/PP-sharded replica through
    :class:`~nereus_lightning.models.generation.ShardedGenerator` (every rank of the replica
    calls :meth:`generate` with the same prompts and gets the same responses).

    Args:
        model: a transformers causal LM (or a wrapper exposing its ``generate``).
        eos_token_id: id that ends a response; None: responses run to ``max_new_tokens`` (verl's
            ``ignore_eos``, for benchmarks with a fixed response length).
        pad_token_id: id written after a response's end.
    """

    def __init__(self, model: Any, eos_token_id: int | None, pad_token_id: int) -> None:
        if not hasattr(model, "generate"):
            raise NereusConfigError(
                f"rollout.engine: {type(model).__name__} has no transformers-style generate()"
            )
        self.model = model
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id

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
    ) -> RolloutOutput:
        """See :class:`RolloutEngine`; sampling needs one seed per row (``sample_seeds``)."""
        from transformers import GenerationConfig, LogitsProcessorList

        batch, prompt_len = prompt_ids.shape
        pick = make_picker(
            batch, prompt_len, max_new_tokens, do_sample, temperature, top_k, top_p, sample_seeds
        )
        processors = LogitsProcessorList([pick] if pick is not None else [])
        # Every field that shapes the distribution is set, so that the model's own generation_config
        # (e.g. a checkpoint's repetition_penalty or do_sample) cannot fill it in.
        config = GenerationConfig(
            max_new_tokens=max_new_tokens,
            min_new_tokens=0,
            do_sample=False,  # sampling happens in the seeded processor; the argmax picks its draw
            num_beams=1,
            repetition_penalty=1.0,
            no_repeat_ngram_size=0,
            suppress_tokens=[],
            begin_suppress_tokens=[],
            eos_token_id=self.eos_token_id,
            pad_token_id=self.pad_token_id,
        )
        was_training = getattr(self.model, "training", False)
        if was_training:
            self.model.eval()
        try:
            out = self.model.generate(
                input_ids=prompt_ids,
                attention_mask=attention_mask,
                generation_config=config,
                logits_processor=processors,
            )
        finally:
            if was_training:
                self.model.train()
        return finish_rollout(
            prompt_ids,
            attention_mask,
            out[:, prompt_len:],
            max_new_tokens,
            self.eos_token_id,
            self.pad_token_id,
        )


class ForwardEngine:
    """Decoding over any logits function, without a KV cache.

    ``forward(input_ids, attention_mask, position_ids) -> logits (B, T, V)`` is any callable
    (sharded actors use :class:`HFGenerateEngine` over a
    :class:`~nereus_lightning.models.generation.ShardedGenerator` instead, with a KV cache);
    each new token re-runs the whole (short) sequence. It samples exactly as
    :class:`HFGenerateEngine` (same seeded Gumbel draw), so both give the same responses.
    """

    def __init__(
        self, forward: Callable[[Tensor, Tensor, Tensor], Tensor], eos_token_id: int | None, pad_token_id: int
    ) -> None:
        self.forward = forward
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id

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
    ) -> RolloutOutput:
        """See :class:`RolloutEngine`."""
        batch, prompt_len = prompt_ids.shape
        pick = make_picker(
            batch, prompt_len, max_new_tokens, do_sample, temperature, top_k, top_p, sample_seeds
        )
        ids, mask = prompt_ids, attention_mask
        done = torch.zeros(batch, dtype=torch.bool, device=prompt_ids.device)
        for _ in range(max_new_tokens):
            positions = mask.long().cumsum(-1) - 1
            logits = self.forward(ids, mask, positions.masked_fill(mask == 0, 0))[:, -1]
            nxt = logits.argmax(-1) if pick is None else pick(ids, logits).argmax(-1)
            nxt = torch.where(done, torch.full_like(nxt, self.pad_token_id), nxt)
            ids = torch.cat([ids, nxt.unsqueeze(-1)], dim=-1)
            mask = torch.cat([mask, (~done).long().unsqueeze(-1)], dim=-1)
            done = done | (nxt == self.eos_token_id)
            if bool(done.all()):
                break
        return finish_rollout(
            prompt_ids,
            attention_mask,
            ids[:, prompt_len:],
            max_new_tokens,
            self.eos_token_id,
            self.pad_token_id,
        )
