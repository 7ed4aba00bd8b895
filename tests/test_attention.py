import pytest
import torch
from transformers import DynamicCache

from conftest import VOCAB, tiny_model
from oscar_hf import OscarCache, OscarConfig, OscarRotations, ops
from oscar_hf.attention import key_padding_mask
from oscar_hf.format import LayerFormat, StreamFormat, wide_rows
from oscar_hf.ops import Segments, segment_attention_reference
from oscar_hf.quant import dequantize, quantize

SMALL = dict(sink_tokens=4, window_tokens=8, demotion_block=4, key_block=4)  # key blocks as before: one per demotion


def _masked_attention(q, k, v, scale, mask):
    """float64 reference: softmax(q kᵀ·scale, masked) v and its log-sum-exp; empty rows -> 0, -inf."""
    s = (q.double() @ k.double().transpose(-1, -2)) * scale
    s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)).unsqueeze(-1))
    return p @ v.double(), lse


def random_segments(b=2, h=2, g=3, t=4, d=64, ns=5, nh=37, nr=11, ne=0, groups=1, dtype=torch.float32, seed=0, mask=True,
                    key_blocks=(), key_chunk=0, head_bits=None, wide_channels=()):
    """Random inputs of `ops.segment_attention` plus the dense float64 picture of the same keys/values.

    Returns `(args, (out, lse))`: args = (q, Segments, LayerFormat, key_mask, queries_per_group, query_start, scale)
    in `ops.segment_attention`'s order, the segments views of larger buffers (as a cache's are). With `key_chunk`,
    keys are channel-wise, KV head h over blocks of `key_blocks[h]` tokens (an int: the same for every head) in
    chunks of `key_chunk` (nh a multiple of the chunk, one spare chunk of capacity), each channel with its own offset
    and spread (as post-RoPE keys have); `wide_channels`: each head's wide key channels. `head_bits`: the heads at 4
    bits (wide)."""
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    q = rnd(b, h, g * t, d).to(dtype)
    sink_k, sink_v = rnd(b, h, ns + 3, d).to(dtype), rnd(b, h, ns + 3, d).to(dtype)
    wide = wide_rows(head_bits) if head_bits else ()
    value_fmt = StreamFormat(h, d, 2, group_size=d // groups, wide_rows=wide)
    hv = quantize(rnd(b, h, nh + 2, d), value_fmt)
    if key_chunk:
        key_blocks = (key_blocks,) * h if isinstance(key_blocks, int) else tuple(key_blocks)
        key_fmt = StreamFormat(h, d, 2, "channel", blocks=key_blocks, chunk=key_chunk, wide_rows=wide,
                               wide_channels=wide_channels)
        raw = rnd(b, h, nh + key_chunk, d) * rnd(1, 1, 1, d).exp() + 3 * rnd(1, 1, 1, d)
        hk = quantize(raw, key_fmt)
        hk = type(hk)(hk.codes[:, :, :nh], hk.meta[:, : -(-nh // key_chunk)], key_fmt)
    else:
        key_fmt = StreamFormat(h, d, 2, group_size=d // groups, wide_rows=wide)
        hk = quantize(rnd(b, h, nh + 2, d) * 2, key_fmt)
        hk = type(hk)(hk.codes[:, :, :nh], hk.meta[:, :, :nh], key_fmt)
    hv = type(hv)(hv.codes[:, :, :nh], hv.meta[:, :, :nh], value_fmt)
    rec_k, rec_v = rnd(b, h, nr + 1, d).to(dtype), rnd(b, h, nr + 1, d).to(dtype)
    ext_k, ext_v = rnd(b, h, ne, d).to(dtype), rnd(b, h, ne, d).to(dtype)
    n = ns + nh + nr + ne
    key_mask = None
    if mask:
        key_mask = torch.ones(b, n, dtype=torch.bool)
        key_mask[0, :7] = False  # left padding of row 0
    seg = Segments(sink_k[:, :, :ns], sink_v[:, :, :ns], hk, hv, rec_k[:, :, :nr], rec_v[:, :, :nr], ext_k, ext_v)
    assert seg.lengths == (ns, nh, nr, ne)
    args = (q, seg, LayerFormat(key_fmt, value_fmt), key_mask, t, n - t, d ** -0.5)
    keys = torch.cat([sink_k[:, :, :ns].float(), dequantize(hk), rec_k[:, :, :nr].float(), ext_k.float()], 2)
    values = torch.cat([sink_v[:, :, :ns].float(), dequantize(hv), rec_v[:, :, :nr].float(), ext_v.float()], 2)
    qpos = (n - t) + torch.arange(g * t) % t
    visible = (torch.arange(n)[None, :] <= qpos[:, None])[None, None]
    if key_mask is not None:
        visible = visible & key_mask[:, None, None, :]
    return args, _masked_attention(q, keys, values, d ** -0.5, visible)


def twin(args, **kwargs):
    """`segment_attention_reference` on `random_segments`' arguments (the twin reads the format from the segments)."""
    q, seg, _, key_mask, queries_per_group, query_start, scale = args
    return segment_attention_reference(q, seg, key_mask, queries_per_group, query_start, scale, **kwargs)


@pytest.mark.parametrize("case", [dict(), dict(t=1, g=4), dict(ne=9, nr=6), dict(groups=2), dict(groups=4, mask=False), dict(nh=0),
                                  dict(nh=32, key_blocks=16, key_chunk=16),
                                  dict(t=1, g=4, nh=64, key_blocks=32, key_chunk=32, groups=2),
                                  dict(t=1, g=4, nh=128, key_blocks=(16, 64), key_chunk=64),  # per-head blocks
                                  dict(h=4, nh=64, key_blocks=(32, 8, 16, 32), key_chunk=32, groups=2),
                                  dict(h=3, nh=64, key_blocks=(16, 32, 32), key_chunk=32, head_bits=(4, 2, 4)),
                                  dict(h=3, nh=64, key_blocks=(16, 32, 32), key_chunk=32, wide_channels=(5, 0, 16))])
def test_segment_attention_reference_matches_dense_attention(case):
    args, (ref, ref_lse) = random_segments(**case)
    out, lse = twin(args)
    assert torch.allclose(out.double(), ref, atol=1e-5)
    assert torch.allclose(lse.double(), ref_lse, atol=1e-5)
    # off CUDA (and without OSCAR_HF_KERNELS=1) the op is its twin
    out_op, lse_op = ops.segment_attention(*args)
    assert torch.equal(out_op, out) and torch.equal(lse_op, lse)


def test_the_bf16_emulating_twin_rounds_the_probabilities_only():
    """`emulate_bf16`: the probabilities rounded to bfloat16 before they weigh the values (the kernels' tensor-core
    dots), the log-sum-exp untouched: a small error against float64 that the tests scale their tolerances by."""
    args, (ref, ref_lse) = random_segments(t=1, g=4, nh=64, key_blocks=32, key_chunk=32)
    out, lse = twin(args, emulate_bf16=True)
    err = (out.double() - ref).abs().max().item()
    assert torch.equal(lse, twin(args)[1])
    assert 1e-5 < err < 2e-2


@pytest.mark.parametrize("case", [
    dict(),                                                               # channel-wise keys, one key block
    dict(key_blocks=(16, 64, 32), head_bits=(4, 2, 2), groups=2),          # per-head blocks, a wide head
    dict(key_blocks=(32, 32, 64), wide_channels=(5, 0, 17)),               # wide key channels
    dict(chunk=0, groups=4),                                              # token-wise keys
    dict(bits=16, chunk=0),                                               # a 16-bit history
    dict(n_hist=0, n_recent=7, ring_lo=0),                                # no history yet
    dict(mask=False),
    dict(value_rows=171),  # streams of different capacities (a layer's share one): refused
])
def test_the_host_decode_reads_the_stored_tokens_as_the_branch_free_twin_does(case):
    """Eager on the CPU, `decode_attention` reads the lengths on the host and attends to the stored tokens only:
    sink, the history's first n_hist rows, the ring's recent slots (wrapped here). Rows and slots that hold no
    stored token (filled with large values here) are never read; the branch-free twin over the whole buffers gives
    the same output."""
    case = {"key_blocks": (32, 32, 32), "chunk": 64, "bits": 2, "groups": 1, "head_bits": None, "wide_channels": (),
            "n_hist": 128, "n_recent": 20, "ring_lo": 10, "mask": True, "value_rows": None, **case}
    gen = torch.Generator().manual_seed(7)
    rnd = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    b, h, g, d, sink, ring, capacity = 2, 3, 4, 64, 4, 24, 192
    wide = wide_rows(case["head_bits"]) if case["head_bits"] else ()
    common = dict(heads=h, head_dim=d, bits=case["bits"], group_size=d // case["groups"], wide_rows=wide)
    values = StreamFormat(**common)
    keys = StreamFormat(granularity="channel", blocks=case["key_blocks"], chunk=case["chunk"],
                        wide_channels=case["wide_channels"], **common) if case["chunk"] else values
    raw = rnd(b, h, capacity, d) * rnd(1, 1, 1, d).exp() + 3 * rnd(1, 1, 1, d)
    raw[:, :, case["n_hist"]:] *= 1e4  # rows not in the history yet
    value_rows = case["value_rows"] or capacity
    hk, hv = quantize(raw.to(torch.bfloat16), keys), quantize(rnd(b, h, value_rows, d).to(torch.bfloat16), values)
    sink_k, sink_v, ring_k, ring_v = (rnd(b, h, n, d).to(torch.bfloat16) for n in (sink, sink, ring, ring))
    stored = (case["ring_lo"] + torch.arange(case["n_recent"])) % ring
    unused = torch.ones(ring, dtype=torch.bool).index_fill(0, stored, False)
    ring_k[:, :, unused], ring_v[:, :, unused] = 1e4, 1e4
    n = sink + case["n_hist"] + case["n_recent"]
    lengths = torch.tensor([sink, case["n_hist"], case["n_recent"], case["ring_lo"], n - 1], dtype=torch.int32)
    key_mask = None
    if case["mask"]:
        key_mask = torch.ones(b, sink + capacity + ring, dtype=torch.bool)
        key_mask[1, :9] = False  # a left-padded row
    rotation = torch.linalg.qr(rnd(h, d, d).double())[0].to(torch.bfloat16)
    args = (rnd(b, h, g, d).to(torch.bfloat16), ops.DecodeBuffers(sink_k, sink_v, hk.codes, hk.meta, hv.codes, hv.meta,
                                                                  ring_k, ring_v),
            LayerFormat(keys, values), key_mask, lengths, 1, d ** -0.5, rotation)
    if case["value_rows"]:
        with pytest.raises(ValueError, match="share one capacity"):
            ops.decode_attention_reference(*args)
        return
    out = ops.decode_attention(*args)
    ref = ops.decode_attention_reference(*args)
    assert torch.equal(out, ops.decode_attention_host(*args))
    assert (out.float() - ref.float()).abs().max() <= 2 ** -7 * ref.float().abs().max()  # within bf16 roundings


def test_key_padding_mask_from_4d_masks():
    m = torch.ones(2, 1, 3, 6, dtype=torch.bool).tril(3)  # three queries after three past tokens
    m[1, :, :, :2] = False
    assert key_padding_mask(m, 3).tolist() == [[True] * 6, [False, False, True, True, True, True]]
    additive = torch.zeros(2, 1, 3, 6).masked_fill(~m, torch.finfo(torch.float32).min)
    assert torch.equal(key_padding_mask(additive, 3), key_padding_mask(m, 3))
    assert key_padding_mask(None) is None
    one_row = torch.ones(2, 1, 1, 6, dtype=torch.bool)
    one_row[0, :, :, 0] = False
    assert key_padding_mask(one_row, 5).tolist() == [[False] + [True] * 5, [True] * 6]
    with pytest.raises(ValueError, match="4D"):
        key_padding_mask(m[:, 0], 3)


@pytest.mark.parametrize("kind", ["bidirectional", "shifted", "custom"])
def test_key_padding_mask_refuses_masks_that_are_not_causal_and_padding(kind, monkeypatch):
    """A multi-row mask that is not causal + padding would silently become a padding mask: it is refused, bool or
    additive (a causal mask read at the wrong query start is not causal + padding either)."""
    from oscar_hf import attention

    monkeypatch.setattr(attention, "_CHECKED_MASK", [None])  # no mask of an earlier test counts as checked
    m = torch.ones(2, 1, 3, 6, dtype=torch.bool).tril(3)
    m[1, :, :, :2] = False
    query_start = 3
    if kind == "bidirectional":
        m = m | m[:, :, -1:, :]  # every row sees the last row's keys
    elif kind == "shifted":
        query_start = 2  # the same mask, for queries at 2, 3, 4
    else:
        m[0, 0, 1, 2] = False  # one key hidden from one query that the last query sees
    additive = torch.zeros(2, 1, 3, 6).masked_fill(~m, torch.finfo(torch.float32).min)
    for mask in (m, additive):
        with pytest.raises(ValueError, match="causal \\+ padding masks only"):
            key_padding_mask(mask, query_start)


def test_a_mask_changed_in_place_after_its_check_is_checked_again(monkeypatch):
    from oscar_hf import attention

    monkeypatch.setattr(attention, "_CHECKED_MASK", [None])
    m = torch.ones(1, 1, 3, 6, dtype=torch.bool).tril(3)
    key_padding_mask(m, 3)  # causal + padding: accepted, and remembered
    key_padding_mask(m, 3)
    m[0, 0, 0, 5] = True  # now the first query sees the future
    with pytest.raises(ValueError, match="causal \\+ padding masks only"):
        key_padding_mask(m, 3)


def _chunks(model, ids, cache, sizes):
    logits, start = [], 0
    for n in sizes:
        logits.append(model(input_ids=ids[:, start : start + n], cache=cache, use_cache=True).logits)
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
    out = model(input_ids=batch, attention_mask=mask, cache=cache).logits
    nxt = torch.tensor([[5], [7]])
    mask = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1)
    step = model(input_ids=nxt, attention_mask=mask, cache=cache).logits
    alone = OscarCache(model, rot, config)
    ref = model(input_ids=short, cache=alone).logits
    ref_step = model(input_ids=nxt[1:], cache=alone).logits
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
        out[block] = torch.cat([model(input_ids=ids[:, a:b], attention_mask=mask[:, :b], cache=cache).logits
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
        model(input_ids=ids[:, :30], cache=cache)
        logits.append(model(input_ids=ids[:, 30:], cache=cache).logits)
    assert torch.equal(logits[0], logits[1])


def test_views_travel_only_in_the_attention_kwargs():
    """The cache update hands the attention its view in the kwargs dict transformers passes to both (under
    `cache.VIEW_KWARG`), and nowhere else: an attention call without it is plain sdpa whatever the cache holds, a
    non-fused cache (sdpa model) puts none there, and a view that does not fit its call raises."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from oscar_hf.attention import oscar_attention_forward
    from oscar_hf.cache import VIEW_KWARG, ChunkView, DecodeView

    g = torch.Generator().manual_seed(9)
    model = tiny_model("llama")
    attn = model.model.layers[0].self_attn
    cache = OscarCache(model, OscarRotations.data_free(model, "hadamard"), OscarConfig(value_clip="none", **SMALL))
    model(input_ids=torch.randint(3, VOCAB, (1, 20), generator=g), cache=cache)
    k = torch.randn(1, 2, 3, 16, generator=g)
    kwargs = {}
    assert cache.update(k, k, 0, kwargs=kwargs)[0] is k  # fused: the new states as they are
    view = kwargs[VIEW_KWARG]
    assert isinstance(view, ChunkView) and view.layer is cache.layers[0]
    assert (view.past_length, view.chunk_length, view.batch) == (20, 3, 1)
    q = torch.randn(1, 4, 3, 16, generator=g)
    out, _ = oscar_attention_forward(attn, q, k, k, None)  # no view: sdpa, though the layer has just been updated
    assert torch.equal(out, sdpa_attention_forward(attn, q, k, k, None)[0])
    fused, _ = oscar_attention_forward(attn, q, k, k, None, **kwargs)
    assert fused.shape == out.shape and not torch.allclose(fused, out)  # the view: the stored past is attended
    with pytest.raises(RuntimeError, match="do not belong together"):
        oscar_attention_forward(attn, torch.randn(1, 4, 1, 16), k, k, None, **kwargs)
    step = {}
    cache.update(k[:, :, :1], k[:, :, :1], 0, kwargs=step)
    assert isinstance(step[VIEW_KWARG], DecodeView) and step[VIEW_KWARG].chunk_length == 1

    plain = tiny_model("llama", attn="sdpa")
    sdpa_cache = OscarCache(plain, OscarRotations.data_free(plain, "hadamard"), OscarConfig(value_clip="none", **SMALL))
    plain(input_ids=torch.randint(3, VOCAB, (1, 20), generator=g), cache=sdpa_cache)
    untouched = {}
    keys, _ = sdpa_cache.update(k, k, 0, kwargs=untouched)
    assert untouched == {} and keys.shape == (1, 2, 23, 16)  # the past dequantized, then the new states


def test_long_chunks_in_query_blocks_equal_one_block(monkeypatch):
    from oscar_hf import attention

    model = tiny_model("llama")
    ids = torch.randint(3, VOCAB, (1, 70), generator=torch.Generator().manual_seed(3))
    rotations = OscarRotations.data_free(model, "hadamard")
    logits = []
    for block in (4096, 16):
        monkeypatch.setattr(attention, "QUERY_BLOCK", block)
        cache = OscarCache(model, rotations, OscarConfig(value_clip="none", **SMALL))
        model(input_ids=ids[:, :30], cache=cache)
        logits.append(model(input_ids=ids[:, 30:], cache=cache).logits)  # 40 queries: 3 blocks of 16
    torch.testing.assert_close(logits[0], logits[1], atol=1e-5, rtol=1e-5)


def test_packed_sequences_without_a_mask_are_refused():
    """Several sequences packed into one row (`cu_seq_lens_q`, as continuous batching's paged cache passes them) with
    no mask would be one sequence to sdpa: refused. One sequence, or packed ones with their mask, are plain sdpa."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from oscar_hf.attention import oscar_attention_forward

    attn = tiny_model("llama").model.layers[0].self_attn
    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(1, 4, 5, 16, generator=g), torch.randn(1, 2, 5, 16, generator=g)
    two = torch.tensor([0, 2, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match="packed sequences"):
        oscar_attention_forward(attn, q, k, k, None, cu_seq_lens_q=two, cu_seq_lens_k=two)
    one = torch.tensor([0, 5], dtype=torch.int32)
    out, _ = oscar_attention_forward(attn, q, k, k, None, cu_seq_lens_q=one, cu_seq_lens_k=one)
    assert torch.equal(out, sdpa_attention_forward(attn, q, k, k, None)[0])
    block = torch.zeros(1, 1, 5, 5, dtype=torch.bool)
    block[..., :2, :2] = block[..., 2:, 2:] = True
    block &= torch.ones(5, 5, dtype=torch.bool).tril()
    out, _ = oscar_attention_forward(attn, q, k, k, block, cu_seq_lens_q=two, cu_seq_lens_k=two)
    assert torch.equal(out, sdpa_attention_forward(attn, q, k, k, block)[0])
