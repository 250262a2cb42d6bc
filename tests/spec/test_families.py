"""The family registry: pure facts the brain can ask (config dicts, no torch); refusals give the reason."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from nereus_lightning.spec.errors import NereusConfigError
from nereus_lightning.spec.families import FAMILIES, QKV, family_of, supported_families
from nereus_lightning.spec.model import ModelSpec

LLAMA = {
    "model_type": "llama",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 256,
}


def test_the_brain_asks_the_registry_without_torch() -> None:
    code = (
        "import sys, json; from nereus_lightning.spec.model import ModelSpec; "
        f"ModelSpec.from_hf_config(json.loads({json.dumps(json.dumps(LLAMA))})); "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "False"


def test_family_facts_feed_the_model_spec() -> None:
    assert FAMILIES["phi3"].fused_kind("layers.7.self_attn.qkv_proj") == QKV
    assert FAMILIES["llama"].fused_kind("layers.7.self_attn.q_proj") is None
    assert ModelSpec.from_hf_config({**LLAMA, "model_type": "qwen2"}).qkv_bias
    assert ModelSpec.from_hf_config({**LLAMA, "model_type": "qwen3"}).qk_norm
    assert not ModelSpec.from_hf_config(LLAMA).qkv_bias


@pytest.mark.parametrize(
    ("changes", "cause"),
    [
        (
            {"model_type": "olmo2"},
            "model family 'olmo2' is not supported: it is not in the registry of families computed exactly "
            "(spec.families) and has no self-check verdict",
        ),
        ({"model_type": "qwen2_moe", "num_experts": 4}, "run `nereus-check-model model.config="),
        ({"model_type": None}, "names no model_type"),
        (
            {"architectures": ["LlamaForSequenceClassification"]},
            "architecture LlamaForSequenceClassification",
        ),
        ({"base_model_tp_plan": {"layers.*.mlp.up_proj": "packed_colwise"}}, "TP style 'packed_colwise'"),
    ],
)
def test_refusals_name_the_family_the_cause_and_the_supported_ones(
    changes: dict, cause: str, tmp_path, monkeypatch
) -> None:
    monkeypatch.setenv("NEREUS_FAMILY_CACHE", str(tmp_path))  # no verdict, whatever other tests proved
    config = {**LLAMA, **changes}
    for call in (lambda: family_of(config), lambda: ModelSpec.from_hf_config(config)):
        with pytest.raises(NereusConfigError) as info:
            call()
        assert cause in str(info.value)
        assert str(info.value).startswith("model.config: ")
        assert str(info.value).endswith(f"supported families: {', '.join(supported_families())}")


MIXTRAL_8X7B = {
    **LLAMA,
    "model_type": "mixtral",
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 14336,
    "vocab_size": 32000,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
}


def test_a_mixture_of_experts_is_priced_by_its_total_and_active_parameters() -> None:
    from nereus_lightning.plan.compute import layer_matmul_params

    spec = ModelSpec.from_hf_config(MIXTRAL_8X7B)
    # Mistral AI's published numbers for Mixtral-8x7B: 46.7B parameters, 12.9B used per token.
    assert round(spec.num_params / 1e9, 1) == 46.7 and round(spec.active_params / 1e9, 1) == 12.9
    dense = ModelSpec.from_hf_config({**MIXTRAL_8X7B, "model_type": "mistral", "num_local_experts": 0})
    assert dense.active_params == dense.num_params
    # Compute is priced by the experts a token uses, memory by all of them.
    assert layer_matmul_params(spec) < spec.layer_params / 3
    qwen = ModelSpec.from_hf_config(
        {
            **LLAMA,
            "model_type": "qwen3_moe",
            "num_experts": 128,
            "num_experts_per_tok": 8,
            "moe_intermediate_size": 32,
        }
    )
    assert qwen.qk_norm and qwen.expert_intermediate == 32 and qwen.experts_per_token == 8


def test_a_verdict_admits_a_family_and_a_failed_one_refuses_it_naming_the_layout(
    monkeypatch, tmp_path
) -> None:
    from nereus_lightning.spec.verdicts import LayoutVerdict, Verdict, save_verdict, transformers_version

    monkeypatch.setenv("NEREUS_FAMILY_CACHE", str(tmp_path))
    olmo = {**LLAMA, "model_type": "olmo"}
    with pytest.raises(NereusConfigError, match="no self-check verdict"):
        family_of(olmo)
    exact = {k: LayoutVerdict(True, 1e-7) for k in ("tp1pp1", "tp2pp1", "tp1pp2", "tp2pp2")}
    save_verdict(Verdict("olmo", transformers_version(), exact))
    assert family_of(olmo).admitted == "proof" and ModelSpec.from_hf_config(olmo).num_layers == 2
    assert set(family_of(olmo).layouts) == {"tp1pp1", "tp2pp1", "tp1pp2", "tp2pp2"}
    save_verdict(
        Verdict("olmo", transformers_version(), {"tp2pp2": LayoutVerdict(False, 0.3, "logits differ")})
    )
    with pytest.raises(NereusConfigError, match="self-check .* failed at tp2pp2: logits differ"):
        family_of(olmo)
    # Another transformers version has no verdict: it is checked again.
    save_verdict(Verdict("olmo", "0.0.1", exact))
    assert (tmp_path / "families.json").exists()


def test_a_config_json_of_an_unsupported_family_is_refused(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA, "model_type": "cohere"}))
    with pytest.raises(NereusConfigError, match="'cohere' is not supported"):
        ModelSpec.from_hf_config(tmp_path)
