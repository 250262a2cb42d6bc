"""Bad layouts and bad shard dicts are rejected, naming the cause, before any tensor is touched."""

from __future__ import annotations

import pytest
import torch

from nereus_lightning.models import ReplicaComm, ShardedCausalLM, forward_logits, shard_state, token_logprobs
from nereus_lightning.models.groups import replica_groups
from nereus_lightning.plan.layout import Layout
from nereus_lightning.spec.errors import NereusConfigError
from nereus_lightning.testing.tiny import VOCAB, rel_err, tiny_model


def _comm(layout: Layout, index: int = 0) -> ReplicaComm:
    # Validation runs before any collective, so no process group is needed to be rejected.
    ranks = tuple(range(layout.size))
    return ReplicaComm(layout, ranks, ranks[index], None, None, None, None)


@pytest.mark.parametrize(
    ("kind", "layout", "cause"),
    [
        ("llama", Layout(3, 1), "num_heads=4"),  # 4 heads, 4 KV heads
        ("gqa_tied", Layout(8, 1), "num_kv_heads=4"),  # 8 heads divide, 4 KV heads do not
        ("qwen3", Layout(4, 1), "num_kv_heads=2"),
        ("llama", Layout(1, 5), "exceeds num_layers=4"),
    ],
)
def test_bad_layout_rejected_before_state_is_touched(kind: str, layout: Layout, cause: str) -> None:
    model = tiny_model(kind)
    good = shard_state(model, model.config, Layout(1, 1), 0, 0)
    before = {n: t.clone() for n, t in good.items()}
    with pytest.raises(NereusConfigError, match=cause):
        ShardedCausalLM(model.config, _comm(layout), good)
    with pytest.raises(NereusConfigError, match=cause):
        shard_state(model, model.config, layout, 0, 0)
    assert all(torch.equal(good[n], before[n]) for n in good)
    assert all(p.grad is None for p in model.parameters())


def test_wrong_shard_dict_names_the_tensor() -> None:
    model = tiny_model("qwen2")
    layout = Layout(2, 2)
    shards = shard_state(model, model.config, layout, 1, 0)  # the last stage's tensors
    missing = dict(shards)
    del missing["model.layers.3.self_attn.q_proj.bias"]
    with pytest.raises(NereusConfigError, match=r"needs \['model.layers.3.self_attn.q_proj.bias'\]"):
        ShardedCausalLM(model.config, _comm(layout, index=2), missing)
    with pytest.raises(NereusConfigError, match=r"does not hold \['model.embed_tokens.weight'\]"):
        ShardedCausalLM(
            model.config, _comm(layout, index=2), {**shards, "model.embed_tokens.weight": torch.zeros(1)}
        )
    full = dict(shards, **{"lm_head.weight": model.lm_head.weight.detach()})
    with pytest.raises(NereusConfigError, match="lm_head.weight"):
        ShardedCausalLM(model.config, _comm(layout, index=2), full)


def test_single_rank_replica_without_distributed_uses_given_tensors() -> None:
    model = tiny_model("qwen3")
    shards = {
        n: torch.nn.Parameter(t) for n, t in shard_state(model, model.config, Layout(1, 1), 0, 0).items()
    }
    sharded = ShardedCausalLM(model.config, ReplicaComm.single(), shards)
    params = dict(sharded.named_parameters())
    assert params.keys() == shards.keys()
    assert all(params[n] is shards[n] for n in shards)  # the owner's Parameters, not copies
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = model(ids).logits
    assert rel_err(forward_logits(sharded, ids), ref) <= 1e-6
    lp = token_logprobs(sharded, ids)
    assert lp.shape == (2, 8) and lp.dtype == torch.float32
    with torch.no_grad():
        shards["model.norm.weight"].mul_(0.0)  # an owner's in-place update is what the module computes with
    assert forward_logits(sharded, ids).abs().max() == 0


def test_group_for_rejects_repeated_ranks() -> None:
    with pytest.raises(NereusConfigError, match="distinct"):
        replica_groups([(0, 0)], Layout(2, 1))
