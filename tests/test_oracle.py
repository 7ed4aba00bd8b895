"""OscarCache against an independent oracle: plain eager attention over keys/values that an oracle cache, written here
from the specification alone, has replaced by their quantized versions.

The specification: with sink S, window W and block B, the history holds the tokens [S, S + h) and grows by whole
blocks of the window's overflow, h ← h + floor((n − S − h − W) / B)·B (never shrinking unless cropped; a crop drops the
cropped tokens, and a cut channel-wise key block as below); a token entering the history is
rotated (k·R_K, v·R_V) and quantized — keys channel-wise over its block of B tokens (or token-wise), values
token-wise after the clip — and keeps that stored value from then on (a crop that cuts a key block puts the block's
surviving tokens back in full precision at their stored value; they are quantized again with their next block). A
forward pass sees its own tokens exactly and earlier tokens as stored. Nothing here uses the cache's segments,
views or kernels: the only shared code is the quantizer of `quant.py` (tested on its own in test_quant.py).
"""

import pytest
import torch
from transformers import DynamicCache

from conftest import VOCAB, tiny_model
from oscar_hf import OscarCache, OscarConfig, OscarRotations
from oscar_hf.quant import fake_quantize, fake_quantize_channels

CONFIG = OscarConfig(sink_tokens=4, window_tokens=8, demotion_block=4, key_block=4, key_clip="none", value_clip=0.9)


class OracleLayer:
    """One layer of the oracle: every token's stored (rotated) key/value, and how many are in the history."""

    def __init__(self, rk, rv, config):
        self.rk, self.rv, self.cfg = rk, rv, config
        self.keys = self.values = None  # rotated, [B, H, n, d]
        self.h = 0
        self.record = False

    def _demote(self):
        cfg, n = self.cfg, self.keys.shape[2]
        if self.record:
            return
        overflow = max(n - cfg.sink_tokens - self.h - cfg.window_tokens, 0)  # window tokens beyond W
        target = self.h + overflow // cfg.demotion_block * cfg.demotion_block
        a, b = cfg.sink_tokens + self.h, cfg.sink_tokens + target
        if b > a:
            if cfg.key_granularity == "channel":
                self.keys[:, :, a:b] = fake_quantize_channels(self.keys[:, :, a:b], 2, cfg.demotion_block)
            else:
                self.keys[:, :, a:b] = fake_quantize(self.keys[:, :, a:b], 2, self.keys.shape[-1], 1.0)
            self.values[:, :, a:b] = fake_quantize(self.values[:, :, a:b], 2, self.values.shape[-1], cfg.value_clip)
        self.h = target

    def update(self, k, v):
        kr, vr = k @ self.rk, v @ self.rv
        past = 0 if self.keys is None else self.keys.shape[2]
        self.keys = kr.clone() if self.keys is None else torch.cat([self.keys, kr], 2)
        self.values = vr.clone() if self.values is None else torch.cat([self.values, vr], 2)
        self._demote()
        seen_k = torch.cat([self.keys[:, :, :past], kr], 2)  # earlier tokens as stored, this pass exactly
        seen_v = torch.cat([self.values[:, :, :past], vr], 2)
        return seen_k @ self.rk.transpose(-1, -2), seen_v @ self.rv.transpose(-1, -2)

    def crop(self, remove):
        n = self.keys.shape[2] - remove
        self.keys, self.values = self.keys[:, :, :n], self.values[:, :, :n]
        if self.cfg.sink_tokens + self.h > n:
            self.h = max(n - self.cfg.sink_tokens, 0)
            if self.cfg.key_granularity == "channel":  # a cut key block goes back to full precision, as stored
                self.h = self.h // self.cfg.demotion_block * self.cfg.demotion_block
        self._demote()

    def reorder(self, beam_idx):
        self.keys, self.values = self.keys[beam_idx], self.values[beam_idx]


class OracleCache(DynamicCache):
    def __init__(self, model, rotations, config):
        super().__init__(config=model.config)
        self.oracle = [OracleLayer(rotations.key_rotations[i].float(), rotations.value_rotations[i].float(), config)
                       for i in range(model.config.num_hidden_layers)]

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        super().update(key_states, value_states, layer_idx)  # keeps the lengths transformers asks for
        return self.oracle[layer_idx].update(key_states, value_states)


def _models():
    fused = tiny_model("llama", attn="oscar", hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    plain = tiny_model("llama", attn="eager", hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    return fused, plain


@pytest.mark.parametrize("granularity", ["channel", "token"])
def test_oscar_cache_equals_the_oracle_through_prefill_decode_demotion_crop_and_reorder(granularity):
    config = CONFIG.replace(key_granularity=granularity)
    fused, plain = _models()
    rotations = OscarRotations.data_free(fused, "hadamard")
    ids = torch.randint(3, VOCAB, (2, 64), generator=torch.Generator().manual_seed(0))
    cache, oracle = OscarCache(fused, rotations, config), OracleCache(plain, rotations, config)

    def step(a, b):
        got = fused(input_ids=ids[:, a:b], past_key_values=cache).logits
        want = plain(input_ids=ids[:, a:b], past_key_values=oracle).logits
        err = (got - want).abs().max() / want.abs().max()
        assert err < 2e-3, (a, b, err.item())
        return got

    step(0, 23)  # prefill: sink, history (whole blocks), window
    for t in range(23, 36):  # decode across several demotions
        step(t, t + 1)
    step(36, 41)  # a short chunk onto a filled cache

    # crop into the history (the last key block is cut), then continue
    for c in (cache, ):
        c.crop(-15)
    for layer in oracle.oracle:
        layer.crop(15)
    oracle.crop(-15)
    step(26, 30)
    for t in range(30, 40):
        step(t, t + 1)

    # beam reorder: swap the two rows
    beam = torch.tensor([1, 0])
    cache.reorder_cache(beam)
    oracle.reorder_cache(beam)
    for layer in oracle.oracle:
        layer.reorder(beam)
    ids = ids[beam]
    for t in range(40, 46):
        step(t, t + 1)

    # and the storage really is 2-bit: the exact (BF16-cache) logits differ
    exact = plain(input_ids=ids[:, :46]).logits[:, -1]
    assert (exact - fused(input_ids=ids[:, 46:47], past_key_values=cache).logits[:, -1]).abs().max() > 1e-2


def test_the_oracle_itself_is_not_the_identity():
    """Guards the oracle: with quantization on, it must differ from exact attention (else the test above is empty)."""
    _, plain = _models()
    rotations = OscarRotations.data_free(plain, "hadamard")
    ids = torch.randint(3, VOCAB, (1, 40), generator=torch.Generator().manual_seed(1))
    oracle = OracleCache(plain, rotations, CONFIG)
    plain(input_ids=ids[:, :32], past_key_values=oracle)
    quantized = plain(input_ids=ids[:, 32:40], past_key_values=oracle).logits
    exact = plain(input_ids=ids).logits[:, 32:40]
    assert (quantized - exact).abs().max() > 1e-2
