import pytest
from transformers import DeepseekV3Config, Gemma2Config, LlamaConfig

from conftest import tiny_config
from oscar_hf.models import UnsupportedModelError, model_geometry


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_full_attention_families_are_all_oscar(family):
    g = model_geometry(tiny_config(family))
    assert g.plan == ("oscar",) * 3
    assert (g.num_key_value_heads, g.head_dim, g.num_key_value_groups) == (2, 16, 2)


def test_gemma3_hybrid_keeps_sliding_layers_in_bf16():
    g = model_geometry(tiny_config("gemma3"))
    assert g.plan == ("sliding", "oscar", "sliding", "oscar")
    assert g.oscar_layers == (1, 3)
    assert g.sliding_windows[0] is not None and g.sliding_windows[1] is None


def test_mla_is_refused_with_the_reason():
    with pytest.raises(UnsupportedModelError, match="latent attention"):
        model_geometry(DeepseekV3Config(num_hidden_layers=2))


def test_softcapping_is_refused():
    with pytest.raises(UnsupportedModelError, match="soft-capping"):
        model_geometry(Gemma2Config(num_hidden_layers=2))


def test_unknown_layer_type_is_refused():
    cfg = tiny_config("qwen3")
    cfg.layer_types = ["full_attention", "linear_attention", "full_attention"]
    with pytest.raises(UnsupportedModelError, match="layer 1 has layer type 'linear_attention'"):
        model_geometry(cfg)


def test_non_power_of_two_head_dim_is_refused():
    cfg = LlamaConfig(hidden_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=24, num_hidden_layers=2)
    with pytest.raises(UnsupportedModelError, match="head_dim 24 is not a power of two"):
        model_geometry(cfg)


def test_all_sliding_model_is_refused():
    cfg = tiny_config("mistral", sliding_window=4096)
    with pytest.raises(UnsupportedModelError, match="no full-attention layer"):
        model_geometry(cfg)
