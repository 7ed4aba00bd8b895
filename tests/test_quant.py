import pytest
import torch

from oscar_hf.format import LayerFormat, StreamFormat, layer_format, paired_channels, wide_channel_permutation, wide_rows
from oscar_hf.quant import (
    Packed, QuantizedRows, clip_rows, clip_threshold_index, dequantize, dequantize_channels, dequantize_rows,
    dequantize_wide_channels, fake_quantize, fake_quantize_channels, head_blocks, pack_2bit_u8, pack_3bit_u8,
    pack_4bit_u8, pack_codes, quantize, quantize_channels, quantize_rows, quantize_wide_channels, unpack_2bit_u8,
    unpack_3bit_u8, unpack_4bit_u8, unpack_codes,
)


def _channel_stream(blocks, chunk=128, bits=2, d=64, **kw):
    return StreamFormat(len(blocks), d, bits, "channel", blocks=tuple(blocks), chunk=chunk, **kw)


def test_every_byte_value_round_trips_through_2bit_unpack_pack():
    for packed in (torch.arange(256, dtype=torch.uint8).reshape(4, 64), torch.arange(256, dtype=torch.uint8).reshape(64, 4)):
        codes = unpack_2bit_u8(packed)
        assert codes.max() <= 3 and codes.shape[-1] == 4 * packed.shape[-1]
        assert torch.equal(pack_2bit_u8(codes), packed)
    packed = torch.arange(256, dtype=torch.uint8).reshape(8, 32)
    assert torch.equal(pack_4bit_u8(unpack_4bit_u8(packed)), packed)


def test_2bit_layout_is_planar_by_quarters():
    d = 16
    codes = torch.zeros(d, dtype=torch.uint8)
    codes[1], codes[1 + d // 4], codes[1 + d // 2], codes[1 + 3 * d // 4] = 1, 2, 3, 1
    packed = pack_2bit_u8(codes)
    assert packed.shape == (4,)
    assert packed[1].item() == 1 | 2 << 2 | 3 << 4 | 1 << 6
    assert packed[0].item() == packed[2].item() == packed[3].item() == 0


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
def test_codes_round_trip(bits):
    g = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 1 << bits, (3, 5, 64), generator=g, dtype=torch.uint8)
    packed = pack_codes(codes, bits)
    assert packed.shape[-1] == 64 * bits // 8
    assert torch.equal(unpack_codes(packed, bits), codes)


@pytest.mark.parametrize("bits", [1, 2, 4])
def test_unpacking_eight_bytes_at_a_time_matches_the_byte_planes(bits):
    """Rows of a multiple of 16 bytes are unpacked as int64 words: every byte value, and views of a larger buffer (as
    a history's rows are), give the codes of the byte-wise planes; rows the words cannot cover take the bytes."""
    def byte_planes(packed):
        return torch.cat([(packed >> (bits * p)) & ((1 << bits) - 1) for p in range(8 // bits)], -1)

    buffer = torch.randint(0, 256, (2, 5, 40, 48), generator=torch.Generator().manual_seed(bits), dtype=torch.uint8)
    buffer[0, 0, :16, :16] = torch.arange(256, dtype=torch.uint8).reshape(16, 16)
    for packed in (buffer, buffer[:, 1:4, 3:30], buffer[..., :32], buffer[..., 16:48], buffer[..., 8:40],
                   buffer[..., :8], buffer[:, :, :0]):
        assert torch.equal(unpack_codes(packed, bits), byte_planes(packed))


def test_3bit_is_a_2bit_plane_plus_a_1bit_plane():
    codes = torch.arange(8, dtype=torch.uint8).repeat(4)
    packed = pack_3bit_u8(codes)
    assert packed.shape == (12,)
    assert torch.equal(unpack_3bit_u8(packed), codes)


@pytest.mark.parametrize("bits,group", [(2, 64), (2, 16), (3, 64), (4, 32), (8, 64)])
def test_quantization_error_is_within_half_a_step(bits, group):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 50, 64, generator=g) * 3
    q = quantize_rows(x, bits, group, "float32")
    assert q.codes.dtype == torch.uint8 and q.codes.shape == (2, 3, 50, 64 * bits // 8)
    assert q.meta.shape == (2, 3, 50, 64 // group, 2)
    err = (dequantize_rows(q) - x).reshape(2, 3, 50, 64 // group, group).abs()
    step = q.meta[..., 0:1]
    assert (err <= step / 2 + 1e-5).all()
    # min and max of each group are reproduced (they are grid points)
    xg = x.reshape(2, 3, 50, 64 // group, group)
    xh = dequantize_rows(q).reshape_as(xg)
    assert torch.allclose(xh.amin(-1), xg.amin(-1), atol=1e-5)
    assert torch.allclose(xh.amax(-1), xg.amax(-1), atol=1e-4)


def test_16bit_metadata_codes_use_the_stored_scale():
    x = torch.randn(1000, 128) * 10
    q = quantize_rows(x, 2, 128, "float16")
    assert q.meta.dtype == torch.float16
    step = q.meta[..., 0, 0:1].float()
    err = (dequantize_rows(q) - x).abs()
    assert (err <= step / 2 * 1.01 + 1e-3).all()


def test_constant_rows_and_huge_values_stay_finite():
    x = torch.full((2, 64), 3.5)
    assert torch.allclose(dequantize_rows(quantize_rows(x, 2, 64)), x, atol=1e-3)
    big = torch.tensor([[-1e6] + [0.0] * 62 + [1e6]])
    out = dequantize_rows(quantize_rows(big, 2, 64, "float16"))
    assert torch.isfinite(out).all()


def test_clip_rows_threshold_semantics():
    assert clip_threshold_index(0.96, 128) == 122
    assert clip_threshold_index(0.92, 128) == 117
    assert clip_threshold_index(1.0, 64) == 64
    x = torch.arange(1, 129, dtype=torch.float32) * torch.tensor([1.0, -1.0]).repeat(64)
    clipped = clip_rows(x, 0.96)
    tau = 123.0  # sorted |x| is 1..128, index 122 holds 123
    assert clipped.abs().max().item() == tau
    assert (clipped.abs() == tau).sum().item() == 6  # 123 itself and the 5 larger values
    assert torch.equal(clipped.sign(), x.sign())
    assert torch.equal(clip_rows(x, 1.0), x)


def test_fake_quantize_keeps_dtype_and_shape():
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    y = fake_quantize(x, 2, 64, 0.9)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape


def test_a_token_wise_stream_is_clipped_rows_quantized_by_group():
    """`quantize(x, fmt)` of a token-wise stream: `fmt.clip` then `quantize_rows` (codes and meta as they are);
    `dequantize` reads it back as `dequantize_rows` does, in the dtype asked; dense tensors and 16-bit streams pass
    through as they are."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 10, 64, generator=g) * 3
    fmt = StreamFormat(3, 64, 2, group_size=32, clip=0.9)
    assert (fmt.groups, fmt.row_bytes, fmt.code_rows) == (2, 16, 3)
    assert fmt.bits_per_element() == 2 + 2 * 16 / 32
    p = quantize(x, fmt)
    q = quantize_rows(clip_rows(x, 0.9), 2, 32)
    assert isinstance(p, Packed) and p.length == 10 and p.fmt is fmt
    assert torch.equal(p.codes, q.codes) and torch.equal(p.meta, q.meta)
    assert torch.equal(dequantize(p), dequantize_rows(QuantizedRows(p.codes, p.meta, 2, 32)))
    assert dequantize(p, torch.bfloat16).dtype == torch.bfloat16
    assert not torch.equal(quantize(x, StreamFormat(3, 64, 2, group_size=32)).codes, p.codes)  # the clip mattered
    assert torch.equal(dequantize(x, torch.float64), x.double())  # a dense tensor is returned as it is
    dense = StreamFormat(3, 64, 16)
    assert dense.dense and dense.bits_per_element() == 16.0
    assert quantize(x, dense).meta is None and torch.equal(dequantize(quantize(x, dense)), x)
    with pytest.raises(ValueError, match="for a stream of 3 heads of dim 64"):
        quantize(x[:, :2], fmt)


def test_key_chunks_place_each_heads_blocks_at_its_rows():
    fmt = _channel_stream((32, 128, 64))
    assert (fmt.rows_per_chunk, fmt.offsets) == (7, (0, 4, 5))
    assert fmt.bits_per_element() == 2 + 32 * 7 / (128 * 3)
    x = torch.randn(2, 3, 256, 64) * torch.linspace(0.1, 5, 64)
    q = quantize(x, fmt)
    assert q.meta.shape == (2, 2, 7, 64, 2) and q.codes.shape == (2, 3, 256, 16)
    dense = dequantize(q)
    for head, block in enumerate(fmt.blocks):  # each head exactly as its own channel-wise quantization
        assert torch.equal(dense[:, head], fake_quantize_channels(x[:, head], 2, block))
        assert torch.equal(dequantize_channels(head_blocks(q, head)), dense[:, head])
    # token t of head 0 (blocks of 32) takes meta row (t // 128, t % 128 // 32); head 2 (64) row 5 + t % 128 // 64
    own = quantize_channels(x[:, 0], 2, 32)
    assert torch.equal(q.meta[:, 1, 3], own.meta[:, 7])
    assert torch.equal(q.meta[:, 1, 6], quantize_channels(x[:, 2], 2, 64).meta[:, 3])
    # a view ending inside a chunk dequantizes its rows only
    part = Packed(q.codes[:, :, :200], q.meta, fmt)
    assert torch.equal(dequantize(part), dense[:, :, :200])


def test_stream_formats_refuse_what_they_cannot_hold():
    """Every bad layout is refused when its `StreamFormat` / `LayerFormat` is made, naming what is wrong; rows that do
    not fit a format are refused by `quantize`."""
    bad = [
        (dict(heads=2, head_dim=64, bits=2, granularity="channel", blocks=(64, 48), chunk=128), "divide the demotion block of 128"),
        (dict(heads=2, head_dim=64, bits=2, granularity="channel", blocks=(64,), chunk=128), "expected 2 blocks"),
        (dict(heads=2, head_dim=64, bits=2, granularity="block"), "granularity"),
        (dict(heads=2, head_dim=64, bits=2, group_size=48), "does not divide head_dim"),
        (dict(heads=2, head_dim=64, bits=2, blocks=(64, 64), chunk=64), "layout of channel-wise streams"),
        (dict(heads=2, head_dim=64, bits=4, wide_rows=(2, -1)), "2-bit history"),
        (dict(heads=2, head_dim=64, bits=2, wide_rows=(3, -1)), "wide rows"),
        (dict(heads=2, head_dim=64, bits=2, wide_channels=(3, 0)), "2-bit channel-wise history"),
    ]
    for kwargs, message in bad:
        with pytest.raises(ValueError, match=message):
            StreamFormat(**kwargs)
    fmt = _channel_stream((64, 64))
    with pytest.raises(ValueError, match="whole chunks of 128"):
        quantize(torch.randn(1, 2, 64, 64), fmt)
    with pytest.raises(ValueError, match="rows of 3 KV heads"):
        quantize(torch.randn(1, 3, 128, 64), fmt)
    assert _channel_stream((32, 128, 64)).select(1, 2) == _channel_stream((128, 64))
    keys, values = _channel_stream((64, 64)), StreamFormat(2, 64, 2)
    assert LayerFormat(keys, values).kernel_problem() is None
    with pytest.raises(ValueError, match="share heads"):
        LayerFormat(keys, StreamFormat(3, 64, 2))
    with pytest.raises(ValueError, match="token-wise"):
        LayerFormat(keys, keys)


def test_layer_format_stores_the_configs_layout():
    from oscar_hf import OscarConfig

    config = OscarConfig(sink_tokens=4, window_tokens=8, demotion_block=32, key_block=16)
    fmt = layer_format(config, 2, 64, key_clip=0.9, value_clip=0.8, head_bits=(4, 2), wide_channels=(0, 5))
    assert fmt.keys == _channel_stream((16, 16), chunk=32, wide_rows=(2, -1), wide_channels=(0, 5))
    assert fmt.values == StreamFormat(2, 64, 2, wide_rows=(2, -1), clip=0.8)
    assert fmt.kernel_problem() is None and fmt.bits_per_element() > 2
    token = layer_format(OscarConfig(key_granularity="token", group_size=16), 2, 64, key_clip=0.9)
    assert token.keys == StreamFormat(2, 64, 2, group_size=16, clip=0.9) and not token.keys.channelwise
    with pytest.raises(ValueError, match="wide key channels"):  # a wide head takes no wide channels
        layer_format(config, 2, 64, head_bits=(4, 2), wide_channels=(3, 0))


def test_wide_rows_number_the_low_planes_after_the_heads_in_order():
    assert wide_rows((2, 2, 2)) == ()
    assert wide_rows((4, 2, 4)) == (3, -1, 4)
    fmt = StreamFormat(3, 64, 2, wide_rows=(3, -1, 4))
    assert fmt.wide_heads == (0, 2) and fmt.code_rows == 5
    assert StreamFormat(3, 64, 2).wide_rows == () and StreamFormat(3, 64, 2).code_rows == 3
    for bad in ((4, -1, 3), (3, -1), (-1, -1, 3, 4)):
        with pytest.raises(ValueError, match="wide rows"):
            StreamFormat(3, 64, 2, wide_rows=bad)
    with pytest.raises(ValueError, match="head bits must be 2 or 4"):
        wide_rows((2, 3))
    assert fmt.select(1, 2).wide_rows == (-1, 2)  # head slicing renumbers the low planes


def test_wide_heads_are_their_4bit_codes_in_two_2bit_planes():
    """A wide head's row holds the 4-bit code's high plane under 4x the 4-bit scale, its extra row the low plane:
    together exactly the 4-bit quantization (token-wise and channel-wise; unclipped where the 2-bit heads' token-wise
    rows are clipped); the other heads are plain 2-bit."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 3, 128, 64, generator=g) * torch.logspace(-1, 1, 64) + torch.randn(64, generator=g)
    wide = wide_rows((4, 2, 4))
    fmt = StreamFormat(3, 64, 2, wide_rows=wide)
    q = quantize(x, fmt)
    q4, q2 = quantize_rows(x[:, [0, 2]], 4, 64), quantize_rows(x, 2, 64)
    assert q.codes.shape == (2, 5, 128, 16) and q.meta.shape == (2, 3, 128, 1, 2)
    for j, (head, row) in enumerate(((0, 3), (2, 4))):
        four = 4 * unpack_2bit_u8(q.codes[:, head]) + unpack_2bit_u8(q.codes[:, row])
        assert torch.equal(four, unpack_4bit_u8(q4.codes[:, j]))
        assert torch.equal(q.meta[:, head, ..., 0], 4 * q4.meta[:, j, ..., 0])
        assert torch.equal(q.meta[:, head, ..., 1], q4.meta[:, j, ..., 1])
    assert torch.equal(q.codes[:, 1], q2.codes[:, 1]) and torch.equal(q.meta[:, 1], q2.meta[:, 1])
    out = dequantize(q)
    assert torch.allclose(out[:, [0, 2]], dequantize_rows(q4), atol=1e-6)
    assert torch.equal(out[:, 1], dequantize_rows(q2)[:, 1])
    assert fmt.bits_per_element() == (2 * 3 + 2 * 2) / 3 + 2 * 16 / 64
    clipped = dequantize(quantize(x, StreamFormat(3, 64, 2, wide_rows=wide, clip=0.75)))  # the clip is the 2-bit heads'
    assert torch.equal(clipped[:, [0, 2]], out[:, [0, 2]])
    assert torch.equal(clipped[:, 1], fake_quantize(x[:, 1], 2, 64, 0.75)) and not torch.equal(clipped[:, 1], out[:, 1])
    blocks = (32, 64, 128)
    k = quantize(x, _channel_stream(blocks, wide_rows=wide))
    k4 = quantize(x, _channel_stream(blocks, bits=4))
    assert k.codes.shape == (2, 5, 128, 16) and k.meta.shape == (2, 1, _channel_stream(blocks).rows_per_chunk, 64, 2)
    keys = dequantize(k)
    assert torch.allclose(keys[:, [0, 2]], dequantize(k4)[:, [0, 2]], atol=1e-6)
    assert torch.equal(keys[:, 1], dequantize(quantize(x, _channel_stream(blocks)))[:, 1])
    with pytest.raises(ValueError, match="2-bit history"):
        StreamFormat(3, 64, 4, wide_rows=wide)


def test_wide_key_channels_hold_4_bit_channels_and_block_means_in_the_2_bit_bytes():
    """n wide key channels: channels 0..n-1 are their 4-bit quantization (high plane in their slot under 4s, low plane
    in slot d-n+j under s), channels d-n..d-1 their block means, the rest plain 2-bit; a score through the paired
    query is q·k̂; the counts are checked."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(2, 128, 64, generator=g) * torch.logspace(-1, 1, 64) + torch.randn(64, generator=g)
    n, block = 11, 32
    q = quantize_wide_channels(x, block, n)
    assert q.codes.shape == (2, 128, 16) and q.meta.shape == (2, 4, 64, 2)
    k = dequantize_wide_channels(q, n)
    assert torch.allclose(k[..., :n], fake_quantize_channels(x[..., :12], 4, block)[..., :n], atol=1e-5)  # (12: whole bytes)
    means = x[..., -n:].reshape(2, 4, block, n).mean(2).half().float()
    assert torch.equal(k[..., -n:], means.repeat_interleave(block, 1))
    assert torch.equal(k[..., n:-n], fake_quantize_channels(x, 2, block)[..., n:-n])
    assert torch.equal(quantize_wide_channels(x, block, 0).codes, quantize_channels(x, 2, block).codes)
    pi = paired_channels(64, n)
    assert pi[:-n].tolist() == list(range(64 - n)) and pi[-n:].tolist() == list(range(n))
    query = torch.randn(64, generator=g)
    codes, meta = unpack_2bit_u8(q.codes).float(), q.meta.float().repeat_interleave(block, 1)
    scores = (query[pi] * meta[..., 0] * codes).sum(-1) + (query * meta[..., 1]).sum(-1)
    assert torch.allclose(scores, k @ query, atol=1e-4)
    # in the cache's layout, per head; a wide head takes no wide channels
    xs = torch.stack([x, 2 * x, x + 1], 1)
    fmt = _channel_stream((32, 64, 128), wide_channels=(n, 0, 5))
    dense = dequantize(quantize(xs, fmt))
    assert torch.equal(dense[:, 0], dequantize_wide_channels(quantize_wide_channels(x, 32, n), n))
    assert torch.equal(dense[:, 1], fake_quantize_channels(2 * x, 2, 64))
    assert torch.equal(dense[:, 2], dequantize_wide_channels(quantize_wide_channels(x + 1, 128, 5), 5))
    # the same bytes read as plain 2-bit keys are far off: the layout is in the format, not in the bytes
    stored = quantize(xs, fmt)
    plain = Packed(stored.codes, stored.meta, _channel_stream((32, 64, 128)))
    assert (dequantize(plain) - dense).abs().max() > 0.1
    assert _channel_stream((32, 64, 128), wide_channels=(0, 0, 0)).wide_channels == ()
    for counts in ((33, 0, 0), (1, 2)):
        with pytest.raises(ValueError, match=r"expected 3 counts \(one per KV head\) in \[0, 32\]"):
            _channel_stream((32, 64, 128), wide_channels=counts)
    with pytest.raises(ValueError, match="0 for the wide heads"):
        _channel_stream((32, 64, 128), wide_rows=wide_rows((4, 2, 2)), wide_channels=(3, 0, 0))
    with pytest.raises(ValueError, match="2-bit channel-wise history"):
        _channel_stream((32, 64, 128), bits=4, wide_channels=(3, 0, 0))


def test_wide_channel_permutation_orders_4_bit_then_2_bit_then_0_bit_channels():
    """The key rotation's column order for per-channel widths: n = min(#4-bit, #0-bit) pairs, [4-bit | 2-bit | 0-bit]
    each in channel order (surplus 0-bit channels stay at 2 bits); k·P stores channel order[c] in slot c."""
    widths = torch.tensor([2, 0, 4, 2, 0, 4, 4, 0, 2, 0])
    n, perm = wide_channel_permutation(widths)
    assert n == 3 and perm.dtype == torch.float64
    order = perm.argmax(0).tolist()  # slot c holds channel order[c]
    assert order == [2, 5, 6, 0, 1, 3, 8, 4, 7, 9]
    assert torch.equal(perm @ perm.T, torch.eye(10, dtype=torch.float64))
    k = torch.arange(10, dtype=torch.float64)
    assert (k @ perm).tolist() == [float(c) for c in order]
