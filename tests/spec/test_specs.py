import pytest

from nereus_lightning.spec import (
    ClusterSpec,
    ModelSpec,
    NereusConfigError,
    Workload,
    cluster_preset,
    model_preset,
)


def test_llama3_8b_kv_cache_is_128_kib_per_token():
    # 2 (K,V) x 32 layers x 8 kv heads x 128 head_dim x 2 bytes = 131072
    assert model_preset("llama3_8b").kv_bytes_per_token() == 128 * 1024


def test_llama3_8b_param_count_matches_published_8_03b():
    assert abs(model_preset("llama3_8b").num_params - 8.03e9) / 8.03e9 < 0.005


def test_from_hf_config_dict_roundtrip():
    from transformers import LlamaConfig

    cfg = LlamaConfig(
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=96,
        vocab_size=128,
    )
    spec = ModelSpec.from_hf_config(cfg, name="t")
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.intermediate) == (3, 2, 16, 96)
    assert ModelSpec.from_hf_config(cfg.to_dict(), name="t") == spec


def test_unknown_presets_list_known():
    with pytest.raises(NereusConfigError, match="llama3_8b"):
        model_preset("gpt5")
    with pytest.raises(NereusConfigError, match="paper_cluster2"):
        cluster_preset("nope")


def test_invalid_numbers_name_the_field():
    with pytest.raises(NereusConfigError, match="cluster.num_gpus"):
        cluster_preset("paper_cluster2").with_gpus(0)
    with pytest.raises(NereusConfigError, match="workload.response_len"):
        Workload(response_len=-5)
    with pytest.raises(NereusConfigError, match="layout.tp"):
        model_preset("llama3_8b").validate_tp(3)
    with pytest.raises(NereusConfigError, match="cluster.num_gpus"):
        ClusterSpec("x", 1, 4, 1e9, 1e12, 1e12, 1e11, 1e10, num_gpus=8)


@pytest.mark.parametrize("preset", ["tiny_qwen2", "tiny_gqa"])  # untied and tied causal LMs
def test_a_value_model_spec_counts_the_body_s_critic_parameters(preset: str):
    from nereus_lightning.lightning.roles import build_causal_lm, build_value_model

    lm = model_preset(preset)
    critic = build_value_model(lm, seed=0)
    spec = ModelSpec.from_hf_config(critic.config, name=lm.name)
    assert spec == lm.as_value_model()
    assert (spec.num_labels, spec.tie_embeddings, spec.lm_head_params) == (1, False, 0)
    assert spec.num_params == sum(p.numel() for p in critic.parameters())
    assert ModelSpec.from_hf_config(build_causal_lm(lm, seed=0).config, name=lm.name).num_labels == 0
