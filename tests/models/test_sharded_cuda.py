"""The same sharded module on a CUDA device (one-rank replica; skipped without a GPU)."""

from __future__ import annotations

import pytest
import torch

from nereus_lightning.models import (
    ReplicaComm,
    ShardedCausalLM,
    bind_adamw,
    forward_logits,
    shard_state,
    split_micro_batches,
    token_logprobs,
    train_step,
)
from nereus_lightning.plan.layout import Layout
from nereus_lightning.testing.tiny import VOCAB, rel_err, tiny_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("kind", ["qwen3", "gqa_tied", "mistral"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_forward_matches_transformers(kind: str, dtype: torch.dtype) -> None:
    model = tiny_model(kind).to("cuda", dtype)
    sharded = ShardedCausalLM.from_model(model, ReplicaComm.single())
    assert all(p.device.type == "cuda" and p.dtype == dtype for p in sharded.parameters())
    ids = torch.randint(0, VOCAB, (4, 16), device="cuda")
    with torch.no_grad():
        ref = model(ids).logits
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert rel_err(forward_logits(sharded, split_micro_batches(ids, 2)), ref) <= tol
    ref_lp = torch.log_softmax(ref.float(), -1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
    assert float((token_logprobs(sharded, ids) - ref_lp).abs().max()) <= (
        1e-4 if dtype == torch.float32 else 0.1
    )


def test_cuda_adamw_steps_match_transformers() -> None:
    model = tiny_model("qwen3").to("cuda")
    ref = tiny_model("qwen3").to("cuda")
    shards = shard_state(model, model.config, Layout(1, 1), 0, 0)
    sharded = ShardedCausalLM(model.config, ReplicaComm.single(), shards)
    opt = bind_adamw(sharded, lr=1e-3, eps=1e-4)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, eps=1e-4)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for _ in range(3):
        ids = torch.randint(0, VOCAB, (8, 12), device="cuda", generator=gen)
        adv = torch.randn(8, 11, device="cuda", generator=gen)
        loss = train_step(
            sharded, split_micro_batches(ids, 2, adv=adv), lambda lp, mb: -(lp * mb.extras["adv"]).mean(), opt
        )
        lp = torch.log_softmax(ref(ids).logits.float(), -1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
        ref_loss = -(lp * adv).mean()
        ref_opt.zero_grad()
        ref_loss.backward()
        ref_opt.step()
        assert abs(float(loss) - float(ref_loss.detach())) <= 1e-5
    expected = dict(ref.named_parameters())
    assert max(rel_err(t, expected[n]) for n, t in shards.items()) <= 1e-5
