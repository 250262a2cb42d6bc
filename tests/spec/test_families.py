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
        ({"model_type": "olmo2"}, "model family 'olmo2' is not supported: it is not in the registry"),
        (
            {"model_type": "mixtral", "num_local_experts": 8},
            "mixture-of-experts blocks (num_local_experts=8)",
        ),
        ({"model_type": "qwen2_moe", "num_experts": 4}, "mixture-of-experts"),
        ({"model_type": None}, "names no model_type"),
        (
            {"architectures": ["LlamaForSequenceClassification"]},
            "architecture LlamaForSequenceClassification",
        ),
        ({"base_model_tp_plan": {"layers.*.mlp.up_proj": "packed_colwise"}}, "TP style 'packed_colwise'"),
    ],
)
def test_refusals_name_the_family_the_cause_and_the_supported_ones(changes: dict, cause: str) -> None:
    config = {**LLAMA, **changes}
    for call in (lambda: family_of(config), lambda: ModelSpec.from_hf_config(config)):
        with pytest.raises(NereusConfigError) as info:
            call()
        assert cause in str(info.value)
        assert str(info.value).startswith("model.config: ")
        assert str(info.value).endswith(f"supported families: {', '.join(supported_families())}")


def test_a_config_json_of_an_unsupported_family_is_refused(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA, "model_type": "cohere"}))
    with pytest.raises(NereusConfigError, match="'cohere' is not supported"):
        ModelSpec.from_hf_config(tmp_path)
