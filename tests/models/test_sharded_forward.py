"""Forward equivalence: a sharded replica's logits and log-probs equal the unsharded transformers model's."""

from __future__ import annotations

import pytest
import torch

from nereus_lightning.models import ShardedCausalLM, forward_logits, split_micro_batches, token_logprobs
from nereus_lightning.plan.layout import Layout
from nereus_lightning.testing.tiny import VOCAB, my_replica, rel_err, tiny_model

LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2), (4, 1), (1, 4)]


def _forward_errors(rank: int, world: int, kind: str) -> dict[str, float]:
    model = tiny_model(kind)
    tied = bool(model.config.tie_word_embeddings)
    errors: dict[str, float] = {}
    for tp, pp in LAYOUTS:
        index, comm = my_replica(rank, world, Layout(tp, pp), tied)
        sharded = ShardedCausalLM.from_model(model, comm)
        gen = torch.Generator().manual_seed(100 + index)  # replicas see different batches
        ids = torch.randint(0, VOCAB, (4, 12), generator=gen)
        with torch.no_grad():
            ref = model(ids).logits
        ref_lp = torch.log_softmax(ref.double(), -1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
        logits = forward_logits(sharded, split_micro_batches(ids, 2), where="all")
        lp = token_logprobs(sharded, split_micro_batches(ids, 2), where="first")
        errors[f"tp{tp}pp{pp}/logits"] = rel_err(logits, ref)
        if comm.index == 0:
            errors[f"tp{tp}pp{pp}/logprobs"] = float((lp.double() - ref_lp).abs().max())
        else:
            assert lp is None
    return errors


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gqa_tied", "mistral"])
def test_sharded_logits_equal_unsharded(dist4, kind: str) -> None:
    results = dist4.run(_forward_errors, kind)
    for rank, errors in enumerate(results):
        assert len(errors) >= len(LAYOUTS)
        for key, err in errors.items():
            assert err <= 1e-5, f"rank {rank} {kind} {key}: relative error {err:.2e}"


def _padded_qwen3_errors(rank: int, world: int) -> float:
    model = tiny_model("qwen3")
    _, comm = my_replica(rank, world, Layout(2, 2), tied=True)
    sharded = ShardedCausalLM.from_model(model, comm)
    ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(7))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        ref = model(ids, attention_mask=mask, position_ids=pos).logits
    from nereus_lightning.models import MicroBatch

    logits = forward_logits(sharded, MicroBatch(ids, mask, pos))
    return rel_err(logits[mask.bool()], ref[mask.bool()])


def test_qwen3_qk_norm_with_padding_mask(dist4) -> None:
    for rank, err in enumerate(dist4.run(_padded_qwen3_errors)):
        assert err <= 1e-5, f"rank {rank}: relative error {err:.2e}"
