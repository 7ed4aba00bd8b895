"""Key centering (`oscar_hf.evaluation.centering`): subtracting a constant key mean leaves attention unchanged, and
reduces token-wise INT2 error when keys carry a large common offset."""

import pytest
import torch
from transformers import DynamicCache

from conftest import char_tokenizer, tiny_model
from oscar_hf import OscarCache, OscarConfig
from oscar_hf.calibrate import calibrate
from oscar_hf.evaluation.centering import CenteredOscarCache, fit_centering, int2_key_error
from oscar_hf.evaluation.methods import centering_methods, get_method
from oscar_hf.models import model_geometry
from oscar_hf.rotation import build_rotation
from oscar_hf.rotations_io import OscarRotations

TEXT = "The quick brown fox jumps over the lazy dog. " * 400


def _biased_model(offset: float = 6.0):
    """Tiny Qwen2 (k_proj has a bias) whose key bias is large: a big per-channel key mean, as in Qwen2.5."""
    model = tiny_model("qwen2")
    torch.manual_seed(1)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.k_proj.bias.copy_(offset * torch.randn_like(layer.self_attn.k_proj.bias))
    return model


def _random_means(model, scale: float = 5.0):
    g = model_geometry(model.config)
    torch.manual_seed(2)
    return {i: scale * torch.randn(g.num_key_value_heads, g.head_dim) for i in g.oscar_layers}


def _logits(model, cache, ids, schedule=(40, 16, 1, 1, 1)):
    out, pos = [], 0
    for n in schedule:
        out.append(model(input_ids=ids[:, pos : pos + n], past_key_values=cache, use_cache=True).logits)
        pos += n
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("attn", ["oscar", "sdpa"])
@pytest.mark.parametrize("config", [
    OscarConfig(bits=16, sink_tokens=4, window_tokens=8, key_clip="none", value_clip="none"),  # quantization off, every segment in use
    OscarConfig(bits=2, sink_tokens=0, window_tokens=256, key_clip="none", value_clip="none"),  # INT2, but the window covers the sequence
])
def test_centering_leaves_attention_unchanged(attn, config):
    model = _biased_model()
    model.set_attn_implementation(attn)
    ids = torch.randint(4, 100, (2, 59), generator=torch.Generator().manual_seed(0))
    rotations = OscarRotations.data_free(model.config, "hadamard")
    means = _random_means(model)
    reference = _logits(model, DynamicCache(config=model.config), ids)
    cache = CenteredOscarCache(model, rotations, config, key_means=means)
    got = _logits(model, cache, ids)
    torch.testing.assert_close(got, reference, atol=2e-4, rtol=2e-4)
    # ... and the cache really stores k − μ (rotated): compare its stored keys with the BF16 cache's.
    dyn = DynamicCache(config=model.config)
    model(input_ids=ids, past_key_values=dyn, use_cache=True)
    layer = model_geometry(model.config).oscar_layers[0]
    stored, _ = cache.layers[layer].stored_states()
    expected = torch.matmul(dyn.layers[layer].keys - means[layer][None, :, None, :], rotations.key_rotations[layer])
    torch.testing.assert_close(stored, expected, atol=1e-4, rtol=1e-4)  # nothing of layer 0's keys is quantized


def test_centering_reduces_int2_error_on_offset_keys():
    torch.manual_seed(0)
    h, n, d = 2, 512, 64
    offset = 8.0 * torch.randn(h, 1, d)
    keys = torch.randn(h, n, d) + offset
    rotation = build_rotation(torch.eye(d), use_eigenvectors=False)[0].float().expand(h, d, d)
    config = OscarConfig()
    plain = int2_key_error(keys, rotation, config)
    centered = int2_key_error(keys, rotation, config, mean=keys.mean(1))
    assert (centered < 0.05 * plain).all(), (plain, centered)


def test_centered_int2_cache_is_closer_to_bf16():
    """End to end on the biased tiny model: INT2 everywhere (no sink / window), centered vs plain OSCAR cache."""
    model = _biased_model(offset=10.0)
    ids = torch.randint(4, 100, (1, 80), generator=torch.Generator().manual_seed(0))
    rotations = OscarRotations.data_free(model.config, "hadamard")
    config = OscarConfig(sink_tokens=0, window_tokens=0, key_clip="none", value_clip="none")
    schedule = (48, 16, 16)
    reference = _logits(model, DynamicCache(config=model.config), ids, schedule)[:, 48:]
    dyn = DynamicCache(config=model.config)
    model(input_ids=ids[:, :48], past_key_values=dyn, use_cache=True)
    means = {i: dyn.layers[i].keys[0].float().mean(1) for i in model_geometry(model.config).oscar_layers}
    plain = _logits(model, OscarCache(model, rotations, config), ids, schedule)[:, 48:]
    centered = _logits(model, CenteredOscarCache(model, rotations, config, key_means=means), ids, schedule)[:, 48:]
    err_plain = (plain - reference).square().sum() / reference.square().sum()
    err_centered = (centered - reference).square().sum() / reference.square().sum()
    assert err_centered < 0.5 * err_plain, (err_plain, err_centered)


def test_fit_centering_and_registry(tmp_path):
    data = tmp_path / "text.txt"
    data.write_text(TEXT)
    model = _biased_model()
    config = OscarConfig(calibration_tokens=512, calibration_sequence_length=256, heldout_tokens=384, sink_tokens=16,
                         window_tokens=32)
    rotations = calibrate(model, char_tokenizer(), data=str(data), config=config, progress=False)
    centered, diagnostic = fit_centering(model, char_tokenizer(), rotations, config, data=str(data))
    layers = model_geometry(model.config).oscar_layers
    assert set(centered.key_means) == set(layers) and centered.key_means[layers[0]].shape == (2, 16)
    for layer in layers:
        torch.testing.assert_close(centered.key_rotations[layer], rotations.key_rotations[layer])
        assert centered.value_clips[layer] == rotations.value_clips[layer]  # softmax does not see μ
    summary = diagnostic["summary"]
    assert summary["mean_energy_ratio"]["median"] > 0.3  # the bias (what RoPE leaves of it) is a large share
    assert summary["int2_error_noclip_centered"]["max"] < summary["int2_error_noclip"]["median"]
    method = get_method("oscar_centered")
    assert method.center_keys and method.needs_calibration and "oscar_centered" in centering_methods()
    cache = method.make_cache(model, centered)
    assert isinstance(cache, CenteredOscarCache)
    with pytest.raises(ValueError, match="key_means"):
        method.make_cache(model, rotations)
    ids = torch.randint(4, 100, (1, 120), generator=torch.Generator().manual_seed(0))
    logits = _logits(model, cache, ids, (60, 30, 30))
    assert torch.isfinite(logits).all()
