import pytest
import torch

from oscar_hf.quant import (
    KeyBlockLayout, QuantizedKeyChunks, QuantizedRows, clip_rows, dequantize, fake_quantize_channels, quantize_channels,
    quantize_key_chunks, clip_threshold_index, dequantize_rows, fake_quantize, pack_2bit_u8, pack_3bit_u8,
    pack_4bit_u8, pack_codes, quantize_rows, unpack_2bit_u8, unpack_3bit_u8, unpack_4bit_u8, unpack_codes,
)


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


def test_dequantize_accepts_tuples():
    q = quantize_rows(torch.randn(3, 64), 2, 32)
    assert torch.equal(dequantize_rows((q.codes, q.meta, 2, 32)), dequantize_rows(q))
    assert isinstance(q, QuantizedRows)


def test_key_chunks_place_each_heads_blocks_at_its_rows():
    layout = KeyBlockLayout((32, 128, 64), 128)
    assert (layout.rows_per_chunk, layout.offsets) == (7, (0, 4, 5))
    assert layout.bits_per_element(2, 16) == 2 + 32 * 7 / (128 * 3)
    x = torch.randn(2, 3, 256, 64) * torch.linspace(0.1, 5, 64)
    q = quantize_key_chunks(x, 2, layout)
    assert q.meta.shape == (2, 2, 7, 64, 2) and q.codes.shape == (2, 3, 256, 16)
    dense = dequantize(q)
    for head, block in enumerate(layout.blocks):  # each head exactly as its own channel-wise quantization
        assert torch.equal(dense[:, head], fake_quantize_channels(x[:, head], 2, block))
    # token t of head 0 (blocks of 32) takes meta row (t // 128, t % 128 // 32); head 2 (64) row 5 + t % 128 // 64
    own = quantize_channels(x[:, 0], 2, 32)
    assert torch.equal(q.meta[:, 1, 3], own.meta[:, 7])
    assert torch.equal(q.meta[:, 1, 6], quantize_channels(x[:, 2], 2, 64).meta[:, 3])
    # a view ending inside a chunk dequantizes its rows only
    part = QuantizedKeyChunks(q.codes[:, :, :200], q.meta, 2, layout)
    assert torch.equal(dequantize(part), dense[:, :, :200])


def test_key_chunk_layouts_refuse_what_they_cannot_hold():
    with pytest.raises(ValueError, match="divide the chunk of 128"):
        KeyBlockLayout((64, 48), 128)
    with pytest.raises(ValueError, match="whole chunks of 128"):
        quantize_key_chunks(torch.randn(1, 2, 64, 64), 2, KeyBlockLayout((64, 64), 128))
    with pytest.raises(ValueError, match="for 2 KV heads"):
        quantize_key_chunks(torch.randn(1, 3, 128, 64), 2, KeyBlockLayout((64, 64), 128))
    assert KeyBlockLayout((32, 128, 64), 128).select([2, 0]) == KeyBlockLayout((64, 32), 128)


def test_wide_rows_number_the_low_planes_after_the_heads_in_order():
    from oscar_hf.quant import check_wide_rows, wide_rows

    assert wide_rows((2, 2, 2)) == ()
    assert wide_rows((4, 2, 4)) == (3, -1, 4)
    assert check_wide_rows((3, -1, 4), 3) == (3, -1, 4) and check_wide_rows((), 3) == ()
    for bad in ((4, -1, 3), (3, -1), (-1, -1, 3, 4)):
        with pytest.raises(ValueError, match="wide rows"):
            check_wide_rows(bad, 3)
    with pytest.raises(ValueError, match="head bits must be 2 or 4"):
        wide_rows((2, 3))


def test_wide_heads_are_their_4bit_codes_in_two_2bit_planes():
    """A wide head's row holds the 4-bit code's high plane under 4x the 4-bit scale, its extra row the low plane:
    together exactly the 4-bit quantization (token-wise and channel-wise); the other heads are plain 2-bit."""
    from oscar_hf.quant import dequantize_key_chunks, unpack_4bit_u8, wide_rows

    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 3, 128, 64, generator=g) * torch.logspace(-1, 1, 64) + torch.randn(64, generator=g)
    wide = wide_rows((4, 2, 4))
    q = quantize_rows(x, 2, 64, wide=wide)
    q4, q2 = quantize_rows(x[:, [0, 2]], 4, 64), quantize_rows(x, 2, 64)
    assert q.codes.shape == (2, 5, 128, 16) and q.meta.shape == (2, 3, 128, 1, 2) and q.wide_rows == wide
    for j, (head, row) in enumerate(((0, 3), (2, 4))):
        four = 4 * unpack_2bit_u8(q.codes[:, head]) + unpack_2bit_u8(q.codes[:, row])
        assert torch.equal(four, unpack_4bit_u8(q4.codes[:, j]))
        assert torch.equal(q.meta[:, head, ..., 0], 4 * q4.meta[:, j, ..., 0])
        assert torch.equal(q.meta[:, head, ..., 1], q4.meta[:, j, ..., 1])
    assert torch.equal(q.codes[:, 1], q2.codes[:, 1]) and torch.equal(q.meta[:, 1], q2.meta[:, 1])
    out = dequantize_rows(q)
    assert torch.allclose(out[:, [0, 2]], dequantize_rows(q4), atol=1e-6)
    assert torch.equal(out[:, 1], dequantize_rows(q2)[:, 1])
    layout = KeyBlockLayout((32, 64, 128), 128)
    k = quantize_key_chunks(x, 2, layout, wide=wide)
    k4 = quantize_key_chunks(x, 4, layout)
    assert k.codes.shape == (2, 5, 128, 16) and k.meta.shape == (2, 1, layout.rows_per_chunk, 64, 2)
    keys = dequantize_key_chunks(k)
    assert torch.allclose(keys[:, [0, 2]], dequantize_key_chunks(k4)[:, [0, 2]], atol=1e-6)
    assert torch.equal(keys[:, 1], dequantize_key_chunks(quantize_key_chunks(x, 2, layout))[:, 1])
    with pytest.raises(ValueError, match="2-bit history"):
        quantize_rows(x, 4, 64, wide=wide)


def test_wide_key_channels_hold_4_bit_channels_and_block_means_in_the_2_bit_bytes():
    """n wide key channels: channels 0..n-1 are their 4-bit quantization (high plane in their slot under 4s, low plane
    in slot d-n+j under s), channels d-n..d-1 their block means, the rest plain 2-bit; a score through the paired
    query is q·k̂; the counts are checked."""
    from oscar_hf.quant import (check_wide_channels, dequantize_key_chunks, dequantize_wide_channels, paired_channels,
                                quantize_wide_channels, wide_rows)

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
    layout = KeyBlockLayout((32, 64, 128), 128)
    xs = torch.stack([x, 2 * x, x + 1], 1)
    chunks = quantize_key_chunks(xs, 2, layout, wide_channels=(n, 0, 5))
    dense = dequantize_key_chunks(chunks)
    assert torch.equal(dense[:, 0], dequantize_wide_channels(quantize_wide_channels(x, 32, n), n))
    assert torch.equal(dense[:, 1], fake_quantize_channels(2 * x, 2, 64))
    assert torch.equal(dense[:, 2], dequantize_wide_channels(quantize_wide_channels(x + 1, 128, 5), 5))
    assert check_wide_channels((0, 0, 0), 3, 64) == ()
    with pytest.raises(ValueError, match="in \\[0, 32\\]"):
        check_wide_channels((33, 0, 0), 3, 64)
    with pytest.raises(ValueError, match="for 3 KV heads"):
        check_wide_channels((1, 2), 3, 64)
    with pytest.raises(ValueError, match="take no wide key channels"):
        quantize_key_chunks(xs, 2, layout, wide=wide_rows((4, 2, 2)), wide_channels=(3, 0, 0))
    with pytest.raises(ValueError, match="2-bit history"):
        quantize_key_chunks(xs, 4, layout, wide_channels=(3, 0, 0))
