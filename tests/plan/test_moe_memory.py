"""The planner's parameters per GPU are what the body's TP shards hold, mixtures of experts included
(their experts, router and shared expert stay whole on every TP rank)."""

from __future__ import annotations

import math

import pytest

from nereus_lightning.models.sharding import placement, shard_shape, tp_plan_of
from nereus_lightning.plan.layout import Layout
from nereus_lightning.plan.memory import rank_params
from nereus_lightning.spec.model import ModelSpec

SHAPES = {
    "llama": {},
    "mixtral": {"model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen3_moe": {
        "model_type": "qwen3_moe",
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "head_dim": 16,
    },
}


def _body_params(config, tp: int) -> int:
    """Parameters one TP rank of the body holds (PP1): each tensor's TP shard under the family's plan."""
    import transformers as tf

    plan = tp_plan_of(config)
    model = tf.AutoModelForCausalLM.from_config(config)
    return sum(
        math.prod(shard_shape(tuple(p.shape), placement(n, plan), tp)) for n, p in model.named_parameters()
    )


@pytest.mark.parametrize("family", list(SHAPES))
def test_parameters_per_gpu_match_the_bodys_tp_shards(family):
    import transformers as tf

    fields = dict(SHAPES[family])
    model_type = fields.pop("model_type", "llama")
    config = tf.AutoConfig.for_model(
        model_type,
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        **fields,
    )
    spec = ModelSpec.from_hf_config(config)
    for tp in (1, 2):
        body = _body_params(config, tp)
        priced = rank_params(spec, Layout(tp, 1), 0)
        assert abs(priced - body) / body < 0.02, (family, tp, priced, body)
    if spec.num_experts:  # the experts do not halve at TP2
        assert rank_params(spec, Layout(2, 1), 0) > 0.6 * rank_params(spec, Layout(1, 1), 0)
