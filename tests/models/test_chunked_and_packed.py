"""Log-probs and entropy over token chunks equal full-vocabulary ones; packed micro-batches equal padded.

Every layout TP1/2 x PP1/2 on 4 gloo ranks, tiny fp32 models (the chunk size is forced down to a
few rows, so every micro-batch spans several chunks).
"""

from __future__ import annotations

from functools import partial

import pytest
import torch

import nereus_lightning.models.logprobs as logprobs_module
from nereus_lightning.models import (
    MicroBatch,
    ShardedCausalLM,
    forward_logits,
    pack,
    split_micro_batches,
    token_budget_slices,
    token_scores,
    train_step,
)
from nereus_lightning.plan.layout import Layout
from nereus_lightning.testing.tiny import VOCAB, my_replica, rel_err, tiny_model

LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]


def _few_rows(width: int = VOCAB) -> int:
    """A chunk budget of 3 rows of this rank's vocabulary slice."""
    return 3 * width


def _chunked_errors(rank: int, world: int, kind: str, temperature: float) -> dict[str, float]:
    model = tiny_model(kind)
    tied = bool(model.config.tie_word_embeddings)
    kept = logprobs_module.LOGIT_CHUNK_ELEMENTS
    errors: dict[str, float] = {}
    try:
        for tp, pp in LAYOUTS:
            logprobs_module.LOGIT_CHUNK_ELEMENTS = _few_rows(VOCAB // tp)
            _, comm = my_replica(rank, world, Layout(tp, pp), tied)
            sharded = ShardedCausalLM.from_model(model, comm)
            ids = torch.randint(0, VOCAB, (4, 11), generator=torch.Generator().manual_seed(5))
            mbs = split_micro_batches(ids, 2)
            out = token_scores(sharded, mbs, temperature=temperature, with_entropy=True)
            logits = forward_logits(sharded, mbs).double() / temperature
            ref_lp = torch.log_softmax(logits, -1)
            ref_ent = -(ref_lp.exp() * ref_lp).sum(-1)[:, :-1]
            ref_lp = ref_lp[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
            assert out is not None and out.shape == (2, 4, 10)
            errors[f"tp{tp}pp{pp}/logp"] = float((out[0].double() - ref_lp).abs().max())
            errors[f"tp{tp}pp{pp}/entropy"] = float((out[1].double() - ref_ent).abs().max())
    finally:
        logprobs_module.LOGIT_CHUNK_ELEMENTS = kept
    return errors


@pytest.mark.parametrize(("kind", "temperature"), [("gqa_tied", 1.0), ("qwen2", 0.7)])
def test_chunked_logprobs_and_entropy_equal_full_logits(dist4, kind: str, temperature: float) -> None:
    for rank, errors in enumerate(dist4.run(_chunked_errors, kind, temperature)):
        assert len(errors) == 2 * len(LAYOUTS)
        for key, err in errors.items():
            assert err <= 1e-6, f"rank {rank} {kind} {key}: {err:.2e}"


def _rollout(seed: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Left-padded prompts (width 5) then right-padded responses (width 7), as the rollout engine returns."""
    gen = torch.Generator().manual_seed(seed)
    prompt_lens, response_lens = [5, 2, 4, 3], [7, 3, 1, 6]
    ids = torch.randint(0, VOCAB, (4, 12), generator=gen)
    mask = torch.zeros(4, 12, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompt_lens, response_lens, strict=True)):
        mask[i, 5 - p : 5 + r] = 1
    return ids, mask, 5


def _score_mask(mask: torch.Tensor, prompt_width: int) -> torch.Tensor:
    """Positions whose output scores a response token: the token before each valid response token."""
    score = torch.zeros_like(mask)
    score[:, prompt_width - 1 : -1] = mask[:, prompt_width:]
    return score


def _loss(
    outputs: tuple[torch.Tensor, torch.Tensor], weights: torch.Tensor, keep: torch.Tensor
) -> torch.Tensor:
    log_probs, entropy = outputs
    return -(log_probs * weights).sum() + 0.01 * (entropy * keep).sum()


def _padded_loss(out: tuple, mb: MicroBatch, weights: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    return _loss(out, weights, keep)


def _packed_loss(out: tuple, mb: MicroBatch, scale: int) -> torch.Tensor:
    # train_step averages over micro-batches; the padded run has one
    return _loss(out, mb.extras["weights"], torch.ones(())) * scale


def _packed_errors(rank: int, world: int, kind: str) -> dict[str, float]:
    model = tiny_model(kind)
    tied = bool(model.config.tie_word_embeddings)
    kept = logprobs_module.LOGIT_CHUNK_ELEMENTS
    errors: dict[str, float] = {}
    try:
        for tp, pp in LAYOUTS:
            logprobs_module.LOGIT_CHUNK_ELEMENTS = _few_rows(VOCAB // tp)
            _, comm = my_replica(rank, world, Layout(tp, pp), tied)
            ids, mask, width = _rollout(11)
            score = _score_mask(mask, width)
            weights = torch.randn(ids.shape, generator=torch.Generator().manual_seed(3)) * score
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
            padded_mb = MicroBatch(ids, mask, positions)
            packed = pack(ids, mask, score)
            rows = token_budget_slices(mask.sum(-1).tolist(), 14)  # lengths 12, 5, 5, 9: three micro-batches
            parts = [pack(ids[r], mask[r], score[r]) for r in rows]
            packed_mbs = [
                MicroBatch.packed(p, weights=weights[r][p.rows, p.cols])
                for p, r in zip(parts, rows, strict=True)
            ]
            padded_loss = partial(_padded_loss, weights=weights[:, :-1], keep=score[:, :-1])
            packed_loss = partial(_packed_loss, scale=len(packed_mbs))
            grads = []
            for mbs, loss in (([padded_mb], padded_loss), (packed_mbs, packed_loss)):
                unit = ShardedCausalLM.from_model(model, comm)
                train_step(unit, mbs, loss, with_entropy=True)
                grads.append({n: p.grad.clone() for n, p in unit.named_parameters()})
            errors[f"tp{tp}pp{pp}/grad"] = max(rel_err(grads[1][n], grads[0][n]) for n in grads[0])

            full = token_scores(ShardedCausalLM.from_model(model, comm), padded_mb, with_entropy=True)
            one = token_scores(
                ShardedCausalLM.from_model(model, comm), MicroBatch.packed(packed), with_entropy=True
            )
            assert full is not None and one is not None and one.shape[1] == int(score.sum())
            keep = score[:, :-1].bool()
            for k, name in enumerate(("logp", "entropy")):
                errors[f"tp{tp}pp{pp}/{name}"] = rel_err(packed.unpack(one[k])[:, :-1][keep], full[k][keep])
    finally:
        logprobs_module.LOGIT_CHUNK_ELEMENTS = kept
    return errors


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "mistral"])
def test_packed_micro_batches_equal_padded(dist4, kind: str) -> None:
    for rank, errors in enumerate(dist4.run(_packed_errors, kind)):
        assert len(errors) == 3 * len(LAYOUTS)
        for key, err in errors.items():
            assert err <= 1e-5, f"rank {rank} {kind} {key}: {err:.2e}"


def test_pack_lays_valid_tokens_end_to_end() -> None:
    ids, mask, width = _rollout(1)
    score = _score_mask(mask, width)
    packed = pack(ids, mask, score)
    lengths = mask.sum(-1).tolist()
    assert packed.documents.bounds == (0, 12, 17, 22, 31)
    assert packed.input_ids.shape == (1, sum(lengths))
    assert packed.input_ids[0].tolist() == ids[mask.bool()].tolist()
    assert packed.position_ids[0].tolist() == [p for n in lengths for p in range(n)]
    back = packed.unpack(packed.input_ids[0][packed.score_positions])
    assert torch.equal(back[score.bool()], ids[score.bool()])
    assert int(back[~score.bool()].abs().sum()) == 0


def test_token_budget_slices() -> None:
    assert token_budget_slices([3, 4, 5, 9, 1, 1], 8) == [slice(0, 2), slice(2, 3), slice(3, 4), slice(4, 6)]
    assert token_budget_slices([], 8) == []
    assert token_budget_slices([20], 8) == [slice(0, 1)]  # longer than the budget: alone


def test_the_varlen_bounds_are_copied_to_the_device_once_per_packed_row():
    from nereus_lightning.models.packing import Documents, _device_bounds

    docs = Documents((0, 7, 7, 30, 40))
    first = _device_bounds(docs.bounds, torch.device("cpu"))
    assert first.dtype == torch.int32 and first.tolist() == [0, 7, 7, 30, 40]
    assert _device_bounds(Documents((0, 7, 7, 30, 40)).bounds, torch.device("cpu")) is first  # every layer
    assert _device_bounds((0, 5), torch.device("cpu")) is not first
