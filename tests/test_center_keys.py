"""Key centering (`CalibrationConfig.center_keys`): key means from calibration, stored with the rotations, subtracted
by the cache before storage whenever the rotations carry them. Attention is unchanged (softmax invariance); INT2 error drops when keys carry a large mean."""

import json

import pytest
import torch
from transformers import DynamicCache

from conftest import char_tokenizer, rewrite_rotation_file, tiny_model
from oscar_hf import CalibrationConfig, OscarCache, OscarConfig
from oscar_hf.calibrate import StatisticsCollector, calibrate, capturing
from oscar_hf.models import model_geometry
from oscar_hf.rotations_io import CONFIG_NAME, FORMAT_VERSION, WEIGHTS_NAME, OscarRotations, RotationFileError

TEXT = "The quick brown fox jumps over the lazy dog. " * 400
LAYOUT = OscarConfig(sink_tokens=16, window_tokens=32)
CALIBRATION = CalibrationConfig(tokens=512, sequence_length=256, heldout_tokens=384, clip_grid=(0.8, 0.9, 1.0))


def biased_model(offset: float = 6.0, attn: str = "oscar"):
    """Tiny Qwen2 (k_proj has a bias) whose key bias is large: a big per-channel key mean, as in Qwen2.5."""
    model = tiny_model("qwen2", attn=attn)
    torch.manual_seed(1)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.k_proj.bias.copy_(offset * torch.randn_like(layer.self_attn.k_proj.bias))
    return model


def random_means(model, scale: float = 5.0):
    g = model_geometry(model.config)
    torch.manual_seed(2)
    return {i: scale * torch.randn(g.num_key_value_heads, g.head_dim) for i in g.oscar_layers}


def centered_data_free(model, means=None, kind="hadamard"):
    r = OscarRotations.data_free(model.config, kind)
    return OscarRotations(r.geometry, r.key_rotations, r.value_rotations, metadata=r.metadata,
                          key_means=means if means is not None else random_means(model))


def logits_through(model, cache, ids, schedule=(40, 16, 1, 1, 1)):
    out, pos = [], 0
    for n in schedule:
        out.append(model(input_ids=ids[:, pos : pos + n], cache=cache, use_cache=True).logits)
        pos += n
    return torch.cat(out, dim=1)


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text(TEXT)
    return path


# ----------------------------------------------------------------------------------------------- calibration
def test_calibrated_means_are_the_true_key_means(text_file):
    model = biased_model(attn="sdpa")
    calibration = CALIBRATION.replace(center_keys=True)
    rot = calibrate(model, char_tokenizer(), data=str(text_file), config=LAYOUT, calibration=calibration,
                    progress=False)
    assert rot.center_keys
    # Direct computation: capture the same calibration sequences' keys and average them.
    from oscar_hf.calibrate import calibration_sequences

    sequences, _, _ = calibration_sequences(char_tokenizer(), calibration, str(text_file))
    geometry = model_geometry(model.config)
    keys: dict[int, list] = {}

    class Keep(StatisticsCollector):
        def observe(self, layer_idx, query, key, value, attention_mask, scale):
            keys.setdefault(layer_idx, []).append(key[0].double())  # [H, T, d]

    with capturing(model, Keep(geometry)), torch.no_grad():
        for ids in sequences:
            model(input_ids=ids.unsqueeze(0), use_cache=False)
    for layer in geometry.oscar_layers:
        expected = torch.cat(keys[layer], dim=1).mean(1)
        assert rot.key_means[layer].shape == (2, 16)
        torch.testing.assert_close(rot.key_means[layer].double(), expected, atol=1e-5, rtol=1e-5)
    # Value clips do not see μ (same probabilities); the query-target rotations do not either.
    plain = calibrate(model, char_tokenizer(), data=str(text_file), config=LAYOUT, calibration=CALIBRATION,
                      progress=False, statistics=rot.statistics)
    assert plain.key_means is None and plain.value_clips == rot.value_clips
    for layer in geometry.oscar_layers:
        torch.testing.assert_close(plain.key_rotations[layer], rot.key_rotations[layer])


def test_calibration_without_centering_has_no_means(text_file):
    model = tiny_model("llama", attn="sdpa")
    rot = calibrate(model, char_tokenizer(), data=str(text_file), config=LAYOUT, calibration=CALIBRATION,
                    progress=False)
    assert rot.key_means is None and not rot.center_keys


# ----------------------------------------------------------------------------------------------- files
def test_file_round_trip_with_means(tmp_path):
    model = tiny_model("llama")
    rot = centered_data_free(model)
    rot.save_pretrained(tmp_path)
    meta = json.loads((tmp_path / CONFIG_NAME).read_text())
    assert meta["center_keys"] is True and meta["format_version"] == FORMAT_VERSION
    loaded = OscarRotations.from_pretrained(tmp_path)
    assert loaded.center_keys and set(loaded.key_means) == set(rot.key_means)
    for layer, mean in rot.key_means.items():
        torch.testing.assert_close(loaded.key_means[layer], mean)


def test_old_format_file_loads_without_means_in_its_token_wise_layout(tmp_path):
    model = tiny_model("llama")
    OscarRotations.data_free(model.config).save_pretrained(tmp_path)
    meta = json.loads((tmp_path / CONFIG_NAME).read_text())
    assert meta["format_version"] == FORMAT_VERSION and meta["layout"]["key_granularity"] == "channel"
    del meta["center_keys"], meta["layout"]  # exactly what the first oscar-hf release wrote
    meta["format_version"] = 1
    layers = [str(i) for i in model_geometry(model.config).oscar_layers]
    meta["clip"] = {"key": {i: 0.9 for i in layers}, "value": {i: 0.92 for i in layers}}
    (tmp_path / CONFIG_NAME).write_text(json.dumps(meta))
    loaded = OscarRotations.from_pretrained(tmp_path)
    assert loaded.key_means is None and not loaded.center_keys
    assert loaded.layout == {"key_granularity": "token", "demotion_block": 8, "key_block": 8,
                             "key_block_allocation": "uniform"}  # what it was calibrated for
    cache = OscarCache(model, loaded, None)
    assert cache.oscar_config.key_granularity == "token" and cache.oscar_config.demotion_block == 8


def _edit(tmp_path, model, edit_json=None, edit_tensors=None):
    rewrite_rotation_file(tmp_path, centered_data_free(model), edit_json, edit_tensors)


def test_mean_shape_mismatch_names_field_and_values(tmp_path):
    model = tiny_model("llama")

    def shrink(t):
        t["layers.1.key_mean"] = t["layers.1.key_mean"][:, :8].contiguous()

    _edit(tmp_path, model, edit_tensors=shrink)
    with pytest.raises(RotationFileError, match=r"layers\.1\.key_mean has shape \(2, 8\), expected \(2, 16\)"):
        OscarRotations.from_pretrained(tmp_path)
    g = model_geometry(model.config)
    with pytest.raises(RotationFileError, match="key_mean has shape"):
        centered_data_free(model, {i: torch.zeros(3, 16) for i in g.oscar_layers})


def test_nan_mean_and_inconsistent_files_are_rejected(tmp_path):
    model = tiny_model("llama")

    def poison(t):
        t["layers.0.key_mean"][0, 0] = float("nan")

    _edit(tmp_path / "a", model, edit_tensors=poison)
    with pytest.raises(RotationFileError, match=r"layers\.0\.key_mean contains NaN"):
        OscarRotations.from_pretrained(tmp_path / "a")

    def drop(t):
        for k in [k for k in t if k.endswith("key_mean")]:
            del t[k]

    _edit(tmp_path / "b", model, edit_tensors=drop)
    with pytest.raises(RotationFileError, match="center_keys=true"):
        OscarRotations.from_pretrained(tmp_path / "b")


def test_the_cache_centers_exactly_when_the_rotations_carry_means():
    model = tiny_model("llama")
    config = OscarConfig(key_clip="none", value_clip="none")
    ids = torch.randint(4, 100, (1, 9), generator=torch.Generator().manual_seed(0))
    for rotations, centered in ((OscarRotations.data_free(model.config), False), (centered_data_free(model), True)):
        cache = OscarCache(model, rotations, config)
        model(input_ids=ids, cache=cache)
        assert (cache.layers[0].key_mean is not None) == centered


# ----------------------------------------------------------------------------------------------- cache
@pytest.mark.parametrize("attn", ["oscar", "sdpa"])
@pytest.mark.parametrize("config", [
    OscarConfig(bits=16, sink_tokens=4, window_tokens=8, key_clip="none", value_clip="none"),
    OscarConfig(bits=2, sink_tokens=0, window_tokens=256, key_clip="none", value_clip="none"),
], ids=["bits16", "window-covers"])
def test_centered_cache_matches_dynamic_cache(attn, config):
    model = biased_model(attn=attn)
    ids = torch.randint(4, 100, (2, 59), generator=torch.Generator().manual_seed(0))
    rotations = centered_data_free(model)
    reference = logits_through(model, DynamicCache(config=model.config), ids)
    cache = OscarCache(model, rotations, config)
    got = logits_through(model, cache, ids)
    torch.testing.assert_close(got, reference, atol=2e-4, rtol=2e-4)
    # The cache really stores (k − μ)·R (nothing of layer 0 is quantized in either config).
    dyn = DynamicCache(config=model.config)
    model(input_ids=ids, cache=dyn, use_cache=True)
    stored, _ = cache.layers[0].stored_states()
    mu = rotations.key_means[0][None, :, None, :]
    torch.testing.assert_close(stored, torch.matmul(dyn.layers[0].keys - mu, rotations.key_rotations[0]),
                               atol=1e-4, rtol=1e-4)
    # Greedy generation is token-identical.
    prompt = ids[:1, :30]
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12, do_sample=False,
                         cache=OscarCache(model, rotations, config), pad_token_id=0)
    ref = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12, do_sample=False,
                         pad_token_id=0)
    assert out.tolist() == ref.tolist()


def test_sliding_window_layers_are_untouched():
    model = tiny_model("gemma3")
    ids = torch.randint(4, 100, (1, 40), generator=torch.Generator().manual_seed(0))
    config = OscarConfig(bits=16, sink_tokens=4, window_tokens=8, key_clip="none", value_clip="none")
    cache = OscarCache(model, centered_data_free(model), config)
    dyn = DynamicCache(config=model.config)
    model(input_ids=ids, cache=cache, use_cache=True)
    model(input_ids=ids, cache=dyn, use_cache=True)
    sliding = [i for i, kind in enumerate(model_geometry(model.config).plan) if kind != "oscar"]
    assert sliding
    for i in sliding:
        torch.testing.assert_close(cache.layers[i].keys, dyn.layers[i].keys)


def test_centered_int2_cache_is_closer_to_bf16():
    """Tiny Qwen2 with a large k_proj bias, INT2 everywhere (no sink / window): centered beats plain."""
    model = biased_model(offset=10.0)
    ids = torch.randint(4, 100, (1, 80), generator=torch.Generator().manual_seed(0))
    # centering is a lever of token-wise keys (channel-wise keys absorb any per-channel offset by themselves)
    config = OscarConfig(sink_tokens=0, window_tokens=0, key_clip="none", value_clip="none", key_granularity="token",
                         demotion_block=8)
    schedule = (48, 16, 16)
    reference = logits_through(model, DynamicCache(config=model.config), ids, schedule)[:, 48:]
    dyn = DynamicCache(config=model.config)
    model(input_ids=ids[:, :48], cache=dyn, use_cache=True)
    means = {i: dyn.layers[i].keys[0].float().mean(1) for i in model_geometry(model.config).oscar_layers}
    plain = logits_through(model, OscarCache(model, OscarRotations.data_free(model.config), config), ids, schedule)
    centered = logits_through(model, OscarCache(model, centered_data_free(model, means), config), ids, schedule)
    err_plain = (plain[:, 48:] - reference).square().sum() / reference.square().sum()
    err_centered = (centered[:, 48:] - reference).square().sum() / reference.square().sum()
    assert err_centered < 0.5 * err_plain, (err_plain, err_centered)
