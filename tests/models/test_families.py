"""Every registered family computes exactly the unsharded model's function; everything else is refused.

Parametrised over ``spec.families.FAMILIES``: a new entry is tested by construction, on a tiny
GQA model of its own transformers config class (``proof.selfcheck``, the same checks
``nereus-check-model`` runs).
"""

from __future__ import annotations

import re
import time

import pytest
import torch
import transformers as tf

from nereus_lightning.models.sharding import fused_style, placement, tp_plan_of, tp_slices
from nereus_lightning.proof.admission import admit
from nereus_lightning.proof.selfcheck import chain_errors, layout_errors, worst
from nereus_lightning.spec.errors import NereusConfigError
from nereus_lightning.spec.families import FAMILIES, QKV, family_of
from nereus_lightning.spec.verdicts import cached_verdict
from nereus_lightning.testing.shrink import tiny_config_of, value_config_of

REQUIRED = ((1, 1), (2, 1), (1, 2), (2, 2))
TOL = 1e-5


def family_config(model_type: str):
    """A tiny GQA config (8 heads over 4 KV heads) of ``model_type``'s own transformers config class."""
    return tiny_config_of(tf.AutoConfig.for_model(model_type, num_attention_heads=8, num_key_value_heads=4))


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_family_matches_the_unsharded_model(dist4, model_type: str) -> None:
    config = family_config(model_type)
    lm = worst(dist4.run(layout_errors, config, REQUIRED))
    values = worst(dist4.run(layout_errors, value_config_of(config), REQUIRED))
    chain = worst(dist4.run(chain_errors, config))
    for layout in (f"tp{tp}pp{pp}" for tp, pp in REQUIRED):
        for key, errors in (
            (f"{layout}/logits", lm),
            (f"{layout}/logprobs", lm),
            (f"{layout}/values", values),
        ):
            assert key in errors, f"{model_type}: {key} was not checked"
            assert errors[key] <= TOL, f"{model_type} {key}: error {errors[key]:.2e}"
    assert {k.split("/")[0] for k in chain} == {"split_pp", "split_tp", "merge_tp", "merge_pp"}
    for key, err in chain.items():
        assert err <= (0 if key.endswith("state_diffs") else TOL), f"{model_type} chain {key}: {err}"


def test_a_fused_projection_is_cut_by_whole_head_groups() -> None:
    config = tf.AutoConfig.for_model(
        "phi3", hidden_size=64, num_attention_heads=8, num_key_value_heads=4, head_dim=8
    )
    style = fused_style(QKV, config)
    assert style.parts == (64, 32, 32) and style.groups == 4
    p = placement("model.layers.0.self_attn.qkv_proj.weight", tp_plan_of(config))

    def rows(tp: int, rank: int) -> list[int]:
        return tp_slices((128, 64), p, tp, rank)[0]

    def group(g: int) -> list[int]:  # KV head g with its query heads 2g, 2g + 1: q, k, v rows
        return [*range(16 * g, 16 * g + 16), *range(64 + 8 * g, 72 + 8 * g), *range(96 + 8 * g, 104 + 8 * g)]

    assert rows(4, 2) == group(2)
    # Group order: a shard at TP 2 is the two shards at TP 4 it splits into, one after the other.
    assert rows(2, 1) == group(2) + group(3) == rows(4, 2) + rows(4, 3)
    assert sorted(rows(1, 0)) == list(range(128))


def _cohere():
    return tf.AutoConfig.for_model(
        "cohere",
        hidden_size=32,
        num_attention_heads=4,
        num_hidden_layers=2,
        intermediate_size=64,
        vocab_size=64,
    )


def _stablelm():
    return tf.AutoConfig.for_model(
        "stablelm",
        hidden_size=32,
        num_attention_heads=4,
        num_hidden_layers=2,
        intermediate_size=64,
        vocab_size=64,
    )


# cohere: never checked (no verdict). stablelm: its check fails at TP 2 (its attention is built from
# hidden_size, not from heads, so a TP shard does not fit): the refusal names the layout and the cause.
UNSUPPORTED = {
    "cohere": (_cohere, "has no self-check verdict"),
    "stablelm": (_stablelm, "self-check (transformers"),
}


def test_a_family_whose_proof_fails_is_refused_with_the_layout_and_the_difference(dist4) -> None:
    verdict = admit(_stablelm(), pool=dist4)
    assert verdict is not None and set(verdict.exact_layouts) == {"tp1pp1", "tp1pp2"}
    layout, why = verdict.failure
    assert layout == "tp2pp1" and "shard shapes" in why.reason
    with pytest.raises(NereusConfigError, match=r"failed at tp2pp1: NereusConfigError: shards: shard shapes"):
        family_of(_stablelm())


@pytest.mark.parametrize("name", sorted(UNSUPPORTED))
def test_every_entry_point_refuses_an_unsupported_family(name: str, tmp_path, dist4) -> None:
    from nereus_lightning.cli.plan import plan_config, plan_from_config
    from nereus_lightning.emu import StateSchema, create_unit, registry
    from nereus_lightning.lightning.roles import build_causal_lm, build_value_model
    from nereus_lightning.models import ReplicaComm, ShardedCausalLM, shard_state
    from nereus_lightning.plan.layout import Layout
    from nereus_lightning.spec.model import ModelSpec

    make, why = UNSUPPORTED[name]
    config = make()
    if name == "stablelm" and cached_verdict(name) is None:
        admit(config, pool=dist4)
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    config.save_pretrained(tmp_path)
    as_dict = {**config.to_dict(), "model_type": name}
    entry_points = {
        "family_of": lambda: family_of(config),
        "ModelSpec.from_hf_config": lambda: ModelSpec.from_hf_config(as_dict),
        "nereus-plan model=hf": lambda: plan_from_config(
            plan_config(["model=hf", f"model.config={tmp_path}"])
        ),
        "shard_state": lambda: shard_state(model, config, Layout(1, 1), 0, 0),
        "ShardedCausalLM": lambda: ShardedCausalLM(config, ReplicaComm.single(), {}),
        "ShardedCausalLM.from_model": lambda: ShardedCausalLM.from_model(model, ReplicaComm.single()),
        "StateSchema.of": lambda: StateSchema.of(config, model),
        "emu.create_unit": lambda: create_unit("refused", config, model, Layout(1, 1), (0,)),
        "build_causal_lm": lambda: build_causal_lm(as_dict, seed=0),
        "build_value_model": lambda: build_value_model(as_dict, seed=0),
        "build_causal_lm(folder)": lambda: build_causal_lm(str(tmp_path), seed=0),
    }
    for entry, call in entry_points.items():
        with pytest.raises(NereusConfigError) as info:
            call()
        text = str(info.value)
        assert f"model family {name!r} is not supported" in text and why in text, f"{entry}: {text}"
        assert "supported families: " + ", ".join(sorted(FAMILIES)) in text, f"{entry}: {text}"
    assert "refused" not in registry().units
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


# A representative subset of the sweep (benchmarks/family_sweep.py): attention kept whole because
# its norms span all heads (olmo2); mixed sliding/full layers with their own RoPE, per-head q/k norms
# and an embedding scale (gemma3_text); a fused gate_up projection and sandwich norms (glm4); an
# unregistered mixture of experts with attention sinks (gpt_oss).
ADMITTED = ("olmo2", "gemma3_text", "glm4", "gpt_oss")


@pytest.mark.parametrize("model_type", ADMITTED)
def test_an_unregistered_family_is_admitted_by_proof_once(dist4, model_type: str, monkeypatch) -> None:
    from nereus_lightning.models.sharded import validate_layout
    from nereus_lightning.plan.layout import Layout
    from nereus_lightning.proof import admission

    config = tf.AutoConfig.for_model(model_type)
    with pytest.raises(NereusConfigError, match="has no self-check verdict"):
        family_of(config)
    start = time.perf_counter()
    verdict = admission.admit(config, pool=dist4)
    assert time.perf_counter() - start < 60
    assert verdict is not None and verdict.failure is None, verdict
    assert set(verdict.exact_layouts) == {"tp1pp1", "tp2pp1", "tp1pp2", "tp2pp2", "split_merge"}
    family = family_of(config)
    assert family.admitted == "proof" and "tp2pp2" in family.layouts
    validate_layout(config, Layout(2, 2))
    with pytest.raises(NereusConfigError, match="beyond what the self-check verified"):
        validate_layout(config, Layout(4, 1))
    # Cached: a second admission does not run the check again.
    monkeypatch.setattr(admission, "check_family", lambda *a, **k: pytest.fail("checked twice"))
    assert admission.admit(config, pool=dist4) == cached_verdict(model_type)


@pytest.mark.parametrize(
    ("model_type", "module", "style"),
    [
        ("llama", "layers.*.mlp.gate_proj", "packed_colwise"),  # a style the body does not implement
        ("llama", "layers.*.self_attn.kv_a_proj_with_mqa", "mla_kv_a_proj"),  # multi-head latent attention
        ("phi3", "layers.*.mlp.gate_up_proj", "sequence_parallel"),
    ],
)
def test_an_unimplemented_tp_style_is_refused_by_name(model_type: str, module: str, style: str) -> None:
    config = tf.AutoConfig.for_model(model_type)
    config.base_model_tp_plan = {**config.base_model_tp_plan, module: style}
    for call in (lambda: family_of(config), lambda: tp_plan_of(config)):
        with pytest.raises(NereusConfigError, match=re.escape(f"TP style '{style}' of {module}")):
            call()


def test_an_architecture_other_than_causal_lm_or_value_model_is_refused() -> None:
    config = tf.AutoConfig.for_model("llama")
    config.architectures = ["LlamaForSequenceClassification"]
    with pytest.raises(NereusConfigError, match="architecture LlamaForSequenceClassification"):
        family_of(config)
