"""KIVI-2 baseline cache: storage layout, honest bits, the transformers Cache contract, generate()."""

import pytest
import torch
from transformers import DynamicCache

from conftest import tiny_model
from oscar_hf.evaluation.kivi import KiviCache, KiviConfig, KiviLayer


def _states(t, h=2, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, h, t, d, generator=g), torch.randn(1, h, t, d, generator=g)


def test_prefill_keeps_kivi_residuals_and_returns_exact_states():
    layer = KiviLayer(KiviConfig(bits=2, group_size=8, residual=32))
    k, v = _states(100)
    keys, values = layer.update(k, v)
    assert torch.equal(keys, k) and torch.equal(values, v)  # the prefill attends exactly
    # keys: floor(100 / 32) * 32 = 96 quantized, 4 in full precision; values: the last 32 in full precision
    assert layer.quantized_keys == 96 and layer.key_residual.shape[2] == 4
    assert layer.quantized_values == 68 and layer.value_residual.shape[2] == 32
    assert layer.get_seq_length() == 100 and layer.get_mask_sizes(3) == (103, 0)


def test_decode_flushes_keys_every_residual_tokens_and_values_token_by_token():
    layer = KiviLayer(KiviConfig(bits=2, group_size=8, residual=32))
    k, v = _states(64)
    layer.update(k[:, :, :40], v[:, :, :40])
    for t in range(40, 64):
        past_k, past_v = layer.update(k[:, :, t : t + 1], v[:, :, t : t + 1])
        assert past_k.shape[2] == t + 1
        assert torch.equal(past_k[:, :, -1:], k[:, :, t : t + 1])
    assert layer.quantized_keys == 64 and layer.key_residual.shape[2] == 0  # 8 + 24 = 32 -> flushed
    assert layer.quantized_values == 32 and layer.value_residual.shape[2] == 32
    keys, values = layer.update(k[:, :, :0], v[:, :, :0])
    # the full-precision value window is exact, the quantized part is close but not exact
    assert torch.equal(values[:, :, 32:], v[:, :, 32:])
    rel = lambda a, b: float((a - b).square().sum() / b.square().sum())  # noqa: E731
    assert 0 < rel(keys, k) < 0.2 and 0 < rel(values[:, :, :32], v[:, :, :32]) < 0.2


def test_keys_are_quantized_per_channel_values_per_token():
    # a channel with a huge constant offset: per-channel key quantization absorbs it, per-token would not
    layer = KiviLayer(KiviConfig(bits=2, group_size=8, residual=8))
    k, v = _states(64)
    k[..., 3] += 100.0
    layer.update(k, v)
    keys, _ = layer.update(k[:, :, :0], v[:, :, :0])
    err_other = (keys - k)[..., [0, 1, 2, 4]].abs().max()
    assert err_other < 2.0  # the offset channel did not blow up the other channels' scales
    assert layer.key_meta.shape[-3:] == (16, 1, 2)  # one (scale, min) per channel per block of 8 tokens


def test_bits_per_element_are_counted_from_the_stored_tensors():
    d, t = 64, 4096 + 100
    cache_layer = KiviLayer(KiviConfig(bits=2, group_size=32, residual=128))
    k, v = _states(t, h=1, d=d)
    cache_layer.update(k.bfloat16(), v.bfloat16())
    m = cache_layer.memory_bytes()
    bits = 8 * m["allocated"] / m["elements"]
    # 3 bits per quantized element (2 + 32/32 for keys and for values), 16 per full-precision one:
    # keys 4096 quantized + 100 residual, values 4068 quantized + the last 128
    expected = ((4096 * 3 + 100 * 16) + (4068 * 3 + 128 * 16)) / (2 * t)
    assert bits == pytest.approx(expected, rel=1e-6)
    assert KiviConfig(2, 32, 128).history_bits_per_element(64) == 3.0
    assert KiviConfig(2, 64, 128).history_bits_per_element(64) == 2.5


def test_config_and_crop_refusals():
    with pytest.raises(ValueError, match="multiple of group_size"):
        KiviConfig(group_size=48, residual=128)
    layer = KiviLayer(KiviConfig(bits=2, group_size=8, residual=16))
    k, v = _states(40)
    layer.update(k, v)
    layer.crop(-4)  # within the full-precision residual (8 key tokens there)
    assert layer.get_seq_length() == 36
    with pytest.raises(ValueError, match="full-precision"):
        layer.crop(-20)


def test_batch_operations_apply_to_every_segment():
    layer = KiviLayer(KiviConfig(bits=2, group_size=8, residual=16))
    k = torch.randn(2, 2, 40, 16)
    v = torch.randn(2, 2, 40, 16)
    layer.update(k, v)
    before = layer.update(k[:, :, :0], v[:, :, :0])[0]
    layer.reorder_cache(torch.tensor([1, 0]))
    after = layer.update(k[:, :, :0], v[:, :, :0])[0]
    assert torch.equal(after[0], before[1]) and torch.equal(after[1], before[0])
    layer.batch_repeat_interleave(2)
    assert layer.update(k[:1, :, :0].expand(4, -1, -1, -1), v[:1, :, :0].expand(4, -1, -1, -1))[0].shape[0] == 4
    layer.batch_select_indices(torch.tensor([0, 3]))
    assert layer.key_codes.shape[0] == 2 and layer.value_residual.shape[0] == 2


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_generate_with_kivi_cache(family):
    model = tiny_model(family, attn="sdpa")
    ids = torch.randint(4, 100, (1, 90))
    kivi = model.generate(ids, max_new_tokens=40, do_sample=False, past_key_values=KiviCache(model, KiviConfig(2, 8, 16)))
    assert kivi.shape == (1, 130)
    # with a residual longer than the whole sequence nothing is quantized: identical to DynamicCache
    exact = model.generate(ids, max_new_tokens=20, do_sample=False, past_key_values=KiviCache(model, KiviConfig(2, 32, 256)))
    ref = model.generate(ids, max_new_tokens=20, do_sample=False, past_key_values=DynamicCache(config=model.config))
    assert torch.equal(exact, ref)
