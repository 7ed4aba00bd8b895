import pytest
import torch

from oscar_hf import OscarConfig
from oscar_hf.cache import OscarLayer, claim_layer, rotate
from oscar_hf.quant import fake_quantize, fake_quantize_channels

H, D = 2, 16
# token-wise keys (the paper's layout) and channel-wise keys (the default) at tiny windows and blocks
SMALL = OscarConfig(sink_tokens=4, window_tokens=8, demotion_block=4, key_block=4, key_clip=0.9, value_clip=1.0, key_granularity="token")
CHANNEL = SMALL.replace(key_granularity="channel")


def _rotations(h=H, d=D, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.linalg.qr(torch.randn(h, d, d, generator=g))[0], torch.linalg.qr(torch.randn(h, d, d, generator=g))[0]


def _layer(config=SMALL, exact_rotation=False, **kw):
    # With the identity, rotating is exact, so states built from differently chunked inputs can be compared bitwise.
    rk, rv = (torch.eye(D).expand(H, D, D),) * 2 if exact_rotation else _rotations()
    return OscarLayer(rk, rv, config.clip_ratio("key", None), config.clip_ratio("value", None), config, **kw)


def _states(n, batch=1, seed=1, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, H, n, D, generator=g).to(dtype), torch.randn(batch, H, n, D, generator=g).to(dtype)


def _feed(layer, keys, values, sizes):
    start = 0
    for n in sizes:
        layer.update(keys[:, :, start : start + n], values[:, :, start : start + n])
        start += n
    return layer


def _past(layer):
    return layer.stored_states()


def test_prefill_routes_tokens_to_sink_history_and_recent():
    layer = _layer()
    k, v = _states(30)
    out_k, out_v = layer.update(k, v)
    # sink 4; the remaining 26 leave 8..11 in the recent window after demoting whole blocks of 4
    assert (layer.n_sink, layer.history_keys.length, layer.n_recent) == (4, 16, 10)
    assert layer.get_seq_length() == 30 and layer.get_mask_sizes(5) == (35, 0)
    # plain-attention path: the returned states of a first prefill are the exact inputs
    assert torch.allclose(out_k, k, atol=1e-6) and torch.allclose(out_v, v, atol=1e-6)


def test_stored_past_is_rotated_clipped_and_quantized_exactly_as_specified():
    layer = _layer()
    k, v = _states(30)
    layer.update(k, v)
    rk, rv = layer.key_rotation, layer.value_rotation
    kr, vr = rotate(k, rk), rotate(v, rv)
    past_k, past_v = _past(layer)
    assert torch.equal(past_k[:, :, :4], kr[:, :, :4]) and torch.equal(past_k[:, :, 20:], kr[:, :, 20:])
    assert torch.equal(past_k[:, :, 4:20], fake_quantize(kr[:, :, 4:20], 2, D, 0.9))
    assert torch.equal(past_v[:, :, 4:20], fake_quantize(vr[:, :, 4:20], 2, D, 1.0))


def test_channelwise_keys_are_quantized_per_channel_over_each_demoted_block():
    layer = _layer(CHANNEL)
    k, v = _states(30)
    k = k * torch.linspace(0.1, 10, D) + torch.linspace(-5, 5, D)  # channels of very different offset and spread
    layer.update(k, v)
    kr, vr = rotate(k, layer.key_rotation), rotate(v, layer.value_rotation)
    past_k, past_v = _past(layer)
    meta, codes = layer.history_keys.buffers["meta"], layer.history_keys.buffers["codes"]
    # one slab of H rows (one block per head) per demoted block of 4 tokens
    assert layer.history_keys.length == 16 and meta.shape[2:] == (H, D, 2) and meta.shape[1] * 4 == codes.shape[2]
    assert torch.equal(past_k[:, :, 4:20], fake_quantize_channels(kr[:, :, 4:20], 2, 4))
    assert not torch.equal(past_k[:, :, 4:20], fake_quantize(kr[:, :, 4:20], 2, D, 1.0))
    assert torch.equal(past_v[:, :, 4:20], fake_quantize(vr[:, :, 4:20], 2, D, 1.0))  # values stay token-wise


def test_each_kv_head_keeps_its_own_key_block():
    config = CHANNEL.replace(demotion_block=8, key_block=4)
    layer = _layer(config, key_blocks=(8, 4))
    k, v = _states(37)
    k = k * torch.linspace(0.1, 10, D) + torch.linspace(-5, 5, D)
    _feed(layer, k, v, [20, 1, 1, 15])  # a prefill, then demotions of whole chunks of 8 during decoding
    kr = rotate(k, layer.key_rotation)
    past_k, _ = _past(layer)
    n = layer.history_keys.length
    assert n == 24 and layer.history_keys.buffers["meta"].shape[2] == 1 + 2  # rows per chunk: 8/8 + 8/4
    assert torch.equal(past_k[:, 0, 4 : 4 + n], fake_quantize_channels(kr[:, 0, 4 : 4 + n], 2, 8))
    assert torch.equal(past_k[:, 1, 4 : 4 + n], fake_quantize_channels(kr[:, 1, 4 : 4 + n], 2, 4))
    # bytes in use: the codes, and 3 chunks x 3 meta rows x D channels x (scale, minimum) in float16
    assert layer.history_keys.nbytes()[1] == n * H * D // 4 + 3 * 3 * D * 2 * 2


def test_crop_into_a_channelwise_block_returns_its_tokens_to_the_window():
    k, v = _states(30)
    layer = _feed(_layer(CHANNEL, exact_rotation=True), k, v, [30])
    before_k, before_v = _past(layer)
    layer.crop(-12)  # 10 recent + 2 of the last history block: that block's other 2 tokens go back to the window
    assert (layer.n_sink, layer.history_keys.length, layer.n_recent) == (4, 12, 2)
    after_k, after_v = _past(layer)
    assert torch.equal(after_k, before_k[:, :, :18]) and torch.equal(after_v, before_v[:, :, :18])
    layer.update(k[:, :, 18:30], v[:, :, 18:30])  # refilled: whole blocks again, nothing lost or duplicated
    assert layer.get_seq_length() == 30 and layer.history_keys.length % 4 == 0


@pytest.mark.parametrize("config", [SMALL, CHANNEL], ids=["token", "channel"])
@pytest.mark.parametrize("sizes", [[1] * 41, [7] * 5 + [6], [3, 1, 20, 1, 1, 15], [41]])
def test_state_does_not_depend_on_how_tokens_arrive(sizes, config):
    k, v = _states(41)
    reference = _feed(_layer(config, exact_rotation=True), k, v, [41])
    layer = _feed(_layer(config, exact_rotation=True), k, v, sizes)
    assert (layer.n_sink, layer.history_keys.length, layer.n_recent) == (
        reference.n_sink, reference.history_keys.length, reference.n_recent)
    for a, b in zip(_past(layer), _past(reference)):
        assert torch.equal(a, b)


def test_decode_demotes_in_blocks_and_keeps_the_window():
    layer = _layer()
    k, v = _states(60)
    seen = []
    for t in range(60):
        layer.update(k[:, :, t : t + 1], v[:, :, t : t + 1])
        seen.append(layer.n_recent)
        assert layer.history_keys.length % 4 == 0
    assert max(seen[20:]) == 11 and min(seen[20:]) == 8


def test_crop_with_past_recording_leaves_no_trace():
    k, v = _states(40)
    for keep in (30, 27, 25):
        layer = _feed(_layer(exact_rotation=True), k, v, [25])
        layer.activate_past_recording()
        layer.update(k[:, :, 25:30], v[:, :, 25:30])  # candidates: not demoted while recording
        assert layer.history_keys.length == _feed(_layer(), k, v, [25]).history_keys.length
        layer.crop(keep - 30)
        fresh = _feed(_layer(exact_rotation=True), k, v, [keep])
        assert layer.get_seq_length() == keep
        for a, b in zip(_past(layer), _past(fresh)):
            assert torch.equal(a, b)


def test_crop_reaches_into_history_and_sink():
    layer = _feed(_layer(), *_states(30), [30])
    layer.crop(-12)  # 10 recent + 2 history
    assert (layer.n_sink, layer.history_keys.length, layer.n_recent) == (4, 14, 0)
    layer.crop(-16)
    assert (layer.n_sink, layer.history_keys.length, layer.n_recent) == (2, 0, 0)
    with pytest.raises(ValueError, match="negative"):
        layer.crop(3)


def test_beam_reorder_and_batch_ops_apply_to_all_three_segments():
    k, v = _states(30, batch=3)
    layer = _feed(_layer(), k, v, [30])
    before_k, before_v = _past(layer)
    idx = torch.tensor([2, 0, 0])
    layer.reorder_cache(idx)
    after_k, after_v = _past(layer)
    assert torch.equal(after_k, before_k[idx]) and torch.equal(after_v, before_v[idx])
    layer.batch_select_indices(torch.tensor([0]))
    assert torch.equal(_past(layer)[0], before_k[[2]])
    layer.batch_repeat_interleave(2)
    assert torch.equal(_past(layer)[0], before_k[[2, 2]])


def test_reset_and_reuse():
    layer = _feed(_layer(), *_states(30), [30])
    layer.reset()
    assert layer.get_seq_length() == 0 and not layer.is_initialized
    _feed(layer, *_states(9, seed=5), [9])
    assert layer.get_seq_length() == 9


@pytest.mark.parametrize("layout", ["paper", "default"])
def test_memory_at_128k_matches_the_accounting(layout):
    # The paper's layout (token-wise keys, demotion 8) keeps 64 + 256 BF16 tokens at 128K: 2.2836 bits, its "2.28".
    # The default (keys channel-wise over blocks of 64 on average: 2.5 bits; values 2.25; demotion in chunks of 128)
    # keeps 64 + 320 at 131072 tokens (the window holds 256 to 383).
    config = OscarConfig(key_clip="none", value_clip="none")
    history_bits, exact_tokens = 2.375, 384
    if layout == "paper":
        config, history_bits, exact_tokens = config.replace(key_granularity="token", demotion_block=8), 2.25, 320
    n = 131072
    rk = torch.eye(128).expand(1, 128, 128)
    layer = OscarLayer(rk, rk, 1.0, 1.0, config, max_cache_len=n)
    k = torch.randn(1, 1, n, 128, dtype=torch.bfloat16)
    layer.update(k, k)
    m = layer.memory_bytes()
    used_bits = 8 * m["used"] / m["elements"]
    assert layer.n_sink + layer.n_recent == exact_tokens
    assert used_bits == pytest.approx(history_bits + exact_tokens * (16 - history_bits) / n, rel=1e-9)
    # allocated: the window's spare room for one more demotion block is all that is reserved beyond the used bytes
    spare = config.demotion_block * 128 * 2 * 2 * 8 / m["elements"]
    assert used_bits <= 8 * m["allocated"] / m["elements"] <= used_bits + spare + 1e-9


def test_bits_16_keeps_a_dense_history():
    layer = _layer(OscarConfig(bits=16, sink_tokens=4, window_tokens=8, demotion_block=4, key_block=4, key_clip="none", value_clip="none"))
    k, v = _states(30)
    layer.update(k, v)
    past_k, _ = _past(layer)
    assert torch.allclose(past_k, rotate(k, layer.key_rotation), atol=0)


def test_non_finite_states_are_refused():
    k, v = _states(10)
    v[0, 0, 3, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN or Inf"):
        _layer().update(k, v)


def test_wrong_head_count_is_refused():
    k = torch.randn(1, 3, 5, D)
    with pytest.raises(ValueError, match="3 KV heads"):
        _layer().update(k, k)


class _Module:
    def __init__(self, layer_idx):
        self.layer_idx = layer_idx


def test_fused_update_hands_the_layer_to_its_attention_call_through_the_shared_kwargs():
    layer = _layer()
    k, v = _states(6)
    attention_kwargs = {"position_ids": None}
    rk, rv = layer.update(k, v, fused=True, layer_idx=3, attention_kwargs=attention_kwargs)
    assert rk is k and rv is v
    # the attention call receives a copy of the kwargs (**kwargs): the layer travels in it, whatever the key tensor
    assert claim_layer(_Module(3), dict(attention_kwargs)) is layer
    view = layer.take_view()
    assert view.past_length == 0 and view.original_keys is k


def test_without_shared_kwargs_the_layer_waits_under_its_layer_index():
    layer = _layer()
    k, v = _states(6)
    layer.update(k, v, fused=True, layer_idx=5)
    assert claim_layer(_Module(4), {}) is None  # another layer's attention: not this view
    assert claim_layer(_Module(5), {}) is layer
    assert claim_layer(_Module(5), {}) is None  # consumed once
    layer.take_view()


def test_a_view_left_by_an_interrupted_pass_is_dropped_not_used():
    layer = _layer()
    k, v = _states(6)
    layer.update(k, v, fused=True, layer_idx=0)  # ...and the forward pass died before its attention call
    with pytest.warns(RuntimeWarning, match="interrupted"):  # a later call of another shape (another cache)
        assert claim_layer(_Module(0), {}, torch.zeros(1, 4, 3, D)) is None
    layer.update(k[:, :, :1], v[:, :, :1], fused=True, layer_idx=0)
    assert claim_layer(_Module(0), {}, torch.zeros(1, 4, 1, D)).take_view().chunk_length == 1


def test_an_unused_view_is_reported_and_dropped():
    layer = _layer()
    k, v = _states(6)
    layer.update(k, v, fused=True, layer_idx=0)
    with pytest.warns(RuntimeWarning, match="never used"):
        layer.update(k[:, :, :1], v[:, :, :1], fused=True, layer_idx=0)
    assert claim_layer(_Module(0), {}).take_view().chunk_length == 1


def test_reset_ends_past_recording_and_recording_ends_without_crops():
    k, v = _states(60)
    layer = _feed(_layer(), k, v, [20])
    layer.activate_past_recording()
    layer.update(k[:, :, 20:25], v[:, :, 20:25])  # a verification step of assisted decoding...
    layer.crop(-2)  # ...always followed by a crop
    recorded = layer.n_recent
    layer.update(k[:, :, 23:26], v[:, :, 23:26])
    assert layer.record_past and layer.n_recent == recorded + 3  # still recording: nothing demoted
    for t in range(26, 60):  # plain decoding afterwards: no crops, so recording ends and demotion resumes
        layer.update(k[:, :, t : t + 1], v[:, :, t : t + 1])
    assert not layer.record_past and layer.n_recent <= 8 + 3
    layer.activate_past_recording()
    layer.reset()
    assert not layer.record_past and not layer.is_initialized
