"""The key-centering experiment (`oscar-hf eval centering`): `oscar_centered` is OSCAR with `center_keys=True`
calibrated through the normal path; `centering.py` adds the key diagnostic. (The feature itself: test_center_keys.py.)"""

import pytest
import torch

from conftest import char_tokenizer
from oscar_hf import OscarCache, OscarConfig
from oscar_hf.calibrate import calibrate
from oscar_hf.evaluation.centering import int2_key_error, key_diagnostic
from oscar_hf.evaluation.methods import calibration_key, centering_methods, get_method
from oscar_hf.models import model_geometry
from oscar_hf.rotation import build_rotation
from test_center_keys import TEXT, biased_model, logits_through


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


def test_registry_and_calibration_key():
    method = get_method("oscar_centered")
    assert method.center_keys and method.oscar.center_keys and method.needs_calibration
    assert "oscar_centered" in centering_methods()
    assert not get_method("oscar").center_keys
    # A separate calibration (its own rotation folder); the plain key is unchanged (existing folders stay valid).
    plain = get_method("oscar").oscar
    assert calibration_key(method.oscar) == calibration_key(plain) + ",center_keys=True"
    assert "center_keys" not in calibration_key(plain)


def test_method_calibrates_and_diagnoses(tmp_path):
    data = tmp_path / "text.txt"
    data.write_text(TEXT)
    model = biased_model()
    config = OscarConfig(calibration_tokens=512, calibration_sequence_length=256, heldout_tokens=384, sink_tokens=16,
                         window_tokens=32)
    plain = calibrate(model, char_tokenizer(), data=str(data), config=config, progress=False)
    centered = calibrate(model, char_tokenizer(), data=str(data), config=config.replace(center_keys=True),
                         progress=False, statistics=plain.statistics)
    layers = model_geometry(model.config).oscar_layers
    assert set(centered.key_means) == set(layers) and centered.key_means[layers[0]].shape == (2, 16)
    diagnostic = key_diagnostic(model, char_tokenizer(), plain, centered, config, data=str(data))
    summary = diagnostic["summary"]
    assert summary["mean_energy_ratio"]["median"] > 0.3  # the bias (what RoPE leaves of it) is a large share
    assert summary["int2_error_noclip_centered"]["max"] < summary["int2_error_noclip"]["median"]
    row = diagnostic["layers"][layers[0]]
    assert row["key_clip_centered"] == centered.key_clips[layers[0]] and row["heldout_attention_error"] is not None
    with pytest.raises(ValueError, match="center_keys=True"):
        key_diagnostic(model, char_tokenizer(), plain, plain, config, data=str(data))

    method = get_method("oscar_centered")
    cache = method.make_cache(model, centered)
    assert isinstance(cache, OscarCache) and cache.layers[layers[0]].key_mean is None  # set on first use
    with pytest.raises(ValueError, match="no key means"):
        method.make_cache(model, plain)
    ids = torch.randint(4, 100, (1, 120), generator=torch.Generator().manual_seed(0))
    logits = logits_through(model, cache, ids, (60, 30, 30))
    assert torch.isfinite(logits).all() and cache.layers[layers[0]].key_mean is not None
