"""OscarCache's storage, one OSCAR layer at a time: where tokens go (positions.py's state machine), what they are
stored as (rotated, clipped, quantized as the format says), rollbacks, batch operations and accounting."""

import pytest
import torch

from conftest import tiny_config
from oscar_hf import OscarCache, OscarConfig, OscarRotations
from oscar_hf.cache import VIEW_KWARG, ChunkView, OscarLayer
from oscar_hf.format import layer_format
from oscar_hf.graphs import DecodeGraphs
from oscar_hf.positions import PositionPlan
from oscar_hf.quant import fake_quantize, fake_quantize_channels
from oscar_hf.rotation import rotate

H, D = 2, 16
# token-wise keys (the paper's layout) and channel-wise keys (the default) at tiny windows and blocks
SMALL = OscarConfig(sink_tokens=4, window_tokens=8, demotion_block=4, key_block=4, key_clip=0.9, value_clip=1.0,
                    key_granularity="token")
CHANNEL = SMALL.replace(key_granularity="channel")


def _rotations(h=H, d=D, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.linalg.qr(torch.randn(h, d, d, generator=g))[0], torch.linalg.qr(torch.randn(h, d, d, generator=g))[0]


def _cache(config=SMALL, exact_rotation=False, key_blocks=None, max_cache_len=None, batch_layers=1):
    """An OscarCache for a tiny Llama geometry (H KV heads of dim D) whose layers share these rotations. With the
    identity, rotating is exact, so states built from differently chunked inputs can be compared bitwise."""
    model_config = tiny_config("llama")
    rot = OscarRotations.data_free(model_config, "identity" if exact_rotation else "hadamard")
    if not exact_rotation:
        rk, rv = _rotations()
        rot.key_rotations = {layer: rk for layer in rot.layers}
        rot.value_rotations = {layer: rv for layer in rot.layers}
    if key_blocks is not None:
        rot.key_blocks = {layer: key_blocks for layer in rot.layers}
        rot.layout.update(key_block=config.key_block, demotion_block=config.demotion_block)
    return OscarCache(model_config, rot, config, max_cache_len=max_cache_len)


def _states(n, batch=1, seed=1, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, H, n, D, generator=g).to(dtype), torch.randn(batch, H, n, D, generator=g).to(dtype)


def _feed(cache, keys, values, sizes):
    """Feeds layer 0 (the first OSCAR layer: it advances the plan) chunk by chunk."""
    start = 0
    for n in sizes:
        cache.update(keys[:, :, start : start + n], values[:, :, start : start + n], 0)
        start += n
    return cache


def _counts(cache):
    return cache.plan.counts(cache.plan.current_length())


def _past(cache):
    return cache.layers[0].stored_states()


def test_prefill_routes_tokens_to_sink_history_and_recent():
    cache = _cache()
    k, v = _states(30)
    out_k, out_v = cache.update(k, v, 0)
    # sink 4; the remaining 26 leave 8..11 in the recent window after demoting whole blocks of 4
    assert _counts(cache) == (4, 16, 10)
    assert cache.get_seq_length() == 30 and cache.layers[0].get_mask_sizes(5) == (35, 0)
    # plain-attention path: the returned states of a first prefill are the exact inputs
    assert torch.allclose(out_k, k, atol=1e-6) and torch.allclose(out_v, v, atol=1e-6)


def test_stored_past_is_rotated_clipped_and_quantized_exactly_as_specified():
    cache = _feed(_cache(), *_states(30), [30])
    k, v = _states(30)
    layer = cache.layers[0]
    kr, vr = rotate(k, layer.key_rotation), rotate(v, layer.value_rotation)
    past_k, past_v = _past(cache)
    assert torch.equal(past_k[:, :, :4], kr[:, :, :4]) and torch.equal(past_k[:, :, 20:], kr[:, :, 20:])
    assert torch.equal(past_k[:, :, 4:20], fake_quantize(kr[:, :, 4:20], 2, D, 0.9))
    assert torch.equal(past_v[:, :, 4:20], fake_quantize(vr[:, :, 4:20], 2, D, 1.0))


def test_channelwise_keys_are_quantized_per_channel_over_each_demoted_block():
    k, v = _states(30)
    k = k * torch.linspace(0.1, 10, D) + torch.linspace(-5, 5, D)  # channels of very different offset and spread
    cache = _feed(_cache(CHANNEL), k, v, [30])
    layer = cache.layers[0]
    kr, vr = rotate(k, layer.key_rotation), rotate(v, layer.value_rotation)
    past_k, past_v = _past(cache)
    meta, codes = layer.storage.keys.meta, layer.storage.keys.codes
    # one slab of H rows (one block per head) per demoted block of 4 tokens
    assert _counts(cache)[1] == 16 and meta.shape[2:] == (H, D, 2) and meta.shape[1] * 4 == codes.shape[2]
    assert torch.equal(past_k[:, :, 4:20], fake_quantize_channels(kr[:, :, 4:20], 2, 4))
    assert not torch.equal(past_k[:, :, 4:20], fake_quantize(kr[:, :, 4:20], 2, D, 1.0))
    assert torch.equal(past_v[:, :, 4:20], fake_quantize(vr[:, :, 4:20], 2, D, 1.0))  # values stay token-wise


def test_each_kv_head_keeps_its_own_key_block():
    config = CHANNEL.replace(demotion_block=8, key_block=4)
    cache = _cache(config, key_blocks=(8, 4))
    k, v = _states(37)
    k = k * torch.linspace(0.1, 10, D) + torch.linspace(-5, 5, D)
    _feed(cache, k, v, [20, 1, 1, 15])  # a prefill, then demotions of whole chunks of 8 during decoding
    layer = cache.layers[0]
    kr = rotate(k, layer.key_rotation)
    past_k, _ = _past(cache)
    n = _counts(cache)[1]
    assert n == 24 and layer.storage.keys.meta.shape[2] == 1 + 2  # rows per chunk: 8/8 + 8/4
    assert torch.equal(past_k[:, 0, 4 : 4 + n], fake_quantize_channels(kr[:, 0, 4 : 4 + n], 2, 8))
    assert torch.equal(past_k[:, 1, 4 : 4 + n], fake_quantize_channels(kr[:, 1, 4 : 4 + n], 2, 4))
    # bytes holding the history: the codes, and 3 chunks x 3 meta rows x D channels x (scale, minimum) in float16
    assert layer.storage.keys.nbytes(n) == n * H * D // 4 + 3 * 3 * D * 2 * 2


@pytest.mark.parametrize("config", [SMALL, CHANNEL], ids=["token", "channel"])
@pytest.mark.parametrize("sizes", [[1] * 41, [7] * 5 + [6], [3, 1, 20, 1, 1, 15], [41]])
def test_state_does_not_depend_on_how_tokens_arrive(sizes, config):
    k, v = _states(41)
    reference = _feed(_cache(config, exact_rotation=True), k, v, [41])
    cache = _feed(_cache(config, exact_rotation=True), k, v, sizes)
    assert _counts(cache) == _counts(reference)
    for a, b in zip(_past(cache), _past(reference)):
        assert torch.equal(a, b)


def test_decode_demotes_in_blocks_and_keeps_the_window():
    cache = _cache()
    k, v = _states(60)
    seen = []
    for t in range(60):
        cache.update(k[:, :, t : t + 1], v[:, :, t : t + 1], 0)
        n_sink, n_hist, n_recent = _counts(cache)
        seen.append(n_recent)
        assert n_hist % 4 == 0 and n_sink + n_hist + n_recent == t + 1
    assert max(seen[20:]) == 11 and min(seen[20:]) == 8


@pytest.mark.parametrize("config", [SMALL, CHANNEL], ids=["token", "channel"])
def test_a_rollback_of_up_to_a_block_and_one_token_leaves_no_trace(config):
    """What assisted decoding does (candidates, then a crop): the state equals a run that never saw the removed
    tokens, also when the removed tokens completed a demotion."""
    k, v = _states(40)
    for start, extra, keep in ((25, 5, 27), (25, 5, 25), (26, 6, 27), (30, 3, 28)):
        cache = _feed(_cache(config, exact_rotation=True), k, v, [start])
        cache.layers[0].activate_past_recording()
        _feed_range(cache, k, v, start, start + extra)
        cache.crop(keep - start - extra)
        fresh = _feed(_cache(config, exact_rotation=True), k, v, [keep])
        assert cache.get_seq_length() == keep and _counts(cache) == _counts(fresh)
        for a, b in zip(_past(cache), _past(fresh)):
            assert torch.equal(a, b)
        _feed_range(cache, k, v, keep, 40)  # and it goes on as if nothing had happened
        fresh = _feed(_cache(config, exact_rotation=True), k, v, [40])
        for a, b in zip(_past(cache), _past(fresh)):
            assert torch.equal(a, b)


def _feed_range(cache, k, v, start, end):
    for t in range(start, end):
        cache.update(k[:, :, t : t + 1], v[:, :, t : t + 1], 0)


def test_a_longer_rollback_returns_the_window_from_the_history_as_stored():
    k, v = _states(30)
    cache = _feed(_cache(CHANNEL, exact_rotation=True), k, v, [30])
    before_k, before_v = _past(cache)
    cache.crop(-12)  # 18 tokens: of their window [8, 18), the ring (16 slots) still holds [14, 18) exactly
    assert _counts(cache) == (4, 4, 10)
    after_k, after_v = _past(cache)
    assert torch.equal(after_k[:, :, :14], before_k[:, :, :14]) and torch.equal(after_v[:, :, :14], before_v[:, :, :14])
    assert torch.equal(after_k[:, :, 14:], k[:, :, 14:18]) and torch.equal(after_v[:, :, 14:], v[:, :, 14:18])
    _feed(cache, k[:, :, 18:], v[:, :, 18:], [12])  # refilled: whole blocks again, nothing lost or duplicated
    assert cache.get_seq_length() == 30 and _counts(cache) == (4, 16, 10)
    cache.crop(-28)
    assert _counts(cache) == (2, 0, 0) and torch.equal(_past(cache)[0], before_k[:, :, :2])
    with pytest.raises(ValueError, match="negative"):
        cache.crop(3)


def test_beam_reorder_and_batch_ops_apply_to_every_buffer():
    k, v = _states(30, batch=3)
    cache = _feed(_cache(), k, v, [30])
    before_k, before_v = _past(cache)
    idx = torch.tensor([2, 0, 0])
    cache.reorder_cache(idx)
    after_k, after_v = _past(cache)
    assert torch.equal(after_k, before_k[idx]) and torch.equal(after_v, before_v[idx])
    cache.batch_select_indices(torch.tensor([0]))
    assert torch.equal(_past(cache)[0], before_k[[2]])
    cache.batch_repeat_interleave(2)
    assert torch.equal(_past(cache)[0], before_k[[2, 2]])


def test_reset_and_reuse_with_another_batch():
    cache = _feed(_cache(), *_states(30), [30])
    cache.reset()
    assert cache.get_seq_length() == 0
    _feed(cache, *_states(9, batch=2, seed=5), [9])
    assert cache.get_seq_length() == 9 and _past(cache)[0].shape[0] == 2
    with pytest.raises(ValueError, match="holds a batch of 2 sequences, not 3"):
        _feed(cache, *_states(1, batch=3), [1])


def test_a_rotation_files_key_blocks_that_pack_no_whole_bytes_are_refused_when_the_cache_is_built():
    config = CHANNEL.replace(demotion_block=8, key_block=4)
    with pytest.raises(ValueError, match=r"key blocks \[2, 8\]: at 2 bits each must be a multiple of 4 tokens"):
        _cache(config, key_blocks=(2, 8))  # (a hand-edited file: calibration gives multiples of 8)


def test_max_cache_len_is_a_limit():
    cache = _cache(max_cache_len=20)
    _feed(cache, *_states(20), [20])
    with pytest.raises(ValueError, match="max_cache_len=20"):
        _feed(cache, *_states(1), [1])
    with pytest.raises(ValueError, match="max_cache_len must be a positive number"):
        _cache(max_cache_len=0)


@pytest.mark.parametrize("layout", ["paper", "default"])
def test_memory_at_128k_matches_the_accounting(layout):
    # The paper's layout (token-wise keys, demotion 8) keeps 64 + 256 BF16 tokens at 128K: 2.2836 bits, its "2.28".
    # The default (keys channel-wise over blocks of 64 on average: 2.5 bits; values 2.25; demotion in chunks of 128)
    # keeps 64 + 320 at 131072 tokens (the window holds 256 to 383).
    config = OscarConfig(key_clip="none", value_clip="none")
    history_bits, exact_tokens = 2.375, 384
    if layout == "paper":
        config, history_bits, exact_tokens = config.replace(key_granularity="token", demotion_block=8), 2.25, 320
    n, d = 131072, 128
    fmt = layer_format(config, 1, d)
    plan = PositionPlan(config.sink_tokens, config.window_tokens, config.demotion_block, n)
    rk = torch.eye(d).expand(1, d, d)
    layer = OscarLayer(fmt, rk, rk, None, plan, DecodeGraphs())
    k = torch.randn(1, 1, n, d, dtype=torch.bfloat16)
    plan.advance(n)
    layer.update(k, k)
    m = layer.memory_bytes()
    used_bits = 8 * m["used"] / m["elements"]
    n_sink, _, n_recent = plan.counts(n)
    assert n_sink + n_recent == exact_tokens
    assert used_bits == pytest.approx(history_bits + exact_tokens * (16 - history_bits) / n, rel=1e-9)
    # allocated beyond the used bytes: the ring's room for rollbacks (R + 1 = W + 2b + 1 slots) and the scratch sink
    # slot in BF16, and history rows for the window's tokens (their values are quantized on arrival)
    spare_slots = plan.ring + 1 + 1 - n_recent
    spare_rows = n - config.sink_tokens - plan.history_rows(n) + config.demotion_block
    bound = (spare_slots * 2 * d * 2 + spare_rows * 2 * d) * 8 / m["elements"] + 16 * 2 * 2 * 8 * spare_rows / m["elements"]
    assert used_bits <= 8 * m["allocated"] / m["elements"] <= used_bits + bound


def test_bits_16_keeps_a_dense_history():
    config = OscarConfig(bits=16, sink_tokens=4, window_tokens=8, demotion_block=4, key_block=4, key_clip="none",
                         value_clip="none")
    k, v = _states(30)
    cache = _feed(_cache(config), k, v, [30])
    assert torch.allclose(_past(cache)[0], rotate(k, cache.layers[0].key_rotation), atol=0)


def test_non_finite_states_are_refused():
    k, v = _states(10)
    v[0, 0, 3, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN or Inf"):
        _cache().update(k, v, 0)


def test_a_config_of_another_type_a_layer_beyond_the_model_and_a_fractional_crop_are_refused():
    rot = OscarRotations.data_free(tiny_config("llama"), "hadamard")
    with pytest.raises(TypeError, match="config must be an OscarConfig .*got dict .*OscarConfig.from_dict"):
        OscarCache(tiny_config("llama"), rot, {"bits": 2})
    k, v = _states(6)
    cache = _cache()
    with pytest.raises(ValueError, match="OscarCache has 3 layers, for the model it was built for; got layer 3"):
        cache.update(k, v, 3)  # a deeper model than the cache's (it was an IndexError)
    _feed(cache, k, v, [6])
    with pytest.raises(TypeError, match="crop takes a whole number of tokens, got -2.5"):
        cache.crop(-2.5)  # (the cache held 3.5 tokens after it)
    cache.crop(torch.tensor(-2))
    assert cache.get_seq_length() == 4


def test_wrong_head_count_is_refused():
    k = torch.randn(1, 3, 5, D)
    with pytest.raises(ValueError, match="3 KV heads"):
        _cache().update(k, k, 0)


def test_a_fused_update_hands_its_view_to_the_attention_call_through_the_shared_kwargs_only():
    cache = _cache()
    cache._text_config._attn_implementation = "oscar"
    k, v = _states(6)
    attention_kwargs = {"position_ids": None}
    rk, rv = cache.update(k, v, 0, kwargs=attention_kwargs)
    assert rk is k and rv is v
    view = attention_kwargs[VIEW_KWARG]
    assert isinstance(view, ChunkView) and view.past_length == 0 and view.original_keys is k
    # a direct update (the public Cache API, no attention call after it) returns the stored states and leaves nothing
    # behind for a later attention call to pick up
    keys, values = cache.update(k[:, :, :1], v[:, :, :1], 0)
    assert keys.shape == (1, H, 7, D) and torch.allclose(keys[:, :, :6], k, atol=1e-5)


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_non_finite_states_are_refused_on_cpu_decode_steps(static):
    """Guards: on the CPU the NaN/Inf check (check_finite) runs on single-token steps too, in both caches, before the
    pass is counted."""
    from oscar_hf import StaticOscarCache

    model_config = tiny_config("llama")
    rot = OscarRotations.data_free(model_config, "hadamard")
    k, v = _states(7)
    for bad in ("keys", "values", "inf"):
        cache = (StaticOscarCache(model_config, rot, SMALL, max_cache_len=32) if static
                 else OscarCache(model_config, rot, SMALL))
        _feed(cache, k, v, [6])
        nk, nv = k[:, :, 6:].clone(), v[:, :, 6:].clone()
        (nv if bad == "values" else nk)[0, 1, 0, 3] = float("inf") if bad == "inf" else float("nan")
        with pytest.raises(ValueError, match="NaN or Inf key/value states at layer 0"):
            cache.update(nk, nv, 0)
        assert int(cache.get_seq_length()) == 6  # refused before the pass was counted: the cache is as it was
    cache = _feed(OscarCache(model_config, rot, SMALL), k, v, [6])
    with pytest.raises(ValueError, match="layer 1: .* earlier layers stored this pass: reset"):
        cache.update(nk, nv, 1)  # a later layer: the first one holds the pass
