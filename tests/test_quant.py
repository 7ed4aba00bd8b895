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
