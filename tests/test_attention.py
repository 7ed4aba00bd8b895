import pytest
import torch
from transformers import DynamicCache

from conftest import VOCAB, tiny_model
from oscar_hf import OscarCache, OscarConfig, OscarRotations
from oscar_hf.attention import key_padding_mask
from oscar_hf.ops import segment_attention_reference
from oscar_hf.quant import KeyBlockLayout, dequantize, dequantize_rows, quantize_key_chunks, quantize_rows, wide_rows

SMALL = dict(sink_tokens=4, window_tokens=8, demotion_block=4, key_block=4)  # key blocks as before: one per demotion


def _masked_attention(q, k, v, scale, mask):
    """float64 reference: softmax(q kᵀ·scale, masked) v and its log-sum-exp; empty rows -> 0, -inf."""
    s = (q.double() @ k.double().transpose(-1, -2)) * scale
    s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)).unsqueeze(-1))
    return p @ v.double(), lse


def random_segments(b=2, h=2, g=3, t=4, d=64, ns=5, nh=37, nr=11, ne=0, groups=1, dtype=torch.float32, seed=0, mask=True,
                    key_blocks=(), key_chunk=0, head_bits=None):
    """Random inputs for `segment_attention` plus the dense float64 picture of the same keys/values. With `key_chunk`,
    keys are channel-wise, KV head h over blocks of `key_blocks[h]` tokens (an int: the same for every head) in
    chunks of `key_chunk` (`quant.KeyBlockLayout`; nh a multiple of the chunk, one spare chunk of capacity), each
    channel with its own offset and spread (as post-RoPE keys have). `head_bits`: the heads at 4 bits (wide)."""
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    q = rnd(b, h, g * t, d).to(dtype)
    sink_k, sink_v = rnd(b, h, ns + 3, d).to(dtype), rnd(b, h, ns + 3, d).to(dtype)
    wide = wide_rows(head_bits) if head_bits else ()
    hv = quantize_rows(rnd(b, h, nh + 2, d), 2, d // groups, wide=wide)
    if key_chunk:
        key_blocks = (key_blocks,) * h if isinstance(key_blocks, int) else tuple(key_blocks)
        raw = rnd(b, h, nh + key_chunk, d) * rnd(1, 1, 1, d).exp() + 3 * rnd(1, 1, 1, d)
        hk = quantize_key_chunks(raw, 2, KeyBlockLayout(key_blocks, key_chunk), wide=wide)
    else:
        key_blocks = ()
        hk = quantize_rows(rnd(b, h, nh + 2, d) * 2, 2, d // groups)
    rec_k, rec_v = rnd(b, h, nr + 1, d).to(dtype), rnd(b, h, nr + 1, d).to(dtype)
    ext_k, ext_v = rnd(b, h, ne, d).to(dtype), rnd(b, h, ne, d).to(dtype)
    n = ns + nh + nr + ne
    key_mask = None
    if mask:
        key_mask = torch.ones(b, n, dtype=torch.bool)
        key_mask[0, :7] = False  # left padding of row 0
    args = (q, sink_k, sink_v, hk.codes, hk.meta, hv.codes, hv.meta, rec_k, rec_v, ext_k, ext_v, key_mask, ns, nh, nr, ne, t,
            n - t, d ** -0.5, list(key_blocks), key_chunk, list(wide))
    keys = torch.cat([sink_k[:, :, :ns].float(), dequantize(hk)[:, :, :nh], rec_k[:, :, :nr].float(), ext_k.float()], 2)
    values = torch.cat([sink_v[:, :, :ns].float(), dequantize_rows(hv)[:, :, :nh], rec_v[:, :, :nr].float(), ext_v.float()], 2)
    qpos = (n - t) + torch.arange(g * t) % t
    visible = (torch.arange(n)[None, :] <= qpos[:, None])[None, None]
    if key_mask is not None:
        visible = visible & key_mask[:, None, None, :]
    return args, _masked_attention(q, keys, values, d ** -0.5, visible)


@pytest.mark.parametrize("case", [dict(), dict(t=1, g=4), dict(ne=9, nr=6), dict(groups=2), dict(groups=4, mask=False), dict(nh=0),
                                  dict(nh=32, key_blocks=16, key_chunk=16),
                                  dict(t=1, g=4, nh=64, key_blocks=32, key_chunk=32, groups=2),
                                  dict(t=1, g=4, nh=128, key_blocks=(16, 64), key_chunk=64),  # per-head blocks
                                  dict(h=4, nh=64, key_blocks=(32, 8, 16, 32), key_chunk=32, groups=2),
                                  dict(h=3, nh=64, key_blocks=(16, 32, 32), key_chunk=32, head_bits=(4, 2, 4))])
def test_segment_attention_reference_matches_dense_attention(case):
    args, (ref, ref_lse) = random_segments(**case)
    out, lse = segment_attention_reference(*args)
    assert torch.allclose(out.double(), ref, atol=1e-5)
    assert torch.allclose(lse.double(), ref_lse, atol=1e-5)


def test_key_padding_mask_from_4d_masks():
    m = torch.ones(2, 1, 3, 6, dtype=torch.bool).tril(3)
    m[1, :, :, :2] = False
    assert key_padding_mask(m).tolist() == [[True] * 6, [False, False, True, True, True, True]]
    additive = torch.zeros(2, 1, 3, 6).masked_fill(~m, torch.finfo(torch.float32).min)
    assert torch.equal(key_padding_mask(additive), key_padding_mask(m))
    assert key_padding_mask(None) is None


def _chunks(model, ids, cache, sizes):
    logits, start = [], 0
    for n in sizes:
        logits.append(model(input_ids=ids[:, start : start + n], past_key_values=cache, use_cache=True).logits)
        start += n
    return torch.cat(logits, 1)


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
def test_oscar_attention_and_plain_sdpa_give_the_same_logits(family):
    """The fused path (segments, LSE merge) and the fallback (dequantize + un-rotate in update, then sdpa)."""
    ids = torch.randint(3, VOCAB, (2, 70), generator=torch.Generator().manual_seed(1))
    sizes = [40, 1, 1, 20, 1, 3, 4]  # prefill, decode steps, a chunk longer than the window, short chunks
    results = {}
    for attn in ("oscar", "sdpa"):
        model = tiny_model(family, attn=attn)
        rot = OscarRotations.data_free(model, "hadamard")
        cache = OscarCache(model, rot, OscarConfig(key_clip=0.9, value_clip="none", **SMALL))
        results[attn] = _chunks(model, ids, cache, sizes)
    assert torch.allclose(results["oscar"], results["sdpa"], atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("bits", [2, 4, 16])
def test_every_width_takes_the_same_path_as_the_fallback(bits):
    ids = torch.randint(3, VOCAB, (1, 50), generator=torch.Generator().manual_seed(6))
    out = {}
    for attn in ("oscar", "sdpa"):
        model = tiny_model("llama", attn=attn)
        cache = OscarCache(model, OscarRotations.data_free(model, "hadamard"),
                           OscarConfig(bits=bits, key_clip="none", value_clip="none", **SMALL))
        out[attn] = _chunks(model, ids, cache, [30, 1, 12, 7])
    assert torch.allclose(out["oscar"], out["sdpa"], atol=2e-4, rtol=1e-4)


def test_quantization_really_changes_the_logits():
    model = tiny_model("llama")
    ids = torch.randint(3, VOCAB, (1, 60), generator=torch.Generator().manual_seed(3))
    rot = OscarRotations.data_free(model, "identity")
    exact = _chunks(model, ids, DynamicCache(config=model.config), [40, 20])
    quant = _chunks(model, ids, OscarCache(model, rot, OscarConfig(key_clip="none", value_clip="none", **SMALL)), [40, 20])
    assert torch.equal(exact[:, :40], quant[:, :40])  # a first prefill is exactly sdpa
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


def test_long_chunks_in_query_blocks_match_one_block(monkeypatch):
    import oscar_hf.attention as attention

    model = tiny_model("llama")
    ids = torch.randint(3, VOCAB, (2, 60), generator=torch.Generator().manual_seed(8))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    out = {}
    for block in (7, 4096):
        monkeypatch.setattr(attention, "QUERY_BLOCK", block)
        cache = OscarCache(model, OscarRotations.data_free(model, "hadamard"), OscarConfig(key_clip="none", value_clip="none", **SMALL))
        out[block] = torch.cat([model(input_ids=ids[:, a:b], attention_mask=mask[:, :b], past_key_values=cache).logits
                                for a, b in [(0, 20), (20, 50), (50, 60)]], 1)
    assert torch.allclose(out[7], out[4096], atol=1e-5)


class _CloningCache(OscarCache):
    """Hands attention copies of the states update returned, like models that touch key_states after update (JetMoE
    repeats them): the handoff must not depend on tensor identity."""

    def update(self, *args, **kwargs):
        k, v = super().update(*args, **kwargs)
        return k.clone(), v.clone()


def test_the_handoff_survives_models_that_replace_the_key_tensor():
    model = tiny_model("llama")
    ids = torch.randint(3, VOCAB, (1, 40), generator=torch.Generator().manual_seed(2))
    rotations = OscarRotations.data_free(model, "hadamard")
    logits = []
    for cls in (OscarCache, _CloningCache):
        cache = cls(model, rotations, OscarConfig(value_clip="none", **SMALL))
        model(input_ids=ids[:, :30], past_key_values=cache)
        logits.append(model(input_ids=ids[:, 30:], past_key_values=cache).logits)
    assert torch.equal(logits[0], logits[1])


def test_a_view_that_does_not_fit_its_attention_call_raises():
    from oscar_hf.attention import oscar_attention_forward
    from oscar_hf.cache import VIEW_KWARG

    model = tiny_model("llama")
    cache = OscarCache(model, OscarRotations.data_free(model, "hadamard"), OscarConfig(value_clip="none", **SMALL))
    model(input_ids=torch.randint(3, VOCAB, (1, 20)), past_key_values=cache)
    layer = cache.layers[0]
    k = torch.randn(1, 2, 3, 16)
    layer.update(k, k, fused=True, attention_kwargs={})
    attn = model.model.layers[0].self_attn
    with pytest.raises(RuntimeError, match="do not belong together"):
        oscar_attention_forward(attn, torch.randn(1, 4, 1, 16), k, k, None, **{VIEW_KWARG: layer})


def test_long_chunks_in_query_blocks_equal_one_block(monkeypatch):
    from oscar_hf import attention

    model = tiny_model("llama")
    ids = torch.randint(3, VOCAB, (1, 70), generator=torch.Generator().manual_seed(3))
    rotations = OscarRotations.data_free(model, "hadamard")
    logits = []
    for block in (4096, 16):
        monkeypatch.setattr(attention, "QUERY_BLOCK", block)
        cache = OscarCache(model, rotations, OscarConfig(value_clip="none", **SMALL))
        model(input_ids=ids[:, :30], past_key_values=cache)
        logits.append(model(input_ids=ids[:, 30:], past_key_values=cache).logits)  # 40 queries: 3 blocks of 16
    torch.testing.assert_close(logits[0], logits[1], atol=1e-5, rtol=1e-5)
