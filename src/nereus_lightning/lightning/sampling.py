"""Per-sample deterministic generation and scoring with a causal LM replica.

Each sequence draws its tokens from its own generator seeded by ``(seed, step, global index)``
(Gumbel-max over the temperature-scaled logits), so a sample's response does not depend on
which replica generated it or on which other samples shared its batch: the property that makes
a run reproducible across DP layouts and resumable under another world size.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from nereus_lightning.rl.losses import token_log_probs


def sample_seed(seed: int, step: int, index: int) -> int:
    """The generator seed of sample ``index`` at RL step ``step``."""
    return (seed * 1_000_003 + step * 10_007 + index) % (2**63 - 1)


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """Token ids ``[B, P]`` left-padded to the longest prompt, and the attention mask."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros((len(prompts), width), dtype=torch.long, device=device)
    for i, p in enumerate(prompts):
        if len(p):
            ids[i, width - len(p) :] = torch.tensor(list(p), dtype=torch.long, device=device)
            mask[i, width - len(p) :] = 1
    return ids, mask


@torch.no_grad()
def generate(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    seeds: Sequence[int] | None,
    eos_id: int,
    pad_id: int,
    temperature: float = 1.0,
) -> list[list[int]]:
    """Sample up to ``max_new_tokens`` per prompt (``seeds=None``: greedy); stops at ``eos_id`` (kept)."""
    state: dict = {"cache": None, "seen": 0}

    def next_logits(ids: Tensor, mask: Tensor) -> Tensor:
        # Feed only the tokens the KV cache has not seen yet.
        step_ids = ids[:, state["seen"] :]
        position_ids = (mask.cumsum(-1) - 1).clamp_min(0)[:, -step_ids.shape[1] :]
        result = model(
            input_ids=step_ids,
            attention_mask=mask,
            position_ids=position_ids,
            cache=state["cache"],
            use_cache=True,
        )
        state["cache"] = result.cache if "cache" in result else result.past_key_values
        state["seen"] = ids.shape[1]
        return result.logits[:, -1, :]

    return _decode(next_logits, model, prompts, max_new_tokens, seeds, eos_id, pad_id, temperature)


def _decode(
    next_logits: Callable[[Tensor, Tensor], Tensor],
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    seeds: Sequence[int] | None,
    eos_id: int,
    pad_id: int,
    temperature: float,
) -> list[list[int]]:
    """The decode loop shared by :func:`generate` and :func:`generate_sharded`: per-row generators,
    finished rows padded, ``next_logits(ids, mask) -> [B, V]`` gives the last position's logits."""
    if not prompts:
        return []
    device = next(model.parameters()).device
    ids, mask = left_pad(prompts, pad_id, device)
    gens = None if seeds is None else [torch.Generator(device=device).manual_seed(int(s)) for s in seeds]
    out: list[list[int]] = [[] for _ in prompts]
    done = torch.zeros(len(prompts), dtype=torch.bool, device=device)
    for _ in range(max_new_tokens):
        next_ids = _pick(next_logits(ids, mask), gens, temperature)
        alive = ~done
        next_ids = torch.where(alive, next_ids, torch.full_like(next_ids, pad_id))
        for i, tok in enumerate(next_ids.tolist()):
            if alive[i]:
                out[i].append(tok)
        done = done | (next_ids == eos_id)
        if bool(done.all()):
            break
        ids = torch.cat([ids, next_ids.unsqueeze(-1)], dim=-1)
        mask = torch.cat([mask, alive.long().unsqueeze(-1)], dim=-1)
    return out


def pack_sequences(
    prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], pad_id: int, device: torch.device
) -> tuple[Tensor, Tensor, Tensor, int]:
    """Right-padded ``prompt + response`` ids ``[B, L]``, attention mask, response mask ``[B, R]``, and R.

    The response mask marks response tokens; position ``j`` of the response of row ``i`` is token
    ``len(prompt_i) + j`` of the sequence.
    """
    resp_width = max(1, max((len(r) for r in responses), default=1))
    width = max(len(p) + len(r) for p, r in zip(prompts, responses, strict=True))
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long, device=device)
    attn = torch.zeros_like(ids)
    resp_mask = torch.zeros((len(prompts), resp_width), dtype=torch.float32, device=device)
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        seq = list(p) + list(r)
        ids[i, : len(seq)] = torch.tensor(seq, dtype=torch.long, device=device)
        attn[i, : len(seq)] = 1
        resp_mask[i, : len(r)] = 1.0
    return ids, attn, resp_mask, resp_width


def response_positions(prompt_lens: Sequence[int], resp_width: int, device: torch.device) -> Tensor:
    """Index ``[B, R]`` of the logit position that predicts each response token (clamped for padding)."""
    starts = torch.tensor([max(n - 1, 0) for n in prompt_lens], device=device).unsqueeze(-1)
    return starts + torch.arange(resp_width, device=device).unsqueeze(0)


def response_log_probs(
    model: nn.Module, ids: Tensor, attn: Tensor, prompt_lens: Sequence[int], resp_width: int
) -> Tensor:
    """Log-probabilities ``[B, R]`` of each response token under ``model`` (differentiable)."""
    logits = model(input_ids=ids, attention_mask=attn).logits
    pos = response_positions(prompt_lens, resp_width, ids.device).clamp_max(ids.shape[1] - 2)
    picked = logits.gather(1, pos.unsqueeze(-1).expand(-1, -1, logits.shape[-1]))
    targets = ids.gather(1, (pos + 1).clamp_max(ids.shape[1] - 1))
    return token_log_probs(picked, targets)


def response_values(
    critic: nn.Module, ids: Tensor, attn: Tensor, prompt_lens: Sequence[int], resp_width: int
) -> Tensor:
    """Values ``[B, R]``: the critic's value head (row 0 of its LM head) at each response token's state."""
    logits = critic(input_ids=ids, attention_mask=attn).logits
    pos = response_positions(prompt_lens, resp_width, ids.device).clamp_max(ids.shape[1] - 2)
    return logits[..., 0].float().gather(1, pos)


def _pick(logits: Tensor, gens: list[torch.Generator] | None, temperature: float) -> Tensor:
    """Next token per row: greedy, or Gumbel-max with each row's own generator."""
    logits = logits.float()
    if gens is None:
        return logits.argmax(-1)
    noise = torch.stack([torch.rand(logits.shape[-1], generator=g, device=logits.device) for g in gens])
    gumbel = -torch.log(-torch.log(noise.clamp(1e-10, 1.0 - 1e-7)))
    return (logits / max(temperature, 1e-6) + gumbel).argmax(-1)


@torch.no_grad()
def generate_sharded(
    unit: nn.Module,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    seeds: Sequence[int] | None,
    eos_id: int,
    pad_id: int,
    temperature: float = 1.0,
) -> list[list[int]]:
    """:func:`generate` over a TP/PP-sharded replica (every rank of the replica calls it with the same prompts).

    Recomputes the whole sequence per token (no KV cache across pipeline stages); the sampling
    rule and per-sample generators are those of :func:`generate`, so responses match it.
    """
    from nereus_lightning.models import MicroBatch, forward_logits

    def next_logits(ids: Tensor, mask: Tensor) -> Tensor:
        position_ids = (mask.cumsum(-1) - 1).clamp_min(0)
        return forward_logits(unit, MicroBatch(ids, mask, position_ids), where="all")[:, -1, :]

    return _decode(next_logits, unit, prompts, max_new_tokens, seeds, eos_id, pad_id, temperature)


def pick_response(token_lp: Tensor, prompt_lens: Sequence[int], resp_width: int) -> Tensor:
    """Response-token entries ``[B, R]`` of per-position values ``[B, S-1]`` (log-probs of token t+1)."""
    pos = response_positions(prompt_lens, resp_width, token_lp.device).clamp_max(token_lp.shape[1] - 1)
    return token_lp.gather(1, pos)
