import pytest
import torch
from transformers import DynamicCache

import oscar_hf.attention as attention
from conftest import VOCAB, tiny_model
from oscar_hf import OscarCache, OscarConfig, OscarRotations
from oscar_hf.attention import merge_attention_states, partial_attention

SMALL = dict(sink_tokens=4, window_tokens=8, demotion_block=4)


def _reference(q, k, v, scale, mask):
    s = (q.double() @ k.double().transpose(-1, -2)) * scale
    s = s.masked_fill(~mask, float("-inf"))
    return torch.softmax(s, -1) @ v.double()


def test_log_sum_exp_merge_equals_attention_over_the_union():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 5, 8, generator=g) for _ in range(3))
    k, v = torch.randn(2, 3, 30, 8, generator=g), torch.randn(2, 3, 30, 8, generator=g)
    mask = torch.rand(2, 1, 5, 30, generator=g) > 0.3
    mask[0, 0, 2] = False  # a query row with no visible key
    mask[:, :, :, 10:14] = False  # a fully masked segment
    parts = [partial_attention(q, k[:, :, a:b], v[:, :, a:b], 0.3, mask[..., a:b]) for a, b in [(0, 10), (10, 14), (14, 30)]]
    out, lse = merge_attention_states([p[0] for p in parts], [p[1] for p in parts])
    ref = _reference(q, k, v, 0.3, mask)
    ok = mask.any(-1).expand(2, 3, 5)
    assert torch.allclose(out[ok].double(), ref[ok], atol=1e-5)
    assert (out[~ok] == 0).all() and torch.isinf(lse[~ok]).all()
    full = torch.logsumexp(((q @ k.transpose(-1, -2)) * 0.3).masked_fill(~mask, float("-inf")), -1)
    assert torch.allclose(lse[ok], full[ok], atol=1e-5)


def _chunks(model, ids, cache, sizes):
    logits, start = [], 0
    for n in sizes:
        logits.append(model(input_ids=ids[:, start : start + n], past_key_values=cache, use_cache=True).logits)
        start += n
    return torch.cat(logits, 1)


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
def test_oscar_attention_and_plain_sdpa_give_the_same_logits(family):
    """The fused path (segments + LSE merge) and the fallback (dequantize + un-rotate in update, then sdpa)."""
    ids = torch.randint(3, VOCAB, (2, 70), generator=torch.Generator().manual_seed(1))
    sizes = [40, 1, 1, 20, 1, 3, 4]  # prefill, decode steps, a long chunk (> DECODE_MAX_QUERIES), short chunks
    results = {}
    for attn in ("oscar", "sdpa"):
        model = tiny_model(family, attn=attn)
        rot = OscarRotations.data_free(model, "hadamard")
        cache = OscarCache(model, rot, OscarConfig(key_clip=0.9, value_clip="none", **SMALL))
        results[attn] = _chunks(model, ids, cache, sizes)
    assert torch.allclose(results["oscar"], results["sdpa"], atol=2e-4, rtol=1e-4)


def test_decode_path_and_prefill_path_agree(monkeypatch):
    model = tiny_model("llama")
    ids = torch.randint(3, VOCAB, (1, 60), generator=torch.Generator().manual_seed(2))
    rot = OscarRotations.data_free(model, "hadamard")
    out = {}
    for threshold in (0, 100):
        monkeypatch.setattr(attention, "DECODE_MAX_QUERIES", threshold)
        cache = OscarCache(model, rot, OscarConfig(key_clip="none", value_clip="none", **SMALL))
        out[threshold] = _chunks(model, ids, cache, [30, 5, 1, 12, 12])
    assert torch.allclose(out[0], out[100], atol=1e-4)


def test_quantization_really_changes_the_logits():
    model = tiny_model("llama")
    ids = torch.randint(3, VOCAB, (1, 60), generator=torch.Generator().manual_seed(3))
    rot = OscarRotations.data_free(model, "identity")
    exact = _chunks(model, ids, DynamicCache(config=model.config), [40, 20])
    quant = _chunks(model, ids, OscarCache(model, rot, OscarConfig(key_clip="none", value_clip="none", **SMALL)), [40, 20])
    assert torch.allclose(exact[:, :40], quant[:, :40], atol=1e-4)  # the prefill attends to itself exactly
    assert (exact[:, 40:] - quant[:, 40:]).abs().max() > 1e-2  # later chunks see the INT2 history


def test_without_an_oscar_cache_the_oscar_attention_is_sdpa():
    ids = torch.randint(3, VOCAB, (1, 30), generator=torch.Generator().manual_seed(4))
    a = tiny_model("qwen3", attn="oscar")(input_ids=ids).logits
    b = tiny_model("qwen3", attn="sdpa")(input_ids=ids).logits
    assert torch.equal(a, b)


def test_left_padding_matches_the_unpadded_sequence():
    model = tiny_model("llama")
    rot = OscarRotations.data_free(model, "hadamard")
    config = OscarConfig(bits=16, key_clip="none", value_clip="none", **SMALL)
    long = torch.randint(3, VOCAB, (1, 40), generator=torch.Generator().manual_seed(5))
    short = long[:, 10:]
    padded = torch.cat([torch.zeros(1, 10, dtype=torch.long), short], 1)
    batch = torch.cat([long, padded])
    mask = torch.ones_like(batch)
    mask[1, :10] = 0
    cache = OscarCache(model, rot, config)
    out = model(input_ids=batch, attention_mask=mask, past_key_values=cache).logits
    nxt = torch.tensor([[5], [7]])
    mask = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1)
    step = model(input_ids=nxt, attention_mask=mask, past_key_values=cache).logits
    alone = OscarCache(model, rot, config)
    ref = model(input_ids=short, past_key_values=alone).logits
    ref_step = model(input_ids=nxt[1:], past_key_values=alone).logits
    assert torch.allclose(out[1, 10:], ref[0], atol=1e-4)
    assert torch.allclose(step[1], ref_step[0], atol=1e-4)
