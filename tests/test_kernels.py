"""Triton kernels against their torch twins, on the CPU in the Triton interpreter (TRITON_INTERPRET=1, set by
conftest), at small shapes. The tests build CPU tensors, so they do not run on a GPU as they are: the GPU check is
`eval/bench_gpu.py --sections check` (`eval/gpu_check.sh`), the same comparisons at realistic shapes.
Fresh random inputs per case, outputs poisoned before each run. Attention tolerances are scaled by the reference's own
bf16 error, as flash-attention's tests do: |kernel − fp32 twin| <= 2·|bf16-emulating twin − fp32 twin| + ε
(`_assert_within_twice_the_bf16_error`).

The interpreter runs every program of a launch in Python: each kernel call costs about a second here, so the cases
are as small as what they check allows, and the model-level tests decode a few steps across exactly the boundaries
they are about."""

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from oscar_hf import ops
from oscar_hf.format import LayerFormat, StreamFormat, kernel_layout_problem, wide_rows
from oscar_hf.ops import (
    DecodeBuffers, Segments, decode_attention_reference, quantize_pack_at_reference, quantize_pack_reference,
    segment_attention_reference,
)
from oscar_hf.quant import Packed, clip_rows, dequantize, quantize, unpack_2bit_u8
from test_attention import random_segments, twin

kernels = pytest.importorskip("oscar_hf.kernels", reason="Triton is not installed")
from oscar_hf.kernels.attention import decode_attention_triton, key_tile, segment_attention_triton  # noqa: E402
from oscar_hf.kernels.quantize import _order_statistic_abs, quantize_pack_triton  # noqa: E402

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

EPS = 1e-3  # the ε of the attention tolerance: well below a bf16 ulp of the outputs (~0.004 at |out| ~ 1)


@triton.jit
def _order_statistic_rows(x_ptr, out_ptr, k, D: tl.constexpr, BF16: tl.constexpr, BITS: tl.constexpr):
    rows, cols = tl.arange(0, 8), tl.arange(0, D)
    x = tl.load(x_ptr + rows[:, None] * D + cols[None, :]).to(tl.float32)
    tl.store(out_ptr + rows, _order_statistic_abs(x, k, BF16, BITS))


@pytest.fixture(scope="module", autouse=True)
def _faster_interpreter():
    """Two pieces of the Triton interpreter's per-operation host work that these tests do not need, off for this
    module (about half of its time; the kernels write and return the same bytes either way):
    - the int32 overflow sanitizer on every integer add and mul (the index arithmetic of these small shapes is far
      from 2^31; compiled kernels run without it unless built with debug=True);
    - patching triton.language again on every call of a @triton.jit helper inside a launch: once per helper and
      launch is what the interpreter needs (a helper's patches last until the launch restores the language), each
      further call only walked the language's members again.
    Left as it is where the interpreter's internals differ (another Triton): the tests are then slower, not weaker."""
    try:
        import triton.runtime.interpreter as interpreter

        builder, patch_lang, launch, no_patch = (interpreter.interpreter_builder, interpreter._patch_lang,
                                                 interpreter.GridExecutor, interpreter._LangPatchScope)
        options = builder.options
        unsanitized = dataclasses.replace(options, sanitize_overflow=False)
    except (ImportError, AttributeError, TypeError):
        yield
        return
    patched = set()  # the helpers whose patches are in place since the current launch began

    def patch_lang_once_per_launch(fn):
        if isinstance(sys._getframe(1).f_locals.get("self"), launch):  # a launch: patches, restored at its end
            patched.clear()
        elif fn in patched:  # a helper called again within this launch
            return no_patch()
        else:
            patched.add(fn)
        return patch_lang(fn)

    builder.options, interpreter._patch_lang = unsanitized, patch_lang_once_per_launch
    try:
        yield
    finally:
        builder.options, interpreter._patch_lang = options, patch_lang


@pytest.fixture
def kernels_on(monkeypatch):
    """`OSCAR_HF_KERNELS=1`: the ops take the kernels on the CPU (and say why when they cannot)."""
    monkeypatch.setenv("OSCAR_HF_KERNELS", "1")


# ------------------------------------------------------------------------------------------ helpers
def _fresh(fmt: StreamFormat, b: int, cap: int):
    """Poisoned history buffers of `fmt` for `cap` rows: codes 0xAA, meta NaN."""
    codes = torch.full((b, fmt.code_rows, cap, fmt.row_bytes), 0xAA, dtype=torch.uint8)
    if fmt.channelwise:
        shape = (b, cap // fmt.chunk, fmt.rows_per_chunk, fmt.head_dim, 2)
    else:
        shape = (b, fmt.heads, cap, fmt.groups, 2)
    return codes, torch.full(shape, float("nan"), dtype=fmt.meta_dtype)


def _same(got, want) -> bool:
    """Codes and meta bit for bit, NaN (unwritten) where the other is NaN."""
    return torch.equal(got[0], want[0]) and torch.equal(got[1].isnan(), want[1].isnan()) \
        and torch.equal(got[1].nan_to_num(), want[1].nan_to_num())


def _channels(blocks, chunk, d=64, **kw) -> StreamFormat:
    return StreamFormat(len(blocks), d, 2, "channel", blocks=tuple(blocks), chunk=chunk, **kw)


def _flat_segments(args):
    """`random_segments`' arguments as the custom op `oscar::segment_attention` (and its launcher) take them."""
    q, seg, fmt, key_mask, queries_per_group, query_start, scale = args
    hk, hv = seg.history_keys, seg.history_values
    return (q, seg.sink_keys, seg.sink_values, hk.codes, hk.meta, hv.codes, hv.meta, seg.recent_keys,
            seg.recent_values, seg.extra_keys, seg.extra_values, key_mask, *seg.lengths, queries_per_group,
            query_start, scale, *ops._kernel_layout(fmt.keys))


def _flat_decode(args, value_rotation=None):
    """`_static_buffers`' arguments as the custom op `oscar::decode_attention` takes them."""
    q, buf, fmt, key_mask, lengths, queries_per_group, scale = args
    return (q, buf.sink_keys, buf.sink_values, buf.key_codes, buf.key_meta, buf.value_codes, buf.value_meta,
            buf.ring_keys, buf.ring_values, key_mask, lengths, queries_per_group, scale, *ops._kernel_layout(fmt.keys),
            value_rotation)


def _without_wide_channels(fmt: LayerFormat) -> LayerFormat:
    return LayerFormat(dataclasses.replace(fmt.keys, wide_channels=()), fmt.values, fmt.first_head)


def _assert_within_twice_the_bf16_error(out, ref, lowp, valid=None):
    """flash-attention's criterion: the kernel is at most twice as far from the fp32 twin as the twin computed at
    the kernel's precision (bf16 probabilities, output rounded to the kernel's dtype), plus ε. Returns the errors."""
    valid = torch.ones(out.shape[:3], dtype=torch.bool) if valid is None else valid
    err = (out.double() - ref.double())[valid].abs().max().item()
    lowp_err = (lowp.double() - ref.double())[valid].abs().max().item()
    assert err <= 2 * lowp_err + EPS, (err, lowp_err)
    return err, lowp_err


def _check_segment_kernel(args, out, lse):
    """A segment attention kernel output against the fp32 twin (float32 q: no rounding of the output) and the
    bf16-emulating twin; rows with no visible key give 0 and -inf. Returns (ref, valid, tolerance)."""
    ref, ref_lse = twin((args[0].float(), *args[1:]))
    lowp, _ = twin(args, emulate_bf16=True)
    valid = torch.isfinite(ref_lse)
    assert out.dtype == args[0].dtype and lse.dtype == torch.float32
    err, lowp_err = _assert_within_twice_the_bf16_error(out, ref, lowp, valid)
    assert torch.allclose(lse[valid], ref_lse[valid], atol=5e-2)
    assert (out[~valid] == 0).all() and torch.isinf(lse[~valid]).all()
    return ref, valid, 2 * lowp_err + EPS


def _as_segments(buffers: DecodeBuffers, fmt: LayerFormat, lengths) -> Segments:
    """What a decode step over `buffers` reads, as `Segments`: the sink's n_sink rows, the history's n_hist, the ring's
    n_recent from slot ring_lo on (wrapped)."""
    n_sink, n_hist, n_recent, ring_lo, _ = (int(x) for x in lengths)
    slots = (ring_lo + torch.arange(n_recent)) % buffers.ring_keys.shape[2]

    def history(codes, meta, stream):
        meta = meta[:, : -(-n_hist // stream.chunk)] if stream.channelwise else meta[:, :, :n_hist]
        return Packed(codes[:, :, :n_hist], meta, stream)

    none = buffers.sink_keys[:, :, :0]
    return Segments(buffers.sink_keys[:, :, :n_sink], buffers.sink_values[:, :, :n_sink],
                    history(buffers.key_codes, buffers.key_meta, fmt.keys),
                    history(buffers.value_codes, buffers.value_meta, fmt.values),
                    buffers.ring_keys.index_select(2, slots), buffers.ring_values.index_select(2, slots), none, none)


def _check_decode_kernel(args, out, value_rotation=None):
    """A decode attention kernel output against the fp32 twin (`decode_attention_reference`, float32 q) and the
    bf16-emulating segment twin over the same stored tokens (`_as_segments`; probabilities in bf16, the un-rotation
    in float32, one rounding), which first has to agree with the decode twin. Returns (ref, tolerance)."""
    q, buffers, fmt, key_mask, lengths, queries_per_group, scale = args
    ref = decode_attention_reference(q.float(), buffers, fmt, key_mask, lengths, queries_per_group, scale,
                                     value_rotation)
    seg = _as_segments(buffers, fmt, lengths)
    query_start = int(lengths[4])

    def segment_twin(**kw):
        o, _ = segment_attention_reference(q.float(), seg, key_mask, queries_per_group, query_start, scale, **kw)
        return o if value_rotation is None else torch.einsum("bhmd,hed->bhme", o, value_rotation.float())

    assert torch.allclose(segment_twin(), ref, atol=1e-5)  # the two twins read the same tokens
    assert out.dtype == q.dtype and out.shape == q.shape
    _, lowp_err = _assert_within_twice_the_bf16_error(out, ref, segment_twin(emulate_bf16=True).to(q.dtype))
    return ref, 2 * lowp_err + EPS


# ------------------------------------------------------------------------------------------ quantize_pack
def test_float32_metadata_is_not_rounded_to_16_bits():
    """scale_dtype="float32": the kernel stores the same float32 scale and minimum as the twin (it used to round
    them to fp16, and then the codes differed)."""
    x = (torch.randn(1, 2, 24, 64, generator=torch.Generator().manual_seed(9)) * 3).to(torch.bfloat16)
    fmt = StreamFormat(2, 64, 2, clip=0.9, scale_dtype="float32")
    outputs = []
    for kernel in (False, True):
        codes, meta = _fresh(fmt, 1, 24)
        ops.quantize_pack(x, None, codes, meta, 0, fmt, kernel=kernel)
        outputs.append((codes, meta))
    assert meta.dtype == torch.float32 and _same(outputs[1], outputs[0])
    assert not torch.equal(outputs[1][1], outputs[1][1].half().float())  # really float32 precision


@pytest.mark.parametrize("d,groups,ratio,rotate,dtype,tiles_per_program", [
    (64, 1, 0.9, False, torch.bfloat16, None),
    (128, 1, 1.0, True, torch.bfloat16, None),
    (128, 2, 0.96, True, torch.float16, 2),
    (64, 4, 0.8, False, torch.float16, 2),
])
def test_quantize_pack_matches_the_torch_twin(d, groups, ratio, rotate, dtype, tiles_per_program):
    # tiles_per_program=2: several row tiles per program (long prefills on the GPU); 150 rows make two programs of
    # two 64-row tiles when rotating (the third ragged, the fourth empty), three of two 32-row tiles otherwise
    g = torch.Generator().manual_seed(d + groups)
    b, h, n, start, cap = (2, 2, 37, 5, 50) if tiles_per_program is None else (1, 2, 150, 5, 160)
    fmt = StreamFormat(h, d, 2, group_size=d // groups, clip=ratio)
    x = (torch.randn(b, h, n, d, generator=g) * 3).to(dtype)
    rotation = torch.linalg.qr(torch.randn(h, d, d, generator=g))[0].to(dtype) if rotate else None
    ref_codes, ref_meta = _fresh(fmt, b, cap)
    quantize_pack_reference(x, rotation, ref_codes, ref_meta, start, fmt)
    codes, meta = _fresh(fmt, b, cap)
    if tiles_per_program is None:
        ops.quantize_pack(x, rotation, codes, meta, start, fmt, kernel=True)
    else:
        quantize_pack_triton(x, rotation, ratio, codes, meta, start, tiles_per_program=tiles_per_program)
    # rows outside [start, start + n) are untouched, rows inside are all written
    assert (codes[:, :, :start] == 0xAA).all() and (codes[:, :, start + n:] == 0xAA).all()
    assert torch.isnan(meta[:, :, start + n:]).all() and not torch.isnan(meta[:, :, start : start + n]).any()
    a, r = unpack_2bit_u8(codes[:, :, start : start + n]).int(), unpack_2bit_u8(ref_codes[:, :, start : start + n]).int()
    differ = (a != r).float().mean().item()
    # identical up to rounding ties and (when rotating) the last bit of the rotated value
    assert differ <= (0.01 if rotate else 0.0005) and (a - r).abs().max() <= 1
    assert torch.allclose(meta[:, :, start : start + n].float(), ref_meta[:, :, start : start + n].float(), rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_clip_threshold_by_bisection_equals_the_sorted_value(dtype):
    """The quantize kernel's clip threshold (bisection over bit patterns) is exactly sort(|x|)[k], ties and zeros
    included, for every k (head_dim 32) and for a few k at head_dim 256: also for a row of zeros (no pattern above
    the first split) and for a row whose threshold lies far below its largest value (the first split misses)."""
    g = torch.Generator().manual_seed(7)
    for d, ks in ((32, range(32)), (256, (0, 1, 127, 200, 255))):
        x = torch.randn(8, d, generator=g) * torch.logspace(-6, 6, 8)[:, None]
        x[0, :10] = 0.0  # zeros
        x[1] = torch.randint(-3, 4, (d,), generator=g).float()  # many ties
        x[2, ::2] = -x[2, 1::2]  # equal magnitudes of both signs
        x[3] = 0.0
        x[4, 0] = x[4].abs().max() * 1e4  # one outlier: every other |x| more than four octaves below it
        x = x.to(dtype)
        reference = x.float().abs().sort(dim=1).values
        for k in ks:
            out = torch.empty(8)
            _order_statistic_rows[(1,)](x, out, k, D=d, BF16=dtype == torch.bfloat16,
                                        BITS=32 if dtype == torch.float32 else 16)
            assert torch.equal(out, reference[:, k]), (d, k)


@pytest.mark.parametrize("d,blocks,chunk,rotate,dtype,scale_dtype", [
    (64, (16, 16), 16, False, torch.bfloat16, "float16"),          # uniform blocks, one per chunk
    (128, (32, 128), 128, True, torch.float16, "float16"),         # per-head blocks
    (64, (128, 64, 32, 128), 128, False, torch.bfloat16, "float32"),
    (64, (64, 64), 128, True, torch.bfloat16, "float32"),          # two blocks of every head per chunk
    (128, (8, 32), 32, False, torch.float16, "bfloat16"),          # a block smaller than the kernel's row step
])
def test_channelwise_quantize_pack_matches_the_torch_twin(d, blocks, chunk, rotate, dtype, scale_dtype):
    g = torch.Generator().manual_seed(d + chunk + len(blocks))
    fmt = _channels(blocks, chunk, d, scale_dtype=scale_dtype)
    b, h, chunks, start = 1, len(blocks), 2, chunk
    n, cap = chunks * chunk, (chunks + 2) * chunk
    x = (torch.randn(b, h, n, d, generator=g) * torch.randn(d, generator=g).exp() + torch.randn(d, generator=g)).to(dtype)
    rotation = torch.linalg.qr(torch.randn(h, d, d, generator=g))[0].to(dtype) if rotate else None
    outputs = []
    for kernel in (False, True):
        codes, meta = _fresh(fmt, b, cap)
        ops.quantize_pack(x, rotation, codes, meta, start, fmt, kernel=kernel)
        outputs.append((codes, meta))
    (ref_codes, ref_meta), (codes, meta) = outputs
    rows, blk = slice(start, start + n), slice(start // chunk, (start + n) // chunk)
    assert (codes[:, :, :start] == 0xAA).all() and (codes[:, :, start + n:] == 0xAA).all()
    assert not torch.isnan(meta[:, blk]).any() and torch.isnan(meta[:, : start // chunk]).all()
    assert torch.isnan(meta[:, (start + n) // chunk:]).all()
    # same arithmetic on the same values: bit for bit (bfloat16 meta aside: the interpreter rounds float32 -> bfloat16
    # toward zero, the GPU and torch to nearest even)
    if not rotate and scale_dtype != "bfloat16":
        assert torch.equal(meta[:, blk], ref_meta[:, blk]) and torch.equal(codes[:, :, rows], ref_codes[:, :, rows])
    assert torch.allclose(meta[:, blk].float(), ref_meta[:, blk].float(), rtol=1e-2, atol=1e-3)
    a, r = unpack_2bit_u8(codes[:, :, rows]).int(), unpack_2bit_u8(ref_codes[:, :, rows]).int()
    inexact = rotate or scale_dtype == "bfloat16"
    assert (a != r).float().mean().item() <= (0.01 if inexact else 0.0005) and (a - r).abs().max() <= 1


@pytest.mark.parametrize("kind,n,start", [
    ("token", 1, 7), ("token", 1, -1), ("token", 3, 0), ("token", 40, 2),  # a decode token, skipped, short, long
    ("channel", 64, 64), ("channel", 64, -1), ("channel", 128, 0),
])
def test_quantize_pack_at_reads_its_first_row_on_the_device(kind, n, start):
    """`quantize_pack_at` (a static cache's decode writes): the first row comes from a device tensor, a negative one
    writes nothing, and what it writes is `quantize_pack`'s; the twin does the same without a branch."""
    g = torch.Generator().manual_seed(n + start + 3)
    b, h, d, cap = 2, 2, 64, 192
    x = (torch.randn(b, h, n, d, generator=g) * 3).to(torch.bfloat16)
    fmt = _channels((32, 64), 64) if kind == "channel" else StreamFormat(h, d, 2, clip=0.9)
    expected = _fresh(fmt, b, cap)
    if start >= 0:
        quantize_pack_reference(x, None, *expected, start, fmt)
    for kernel in (False, True):
        got = _fresh(fmt, b, cap)
        ops.quantize_pack_at(x, *got, torch.tensor([start]), fmt, kernel=kernel)
        assert _same(got, expected), kernel


@pytest.mark.parametrize("start", [64, 320, -1])
def test_quantize_pack_at_reads_a_key_chunk_from_a_ring_in_place(start):
    """`ring`: the chunk at history rows [start, start + chunk) is read from ring slots (start + i) mod R (R = 96,
    chunk 64: start 64 wraps around, slots 64..95 then 0..31) and written exactly as `quantize_pack` writes the
    gathered rows, by the kernel and its twin; a start of -1 writes nothing."""
    g = torch.Generator().manual_seed(start + 7)
    b, h, d, cap, ring, chunk = 2, 2, 64, 448, 96, 64
    fmt = _channels((32, 64), chunk)
    ring_buf = (torch.randn(b, h, ring + 1, d, generator=g) * 3 + torch.randn(d, generator=g)).to(torch.bfloat16)
    expected = _fresh(fmt, b, cap)
    if start >= 0:
        rows = ring_buf.index_select(2, (start + torch.arange(chunk)) % ring)
        quantize_pack_reference(rows, None, *expected, start, fmt)
    if start == 64:
        assert ((start + torch.arange(chunk)) % ring).tolist()[31:33] == [95, 0]
    for kernel in (False, True):
        got = _fresh(fmt, b, cap)
        ops.quantize_pack_at(ring_buf, *got, torch.tensor([start]), fmt, ring=ring, kernel=kernel)
        assert _same(got, expected), kernel
    with pytest.raises(ValueError, match="ring source"):  # a ring is for channel-wise key chunks
        quantize_pack_at_reference(ring_buf, *_fresh(StreamFormat(h, d, 2), b, cap), torch.tensor([start]),
                                   StreamFormat(h, d, 2), ring=ring)


@pytest.mark.parametrize("chunk,n,start", [(0, 37, 5), (0, 1, 9), (128, 128, 128)])
def test_quantize_pack_writes_wide_heads_like_its_twin(chunk, n, start):
    """Wide heads (`format.wide_rows`): the kernel stores the 4-bit code's high plane in the head's row, its low plane
    in the head's extra row after the H heads, and 4·s as the scale, bit for bit as its twin (token-wise rows, a
    decode token's one-row tile, channel-wise key chunks); the reconstruction is a 4-bit one, of rows the clip of the
    2-bit heads leaves alone."""
    g = torch.Generator().manual_seed(n + chunk)
    b, h, d, cap = 2, 3, 64, 384
    wide = wide_rows((4, 2, 4))
    assert wide == (3, -1, 4)
    blocks = (64, 32, 128)
    fmt = _channels(blocks, chunk, wide_rows=wide) if chunk else StreamFormat(h, d, 2, wide_rows=wide, clip=0.9)
    x = (torch.randn(b, h, n, d, generator=g) * torch.randn(d, generator=g).exp() + torch.randn(d, generator=g))
    x = x.to(torch.bfloat16)
    outputs = []
    for kernel in (False, True):
        codes, meta = _fresh(fmt, b, cap)
        ops.quantize_pack(x, None, codes, meta, start, fmt, kernel=kernel)
        outputs.append((codes, meta))
    (codes, meta) = outputs[1]
    assert codes.shape[1] == 5 and _same(outputs[1], outputs[0])
    assert (codes[:, :, start + n:] == 0xAA).all() and not (codes[:, 3:, start : start + n] == 0xAA).all()
    rows = slice(start, start + n)
    stored = x.float()  # what each head quantized: the 2-bit head's token-wise rows clipped first
    if chunk:
        view = Packed(codes[:, :, rows], meta[:, start // chunk : (start + n) // chunk], fmt)
        four = quantize(stored, StreamFormat(h, d, 4, "channel", blocks=blocks, chunk=chunk))
    else:
        view = Packed(codes[:, :, rows], meta[:, :, rows], fmt)
        four = quantize(stored, StreamFormat(h, d, 4))
        stored[:, 1] = clip_rows(stored[:, 1], 0.9)
    got, want = dequantize(view), dequantize(four)
    assert torch.allclose(got[:, [0, 2]], want[:, [0, 2]], atol=1e-3)  # the wide heads: an unclipped 4-bit one
    error = (got - stored).abs().mean((0, 2, 3))
    four_bit_error = (dequantize(quantize(stored, four.fmt)) - stored).abs().mean((0, 2, 3))
    assert error[1] > 3 * four_bit_error[1]  # the 2-bit head
    at = _fresh(fmt, b, cap)
    ops.quantize_pack_at(x, *at, torch.tensor([start]), fmt, kernel=True)
    assert _same(at, outputs[0])  # the device-start op writes the same


def _signed_permutations(h, d, gen):
    """`[h, d, d]` random signed permutations: rotations whose products are exact in any summation order, so that a
    rotating kernel can be held to its twin bit for bit."""
    rot = torch.zeros(h, d, d)
    for head in range(h):
        signs = torch.randint(0, 2, (d,), generator=gen).float() * 2 - 1
        rot[head, torch.arange(d), torch.randperm(d, generator=gen)] = signs
    return rot


def _exact_block_means(meta, rows, fmt, first_chunk):
    """`meta` (channel-wise keys of the rows `rows` `[B, H, L, d]` in format `fmt`, written from chunk `first_chunk`
    on) with its wide key channels' mean slots set to the exact block means: float64 sums (exact for 16-bit values),
    divided by the block, rounded to float32 and then to the meta dtype, what the kernel stores. The twin's float32
    `mean` (`quant.quantize_wide_channels`) sums in torch's order and is a float32 ulp off where that sum is inexact
    (so at most an ulp of the meta dtype after its rounding); elsewhere this changes nothing."""
    meta = meta.clone()
    finfo = torch.finfo(meta.dtype)
    b, _, length, d = rows.shape
    chunk = fmt.chunk
    for head, (block, offset) in enumerate(zip(fmt.blocks, fmt.offsets)):
        n = fmt.wide_channels[head]
        if not n:
            continue
        own = rows[:, head, :, d - n :].double().reshape(b, length // chunk, chunk // block, block, n)
        mean = (own.sum(3) / block).float().clamp(finfo.min, finfo.max).to(meta.dtype)
        rows_meta = slice(first_chunk, first_chunk + length // chunk)
        twin_mean = meta[:, rows_meta, offset : offset + chunk // block, d - n :, 1]
        assert torch.allclose(twin_mean.float(), mean.float(), rtol=finfo.eps, atol=0)  # at most the last bit apart
        meta[:, rows_meta, offset : offset + chunk // block, d - n :, 1] = mean
    return meta


@pytest.mark.parametrize("d,blocks,counts,head_bits,rotation,scale_dtype", [
    (64, (64, 32, 128), (5, 0, 17), None, None, "float16"),
    (128, (64, 32, 128), (5, 0, 64), None, "permutation", "float32"),  # n = d/2: every slot of head 2 paired
    (64, (64, 32, 128), (0, 3, 32), (4, 2, 2), "permutation", "float32"),  # a wide head (n = 0) beside them
    (64, (32, 64), (17, 1), None, "orthogonal", "float16"),  # rotated in the kernel: last bits may differ there
])
def test_quantize_pack_writes_wide_key_channels_like_its_twin(d, blocks, counts, head_bits, rotation, scale_dtype):
    """Wide key channels (`quant.quantize_wide_channels`): per block, channels j < n at 4 bits, the high plane in
    slot j under (4·s_j, m_j), the low plane in slot d − n + j under (s_j, μ), μ that slot's own channel's block
    mean; written bit for bit as the twin writes them by `quantize_pack` (rotating or not), by `quantize_pack_at`
    from a device start, and from a ring of rows read in place (the chunk at 256 wraps: ring slots 96..159 then 0)."""
    g = torch.Generator().manual_seed(d + sum(counts))
    h, b, chunk, start, cap = len(blocks), 2, 128, 128, 512
    n = 2 * chunk
    fmt = _channels(blocks, chunk, d, wide_rows=wide_rows(head_bits) if head_bits else (), wide_channels=counts,
                    scale_dtype=scale_dtype)
    x = (torch.randn(b, h, n, d, generator=g) * torch.randn(d, generator=g).exp() + torch.randn(d, generator=g))
    x = x.to(torch.bfloat16)
    rot = None
    if rotation == "permutation":
        rot = _signed_permutations(h, d, g).to(torch.bfloat16)
    elif rotation == "orthogonal":
        rot = torch.linalg.qr(torch.randn(h, d, d, generator=g))[0].to(torch.bfloat16)
    rows = x if rot is None else torch.matmul(x, rot)  # the twin's rotated rows

    expected = _fresh(fmt, b, cap)
    quantize_pack_reference(x, rot, *expected, start, fmt)
    expected = expected[0], _exact_block_means(expected[1], rows.float(), fmt, start // chunk)
    got = _fresh(fmt, b, cap)
    ops.quantize_pack(x, rot, *got, start, fmt, kernel=True)
    written = (slice(None), slice(None), slice(start, start + n))
    chunks = slice(start // chunk, (start + n) // chunk)
    if rotation != "orthogonal":
        assert _same(got, expected)
    else:  # the kernel's x·R may round its last bit elsewhere: the keys read back agree but for a few steps
        assert torch.equal(got[1].isnan(), expected[1].isnan())
        assert torch.allclose(got[1].nan_to_num().float(), expected[1].nan_to_num().float(), rtol=1e-2, atol=1e-3)
        keys = [dequantize(Packed(c[written], m[:, chunks], fmt)) for c, m in (got, expected)]
        assert ((keys[0] - keys[1]).abs() > 1e-3).float().mean() <= 0.01
    # the slots really hold the layout: without it the keys read back are far off (head 0's 4-bit channels, the
    # last head's means)
    view = Packed(expected[0][written], expected[1][:, chunks], fmt)
    plain = Packed(view.codes, view.meta, dataclasses.replace(fmt, wide_channels=()))
    assert (dequantize(view) - dequantize(plain)).abs().max() > 0.1

    at = _fresh(fmt, b, cap)
    ops.quantize_pack_at(rows, *at, torch.tensor([start]), fmt, kernel=True)
    assert _same(at, expected)
    # a ring of 160 slots with history rows 256..383 at slots j mod 160 (96..159, then 0..63): read in place
    ring, first = 160, 256
    ring_buf = torch.randn(b, h, ring, d, generator=g).to(rows.dtype)
    ring_buf[:, :, (first + torch.arange(chunk)) % ring] = rows[:, :, chunk:]
    twin_bufs = _fresh(fmt, b, cap)
    quantize_pack_reference(rows[:, :, chunk:], None, *twin_bufs, first, fmt)
    expected = twin_bufs[0], _exact_block_means(twin_bufs[1], rows[:, :, chunk:].float(), fmt, first // chunk)
    for kernel, want in ((False, twin_bufs), (True, expected)):
        got = _fresh(fmt, b, cap)
        ops.quantize_pack_at(ring_buf, *got, torch.tensor([first]), fmt, ring=ring, kernel=kernel)
        assert _same(got, want), kernel


def test_key_block_tables_are_made_once_per_layout():
    """The attention and quantize launchers read each head's (block, first row) from a device table made on the first
    call and reused afterwards: a launch inside CUDA-graph capture must not create a tensor."""
    from oscar_hf.kernels.quantize import key_block_table

    table = key_block_table([32, 128, 64], 128, torch.device("cpu"))
    assert table.dtype == torch.int32 and table.tolist() == [[32, 0], [128, 4], [64, 5]]
    assert key_block_table((32, 128, 64), 128, torch.device("cpu")) is table
    with pytest.raises(ValueError, match="divide"):
        key_block_table([48], 128, torch.device("cpu"))


# ------------------------------------------------------------------------------------------ segment_attention
@pytest.mark.parametrize("case", [
    dict(t=1, g=4, d=128),                       # decode, GQA 4
    dict(b=1, t=1, g=8, d=64, nh=200),           # decode, GQA 8, several history tiles
    dict(b=1, t=5, g=2, d=64, groups=2),         # a short chunk, two scale groups per row
    dict(b=1, t=3, g=1, d=128, ne=70, nr=4, groups=4),  # a long chunk in the extra segment, causal inside it
    dict(b=1, t=1, g=4, d=64, nh=0, mask=False),  # no history yet
    dict(t=2, g=2, d=64, ns=5, nh=0, nr=0),      # batch row 0 is all padding: fully masked rows give 0 and -inf
    dict(t=1, g=4, d=128, nh=256, key_blocks=128, key_chunk=128),  # channel-wise keys: two blocks, decode
    dict(b=1, t=3, g=2, d=64, nh=96, key_blocks=32, key_chunk=32, groups=2),  # channel-wise keys, tiles smaller than the default
    dict(b=1, t=1, g=4, d=128, nh=256, key_blocks=(32, 128), key_chunk=128),  # per-head blocks: head 1 reads 4 rows per chunk
    dict(b=1, t=1, g=2, d=64, h=4, nh=256, key_blocks=(128, 64, 32, 128), key_chunk=128),  # 4 heads, R = 1 + 2 + 4 + 1
    dict(b=1, t=1, g=4, d=64, h=2, nh=256, key_blocks=(64, 64), key_chunk=128),  # the default micro layout: tiles of 64
    dict(b=1, t=5, g=2, d=128, nh=256, key_blocks=(128, 64), key_chunk=128, groups=2),  # a short chunk, per-head blocks
    dict(b=1, t=9, g=2, d=64, h=4, nh=128, key_blocks=(128, 64, 32, 128), key_chunk=128),  # 64-row query tiles
    dict(b=1, t=1, g=2, d=64, h=3, nh=96, key_blocks=(32, 16, 32), key_chunk=32),  # tiles of 32, head 1 split in two 16s
    # wide heads (4 bits as two 2-bit planes): the decode loop with a split wide head, the plain loop of 64-row query
    # tiles with two wide heads, head_dim 256
    dict(t=1, g=4, d=128, nh=256, key_blocks=(32, 128), key_chunk=128, head_bits=(4, 2)),
    dict(b=1, t=9, g=2, d=64, h=3, nh=128, key_blocks=(128, 64, 32), key_chunk=128, head_bits=(4, 2, 4)),
    dict(b=1, t=1, g=2, d=256, h=2, nh=128, key_blocks=(64, 128), key_chunk=128, head_bits=(2, 4)),
])
def test_segment_attention_kernel_matches_the_twin(case, kernels_on):
    args, _ = random_segments(dtype=torch.bfloat16, seed=len(case), **case)
    out, lse = ops.segment_attention(*args)
    _, valid, _ = _check_segment_kernel(args, out, lse)
    if case.get("ns") == 5 and case.get("nh") == 0:
        assert not valid.all()  # this case exists to check the empty rows


@pytest.mark.parametrize("case", [
    # decode over per-head blocks (split tiles, the 32-bit meta-word loop), n up to d/2
    dict(t=1, g=4, d=64, h=3, nh=256, key_blocks=(64, 32, 128), key_chunk=128, wide_channels=(5, 0, 17)),
    dict(b=1, t=1, g=2, d=128, h=2, nh=128, key_blocks=(32, 128), key_chunk=128, wide_channels=(64, 3)),
    # a prefill chunk with extra keys (64-row query tiles: the plain loop), a wide head beside heads with channels
    dict(b=1, t=9, g=2, d=64, h=3, nh=128, ne=20, key_blocks=(128, 64, 32), key_chunk=128, head_bits=(4, 2, 2),
         wide_channels=(0, 32, 3)),
])
def test_segment_attention_reads_wide_key_channels_like_its_twin(case, kernels_on):
    """Wide key channels: slot c's scaled code meets the query of channel π(c), its minimum q_c itself; the kernel
    agrees with the twin within the tolerance of the other cases, and reading the same bytes without the wide
    channels does not (the layout matters in these cases)."""
    args, _ = random_segments(dtype=torch.bfloat16, seed=2, **case)
    out, lse = ops.segment_attention(*args)
    ref, valid, tolerance = _check_segment_kernel(args, out, lse)
    q, seg, fmt = args[:3]
    plain_fmt = _without_wide_channels(fmt)
    hk = seg.history_keys
    plain_seg = dataclasses.replace(seg, history_keys=Packed(hk.codes, hk.meta, plain_fmt.keys))
    plain, _ = ops.segment_attention(q, plain_seg, plain_fmt, *args[3:])
    assert (plain.double() - ref.double())[valid].abs().max().item() > 3 * tolerance


def test_wide_key_channels_with_token_wise_keys_are_refused():
    """Wide key channels are a layout of channel-wise keys: a token-wise `StreamFormat` refuses them, and with
    token-wise keys every launcher raises on its flat arguments, as it does for counts a format refuses."""
    with pytest.raises(ValueError, match="channel-wise"):
        StreamFormat(2, 64, 2, wide_channels=(3, 0))
    x = torch.randn(1, 2, 8, 64, dtype=torch.bfloat16)
    codes, meta = _fresh(StreamFormat(2, 64, 2), 1, 8)
    with pytest.raises(ValueError, match="channel-wise"):
        quantize_pack_triton(x, None, 0.9, codes, meta, 0, wide_channels=[3, 0])
    with pytest.raises(ValueError, match="channel-wise"):
        torch.ops.oscar.quantize_pack(x, None, 0.9, codes, meta, 0, [], 0, [], [3, 0])
    flat = _flat_segments(random_segments(t=1, g=2, d=64, nh=16)[0])
    with pytest.raises(ValueError, match="channel-wise"):
        segment_attention_triton(*flat[:22], [3, 0])
    static = _flat_decode(_static_buffers(b=1, g=2, t=1, d=64, h=2, capacity=64, n_hist=40, ring=8, n_recent=4,
                                          ring_lo=2, blocks=(), chunk=0, seed=1))
    with pytest.raises(ValueError, match="channel-wise"):
        decode_attention_triton(*static[:15], wide_rows=static[15], wide_channels=[0, 5])
    # counts out of [0, d/2], or given to a wide head
    keys = torch.zeros(1, 2, 32, 16, dtype=torch.uint8), torch.zeros(1, 1, 2, 64, 2, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"in \[0, 32\]"):
        quantize_pack_triton(x.repeat(1, 1, 4, 1), None, 1.0, *keys, 0, [32, 32], 32, wide_channels=[33, 0])
    wide_codes = torch.zeros(1, 3, 32, 16, dtype=torch.uint8)
    with pytest.raises(ValueError, match="0 for the wide heads"):
        quantize_pack_triton(x.repeat(1, 1, 4, 1), None, 1.0, wide_codes, keys[1], 0, [32, 32], 32, wide_rows=[2, -1],
                             wide_channels=[3, 0])


@pytest.mark.parametrize("block_n,blocks,tile,split_tile_max", [
    (128, (32, 64, 128, 64), (64, True), None),  # calibration's mix: tiles of 64, heads of 32 read two rows a tile
    (128, (128, 64, 32, 128), (64, True), None),
    (128, (32, 128), (64, True), None),
    (128, (64, 128), (64, False), None),    # split tiles of 128 measured slower than tiles of 64: the default stops at 64
    (128, (64, 128), (128, True), 128),     # twice the smallest block, up to block_n and split_tile_max
    (64, (64, 128), (64, False), 128),      # block_n already holds the smallest block: no split
    (128, (32, 16, 32), (32, True), None),
    (128, (16, 64), (32, True), None),
    (32, (32, 16), (32, True), None),
    (128, (32, 32), (32, False), None),     # uniform blocks: every head would split, so none does
    (128, (64, 64), (64, False), None),
    (128, (16, 16), (16, False), None),
    (128, (128, 384), (128, False), None),
    (128, (64, 384), (64, False), None),
    (128, (64, 384), (128, True), 128),
    (128, (128, 64, 384), (128, True), 128),
    (256, (128, 384), (128, False), 256),   # 384 is not a multiple of 256: tiles of 256 would straddle its blocks
])
def test_key_tile_is_twice_the_smallest_block_when_blocks_mix(block_n, blocks, tile, split_tile_max):
    """`key_tile`: the key tile of a launch and whether heads of the smallest block split each tile in two. Every
    head's block is then the tile, a multiple of it, or half of it, and the tile divides the chunk (a multiple of the
    largest block)."""
    assert key_tile(block_n, blocks, split_tile_max) == tile
    n, split = tile
    for bk in blocks:
        assert bk % n == 0 or (split and 2 * bk == n)


def test_split_tiles_of_128_give_the_same_attention(monkeypatch):
    """Split tiles up to block_n (`split_tile_max` 128, an experiment's launch): heads of 64 read two rows per tile of
    128, on the decode loop and on the plain loop of 64-row query tiles."""
    from oscar_hf.kernels.attention import DEFAULT_LAUNCH

    monkeypatch.setitem(DEFAULT_LAUNCH, "split_tile_max", 128)
    assert key_tile(128, (64, 128)) == (128, True)
    for t in (1, 9):
        args, _ = random_segments(b=1, t=t, g=2, d=64, h=3, nh=256, key_blocks=(128, 64, 128), key_chunk=128,
                                  dtype=torch.bfloat16, seed=8)
        _check_segment_kernel(args, *segment_attention_triton(*_flat_segments(args), block_n=128))


def test_register_cap_applies_to_the_counted_decode_tile_only(monkeypatch):
    """The default cap (168 registers: 3 programs of 4 warps per SM) goes to the decode tile of the default layout at
    head_dim 128, whose registers and spills eval/compile_kernels.py counted; other tiles and the register-prefetching
    loop (which spills under it) keep the compiler's choice, and an explicit `maxnreg` caps every launch."""
    from oscar_hf.kernels.attention import DEFAULT_LAUNCH, register_cap

    assert register_cap(True, False, 128) == DEFAULT_LAUNCH["decode_maxnreg"] == 168
    assert register_cap(True, False, 64) is None and register_cap(False, False, 128) is None
    assert register_cap(True, True, 128) is None
    monkeypatch.setitem(DEFAULT_LAUNCH, "maxnreg", 128)
    assert register_cap(False, False, 64) == register_cap(True, True, 128) == 128


@pytest.mark.parametrize("prefetch,l2_ahead", [(False, 0), (True, 0), (False, 2)])
def test_each_history_loop_of_the_default_layout_gives_the_same_attention(prefetch, l2_ahead):
    # the plain loop (16-bit meta), the register-prefetching loop and the loop that leaves loads in place (L2 hint
    # off in the interpreter) over (scale, minimum) words: one answer, several splits, per-head blocks
    args, _ = random_segments(b=1, t=1, g=4, d=128, h=3, nh=384, key_blocks=(64, 32, 128), key_chunk=128,
                              dtype=torch.bfloat16, seed=5)
    out, lse = segment_attention_triton(*_flat_segments(args), target_programs=3, prefetch=prefetch,
                                        l2_ahead=l2_ahead)
    _check_segment_kernel(args, out, lse)


def test_many_splits_merge_exactly():
    args, _ = random_segments(b=1, t=1, g=4, d=64, nh=300, dtype=torch.bfloat16, seed=3)
    one, lse1 = segment_attention_triton(*_flat_segments(args), target_programs=1)
    many, lse2 = segment_attention_triton(*_flat_segments(args), block_n=16, target_programs=64)
    assert torch.allclose(one.float(), many.float(), atol=2e-2)
    assert torch.allclose(lse1, lse2, atol=1e-3)


@pytest.mark.parametrize("block_n", [32, 64, 128])
@pytest.mark.parametrize("min_tiles", [1, 4, 8])
def test_split_plan_covers_every_row_once_at_decode_sizes(block_n, min_tiles):
    """`plan_splits` at the sizes a GPU decode step plans (up to 131K rows, 132 SMs x 12 programs), which the
    interpreter tests never reach: whole key tiles per split, every history and extra row in exactly one non-empty
    split, at least `min_tiles` tiles per split where the history has them, and no more programs than the target
    asks for, give or take one split per (batch, head)."""
    from oscar_hf.kernels.attention import plan_splits

    for batch_heads in (1, 8, 64, 256):
        for n_hist in (0, 1, 63, 64, 65, 4096, 32_512, 100_000, 131_072):
            for n_extra in (0, 1, 300):
                for target in (1, 132, 1584, 3168):
                    hs, hc, es, ec = plan_splits(batch_heads, 1, n_hist, n_extra, block_n, target, min_tiles)
                    case = (batch_heads, n_hist, n_extra, target, hs, hc, es, ec)
                    assert hc % block_n == 0 and ec % block_n == 0 and hs >= 1, case
                    if n_hist:
                        assert (hs - 1) * hc < n_hist <= hs * hc, case
                        assert hc >= min(min_tiles * block_n, -(-n_hist // block_n) * block_n), case
                        assert batch_heads * hs < max(target, batch_heads) + batch_heads, case
                    else:
                        assert hs == 1, case
                    if n_extra:
                        assert (es - 1) * ec < n_extra <= es * ec, case
                    else:
                        assert es == 0, case


def test_merge_in_chunks_gives_the_one_tile_merge(monkeypatch):
    """Beyond `MERGE_TILE` elements the merge reads the splits' partial outputs in chunks (one [splits, d] float32
    tile would spill: one KV head at batch 1 has about 1,600 splits): the one-tile merge's output and lse, and the
    twin's."""
    from oscar_hf.kernels import attention as att

    args, _ = random_segments(b=1, h=1, t=1, g=4, d=64, nh=300, nr=40, dtype=torch.bfloat16, seed=3)
    flat = _flat_segments(args)
    whole, lse_whole = segment_attention_triton(*flat, block_n=16, target_programs=64)
    monkeypatch.setattr(att, "MERGE_TILE", 16 * 64)  # anything beyond 16 splits of d = 64
    monkeypatch.setattr(att, "MERGE_CHUNK", 16 * 64)
    plain_merge_chunk, chosen = att.merge_chunk, []

    def recorded_merge_chunk(block_s, d):
        chosen.append((block_s, plain_merge_chunk(block_s, d)))
        return chosen[-1][1]

    monkeypatch.setattr(att, "merge_chunk", recorded_merge_chunk)
    chunked, lse_chunked = segment_attention_triton(*flat, block_n=16, target_programs=64)
    assert chosen and all(chunk == 16 < block_s for block_s, chunk in chosen), chosen  # several chunks per row
    assert torch.allclose(chunked.float(), whole.float(), atol=1e-2) and torch.allclose(lse_chunked, lse_whole, atol=1e-5)
    _check_segment_kernel(args, chunked, lse_chunked)


def test_a_long_recent_window_splits_like_the_history():
    """The BF16 recent window is split into tiles of about a history split's work (`recent_split_plan`), so a short
    history does not leave the whole window to one program: several recent splits give the one-split answer."""
    from oscar_hf.kernels.attention import recent_split_plan

    assert recent_split_plan(384, 64, 64) == (6, 64)
    assert recent_split_plan(384, 512, 64) == (1, 384)
    assert recent_split_plan(0, 64, 64) == (1, 64)
    args, _ = random_segments(b=1, t=1, g=4, d=64, nh=64, nr=200, dtype=torch.bfloat16, seed=6)
    one, lse1 = segment_attention_triton(*_flat_segments(args), target_programs=1)
    many, lse2 = segment_attention_triton(*_flat_segments(args), block_n=16, target_programs=64)
    for out, lse in ((one, lse1), (many, lse2)):
        _check_segment_kernel(args, out, lse)
    assert torch.allclose(one.float(), many.float(), atol=2e-2)
    assert torch.allclose(lse1, lse2, atol=1e-3)


def test_custom_ops_have_consistent_fake_implementations():
    """Every custom op's schema (what it mutates) and fake implementation (what `torch.compile` traces), on small
    token-wise and channel-wise layouts with wide heads and wide key channels."""
    args, _ = random_segments(b=1, t=1, g=2, d=64, nh=20, dtype=torch.bfloat16, seed=4)
    torch.library.opcheck(torch.ops.oscar.segment_attention.default, _flat_segments(args),
                          test_utils=("test_schema", "test_faketensor"))
    args, _ = random_segments(b=1, t=1, g=2, d=64, h=3, nh=64, key_blocks=(32, 16, 64), key_chunk=64,
                              dtype=torch.bfloat16, seed=4, head_bits=(2, 4, 2), wide_channels=(5, 0, 17))
    torch.library.opcheck(torch.ops.oscar.segment_attention.default, _flat_segments(args),
                          test_utils=("test_schema", "test_faketensor"))
    # queries laid out heads-outermost, as a compiled forward can hand them over: the output is contiguous all the
    # same (a fake that copied the queries' strides failed inductor's stride assertion on an H100)
    args, _ = random_segments(b=2, t=3, g=2, d=64, h=2, nh=20, dtype=torch.bfloat16, seed=4)
    flat = _flat_segments(args)
    q = flat[0].transpose(0, 1).contiguous().transpose(0, 1)
    assert q.equal(flat[0]) and q.stride() != flat[0].stride()
    torch.library.opcheck(torch.ops.oscar.segment_attention.default, (q, *flat[1:]),
                          test_utils=("test_schema", "test_faketensor"))
    args = _static_buffers(b=1, g=2, t=1, d=64, h=2, capacity=128, n_hist=64, ring=8, n_recent=6, ring_lo=5,
                           blocks=(32, 64), chunk=64, seed=4, head_bits=(4, 2), wide_channels=(0, 5))
    rotation = torch.linalg.qr(torch.randn(2, 64, 64, generator=torch.Generator().manual_seed(4)))[0]
    for value_rotation in (None, rotation.to(torch.bfloat16)):
        torch.library.opcheck(torch.ops.oscar.decode_attention.default, _flat_decode(args, value_rotation),
                              test_utils=("test_schema", "test_faketensor"))
    x = torch.randn(1, 1, 8, 64, dtype=torch.bfloat16)
    codes, meta = _fresh(StreamFormat(1, 64, 2), 1, 8)
    torch.library.opcheck(torch.ops.oscar.quantize_pack.default, (x, None, 0.9, codes, meta, 0, [], 0, [], []),
                          test_utils=("test_schema", "test_faketensor"))
    x = torch.randn(1, 2, 32, 64, dtype=torch.bfloat16)
    codes, meta = _fresh(_channels((32, 16), 32), 1, 64)  # blocks (32, 16) in chunks of 32: R = 3
    assert meta.shape[2] == 3
    torch.library.opcheck(torch.ops.oscar.quantize_pack.default, (x, None, 1.0, codes, meta, 32, [32, 16], 32, [], []),
                          test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(torch.ops.oscar.quantize_pack_at.default,
                          (x, 1.0, codes, meta, torch.tensor([32]), [32, 16], 32, 0, [], []),
                          test_utils=("test_schema", "test_faketensor"))


# ------------------------------------------------------------------------------------------ a model, end to end
def _with_wide_heads(rotations, head_bits):
    """`rotations` with the same wide heads in every layer (as calibration would store them)."""
    rotations.head_bits = {layer: tuple(head_bits) for layer in rotations.layers}
    rotations._check_consistency()
    return rotations


def _kernel_model():
    """The smallest model the kernels read: one layer, 2 KV heads of dim 64 (the kernels' minimum), GQA 2."""
    from conftest import tiny_model

    return tiny_model("llama", dtype=torch.bfloat16, hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=64, num_hidden_layers=1, intermediate_size=64)


def test_a_model_through_the_kernels_matches_the_torch_path(monkeypatch):
    """`OscarCache` (growable) with the kernels against the torch twins, channel-wise keys with one wide head and
    one 2-bit head: a prefill, a chunk onto the stored past (segment attention over sink | ring | chunk, a key block
    completed from the ring and the chunk), a decode step over the growable buffers, then a chunk that reads the
    2-bit history (segment attention over sink | history | ring | chunk); a left-padded row."""
    from conftest import VOCAB
    from oscar_hf import OscarCache, OscarConfig, OscarRotations

    config = OscarConfig(sink_tokens=4, window_tokens=8, demotion_block=16, key_block=16, value_clip=0.9)
    ids = torch.randint(3, VOCAB, (2, 36), generator=torch.Generator().manual_seed(7))
    mask = torch.ones_like(ids)
    mask[1, :6] = 0
    logits, stored = {}, {}
    for mode in ("0", "1"):
        monkeypatch.setenv("OSCAR_HF_KERNELS", mode)
        model = _kernel_model()
        cache = OscarCache(model, _with_wide_heads(OscarRotations.data_free(model, "hadamard"), (2, 4)), config)
        assert cache.layers[0].fmt.keys.wide_rows == (-1, 2)
        out = []
        with torch.no_grad():
            for a, b in [(0, 10), (10, 30), (30, 31), (31, 36)]:
                out.append(model(input_ids=ids[:, a:b], attention_mask=mask[:, :b], past_key_values=cache).logits.float())
                if b == 30:
                    assert int(cache.plan.lengths[1]) == 16  # the history is read from here on
        assert cache.layers[0].kernel == (mode == "1")
        logits[mode] = torch.cat(out, 1)
        stored[mode] = cache.layers[0].stored_states()
    ref = logits["0"]
    assert (logits["1"] - ref).abs().max() / ref.abs().max() < 0.05
    for got, want in zip(stored["1"], stored["0"]):  # the same cache contents, within a bf16 rounding
        assert (got.float() - want.float()).abs().max() <= 0.02 * want.float().abs().max()


def test_a_layer_makes_the_kernels_tables_with_its_buffers(monkeypatch):
    """The kernels' per-layout device tables are made when a layer allocates its buffers, so that no launch makes
    one: inside a compiled forward in reduce-overhead mode, the first launch put one in the CUDA graphs' memory pool,
    which cudagraph trees refused (on an H100, when that test ran first)."""
    from conftest import VOCAB
    from oscar_hf import OscarConfig, OscarRotations, StaticOscarCache
    from oscar_hf.kernels import quantize as kq

    for name in ("_KEY_BLOCK_TABLES", "_WIDE_TABLES", "_WIDE_CHANNEL_TABLES"):
        monkeypatch.setattr(kq, name, {})
    monkeypatch.setenv("OSCAR_HF_KERNELS", "1")
    model = _kernel_model()
    config = OscarConfig(sink_tokens=4, window_tokens=8, demotion_block=16, key_block=16, value_clip=0.9)
    cache = StaticOscarCache(model, _with_wide_heads(OscarRotations.data_free(model, "hadamard"), (2, 4)), config,
                             max_cache_len=48)
    empty = torch.zeros(1, 2, 0, 64, dtype=torch.bfloat16)
    cache.layers[0].lazy_initialization(empty, empty)
    assert cache.layers[0].kernel
    made = {name: dict(getattr(kq, name)) for name in ("_KEY_BLOCK_TABLES", "_WIDE_TABLES")}
    assert all(made.values()), made  # channel-wise key blocks, one wide head
    with torch.no_grad():
        ids = torch.randint(3, VOCAB, (1, 20), generator=torch.Generator().manual_seed(0))
        model(input_ids=ids, past_key_values=cache)  # a prefill: quantize_pack and segment_attention
    for name, tables in made.items():
        assert getattr(kq, name).keys() == tables.keys(), name


@pytest.mark.parametrize("layout", ["token", "channel"])
def test_a_static_cache_decode_through_the_kernels_matches_the_torch_path(monkeypatch, layout):
    """StaticOscarCache's decode steps with the kernels (`rotate_store_token`, the value and key-block writes from
    the ring in place, `decode_attention` with the output un-rotated in the merge) against the torch twins: a prefill,
    single tokens across the sink boundary, a chunk (a key block completed from the ring and the chunk), then single
    tokens across a key-block completion and the ring's wrap-around; a left-padded row. The channel-wise layout has
    one wide head and one 2-bit head, so one run covers both."""
    from conftest import VOCAB
    from oscar_hf import OscarConfig, OscarRotations, StaticOscarCache

    # S 4, W 8, b 16: ring R = W + 2b = 40 (position p >= 4 at slot (p - 4) mod 40); key blocks complete at 28, 44
    config = OscarConfig(sink_tokens=4, window_tokens=8, demotion_block=16, key_block=16, value_clip=0.95,
                         **({"key_granularity": "token", "key_clip": 0.9} if layout == "token" else {}))
    ids = torch.randint(3, VOCAB, (2, 45), generator=torch.Generator().manual_seed(8))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    # token 3 goes to the sink, 4 to the ring; the chunk brings 43 tokens (the key block of rows 0..15 at 28); token
    # 43 completes the block of rows 16..31 (L = 44), token 44 wraps the ring (slot 0)
    passes = [(0, 3), (3, 4), (4, 5), (5, 43), (43, 44), (44, 45)]
    logits, histories = {}, {}
    for mode in ("0", "1"):
        monkeypatch.setenv("OSCAR_HF_KERNELS", mode)
        model = _kernel_model()
        rotations = OscarRotations.data_free(model, "hadamard")
        if layout == "channel":
            rotations = _with_wide_heads(rotations, (4, 2))
        cache = StaticOscarCache(model, rotations, config, max_cache_len=48)
        layer = cache.layers[0]
        assert bool(layer.fmt.keys.wide_rows) == (layout == "channel")
        out = []
        with torch.no_grad():
            for a, b in passes:
                out.append(model(input_ids=ids[:, a:b], attention_mask=mask[:, :b], past_key_values=cache,
                                 position_ids=torch.arange(a, b).expand(2, -1)).logits.float())
                if b == 43:
                    before = layer.storage.keys.codes[:, :, 16:32].clone()
        assert layer.kernel == (mode == "1")
        if layout == "channel":  # the key block of rows 16..31 was written by the decode step that completed it
            assert not before.any() and layer.storage.keys.codes[:, :, 16:32].any()
        logits[mode] = torch.cat(out, 1)
        histories[mode] = layer.stored_states()
        # n_sink, n_hist, n_recent, ring_lo, q_start: the recent window at slots 32..39 then 0 of the ring of 40
        assert cache.plan.lengths.tolist() == [4, 32, 9, 32, 44]
    ref = logits["0"]
    assert (logits["1"] - ref).abs().max() / ref.abs().max() < 0.05
    for got, want in zip(histories["1"], histories["0"]):  # the same cache contents, within a bf16 rounding
        assert (got.float() - want.float()).abs().max() <= 0.02 * want.float().abs().max()


def test_transformers_imports_cleanly_from_the_repository_root():
    """From the checkout's root, `kernels` resolves to this folder; it must stay inert so transformers' probe for
    Hugging Face's `kernels` package neither crashes nor believes it is installed."""
    repo = Path(__file__).resolve().parents[1]
    code = ("import kernels, transformers.integrations.hub_kernels as hk; "
            "print(hk.is_kernels_available(), hasattr(kernels, 'segment_attention'))")
    out = subprocess.run([sys.executable, "-c", code], cwd=repo, capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False"]


def test_the_kernels_folder_does_not_shadow_huggingface_kernels(tmp_path):
    code = ("import importlib.util, oscar_hf.kernels as k; s = importlib.util.find_spec('kernels'); "
            "print(k.__name__); print(s.origin if s else None)")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True).stdout.split()
    assert out[0] == "oscar_hf.kernels"
    repo = Path(__file__).resolve().parents[1]
    assert out[1] == "None" or not out[1].startswith(str(repo)), out


def test_layouts_the_kernels_cannot_read_are_refused_by_name(monkeypatch):
    """`LayerFormat.kernel_problem` (`format.kernel_layout_problem`) names what the INT2 kernels cannot read;
    `ops.use_kernels` then takes the twins, or with OSCAR_HF_KERNELS=1 raises with that reason, and the launcher
    itself refuses the layout rather than compute it wrongly."""
    from oscar_hf import OscarConfig
    from oscar_hf.format import layer_format

    assert "4 quantization groups" in kernel_layout_problem(256, 8, 8, [])  # group_size 32 at head_dim 256
    assert "head_dim" in kernel_layout_problem(32, 1, 1, [])
    assert "key blocks" in kernel_layout_problem(128, 1, None, [64, 48])  # one head's block is enough
    assert kernel_layout_problem(128, 1, None, [64, 32, 384]) is None and kernel_layout_problem(64, 4, 4, []) is None
    assert "wide heads" in kernel_layout_problem(64, 1, 1, [], wide=True)
    small = dict(sink_tokens=4, window_tokens=8, demotion_block=192, key_block=64)
    assert layer_format(OscarConfig(**small), 2, 128).kernel_problem() is None
    assert "key blocks" in layer_format(OscarConfig(**small), 2, 128, key_blocks=(64, 48)).kernel_problem()
    assert "quantization groups" in layer_format(OscarConfig(group_size=32, **small), 2, 256).kernel_problem()
    assert "2-bit histories" in layer_format(OscarConfig(bits=4, **small), 2, 128).kernel_problem()
    args, _ = random_segments(t=1, g=2, d=64, nh=16, groups=8, dtype=torch.bfloat16)
    q, fmt = args[0], args[2]
    assert "quantization groups" in fmt.kernel_problem()
    with pytest.raises(ValueError, match="quantization groups"):  # the launcher itself never computes it wrongly
        segment_attention_triton(*_flat_segments(args))
    assert not ops.use_kernels(q, fmt)  # the CPU, kernels not forced: the twin
    monkeypatch.setenv("OSCAR_HF_KERNELS", "1")  # forced kernels: the op says why it cannot run, instead of a twin
    with pytest.raises(RuntimeError, match="quantization groups"):
        ops.segment_attention(*args)
    with pytest.raises(RuntimeError, match="bfloat16/float16"):
        ops.use_kernels(q.float(), fmt)
    with pytest.raises(RuntimeError, match="write 2-bit histories"):
        ops.use_kernels(q, StreamFormat(2, 64, 4))
    assert ops.use_kernels(q, StreamFormat(2, 64, 2)) and ops.use_kernels(q, _channels((64, 64), 128))
    monkeypatch.setenv("OSCAR_HF_KERNELS", "0")
    assert not ops.use_kernels(q, StreamFormat(2, 64, 2))


def test_fp16_states_through_the_kernel(kernels_on):
    args, _ = random_segments(t=2, g=4, d=64, nh=128, key_blocks=(32, 64), key_chunk=64, dtype=torch.float16, seed=5)
    out, lse = ops.segment_attention(*args)
    assert out.dtype == torch.float16
    _check_segment_kernel(args, out, lse)


# ------------------------------------------------------------------------------------------ decode_attention
@pytest.mark.parametrize("layout", ["channel", "token"])
def test_decode_kernel_reads_a_static_cache_like_its_twin(layout):
    """`decode_attention` on the fixed buffers of a filled StaticOscarCache (ring wrapped, blocks completed one step
    at a time, a left-padded row), lengths read on the device, against `decode_attention_reference`."""
    from conftest import tiny_model
    from oscar_hf import OscarConfig, OscarRotations, StaticOscarCache

    model = tiny_model("llama", dtype=torch.bfloat16, hidden_size=128, num_attention_heads=8, num_key_value_heads=2,
                       head_dim=64, num_hidden_layers=1)
    config = OscarConfig(sink_tokens=4, window_tokens=16, demotion_block=16, key_block=16, value_clip=0.95,
                         **({"key_granularity": "token", "key_clip": 0.9} if layout == "token" else {}))
    cache = StaticOscarCache(model, OscarRotations.data_free(model, "hadamard"), config, max_cache_len=200)
    layer = cache.layers[0]
    g = torch.Generator().manual_seed(11)
    cache.plan.advance(90)
    layer.store(*(torch.randn(2, 2, 90, 64, generator=g).to(torch.bfloat16) for _ in range(2)))
    for _ in range(70):  # key blocks complete on the way; the recent window ends up wrapped around the ring
        cache.plan.advance(1)
        layer._store_token(*(torch.randn(2, 2, 1, 64, generator=g).to(torch.bfloat16) for _ in range(2)))
    q = torch.randn(2, 2, 4, 64, generator=g).to(torch.bfloat16)
    mask = torch.ones(2, 200, dtype=torch.bool)
    mask[1, :9] = False
    args = (q, layer.decode_buffers(), layer.fmt, mask, cache.plan.lengths, 1, 0.125)
    assert ops._kernel_layout(layer.fmt.keys)[1] == (16 if layout == "channel" else 0)
    # n_sink, n_hist, n_recent, ring_lo, q_start: slots 32..47 then 0..11 of the ring of 48
    assert cache.plan.lengths.tolist() == [4, 128, 28, 32, 159]
    _check_decode_kernel(args, ops.decode_attention(*args, kernel=True))


def _static_buffers(b, h, g, t, d, capacity, n_hist, ring, n_recent, ring_lo, blocks, chunk, seed, head_bits=None,
                    wide_channels=()):
    """Random buffers of a static cache as `decode_attention` reads them: sink, a history of `capacity` rows (a whole
    number of chunks; channel-wise keys in `blocks` per head, or token-wise when `chunk` is 0; `head_bits`: wide
    heads; `wide_channels`: wide key channels per head) of which n_hist are valid, and a ring of `ring` slots holding
    n_recent tokens from slot ring_lo on (wrapped). Returns the op's arguments (q, buffers, format, key_mask,
    lengths, queries_per_group, scale)."""
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    n_sink = 4
    q = rnd(b, h, g * t, d).to(torch.bfloat16)
    sink_k, sink_v = rnd(b, h, n_sink, d).to(torch.bfloat16), rnd(b, h, n_sink, d).to(torch.bfloat16)
    raw = rnd(b, h, capacity, d) * rnd(1, 1, 1, d).exp() + 3 * rnd(1, 1, 1, d)
    wide = wide_rows(head_bits) if head_bits else ()
    values = StreamFormat(h, d, 2, wide_rows=wide)
    keys = _channels(blocks, chunk, d, wide_rows=wide, wide_channels=wide_channels) if chunk else values
    hk, hv = quantize(raw, keys), quantize(rnd(b, h, capacity, d), values)
    ring_k, ring_v = rnd(b, h, ring, d).to(torch.bfloat16), rnd(b, h, ring, d).to(torch.bfloat16)
    n = n_sink + capacity + ring
    mask = torch.ones(b, n, dtype=torch.bool)
    mask[-1, :9] = False  # a left-padded row
    q_start = n_sink + n_hist + n_recent - t
    lengths = torch.tensor([n_sink, n_hist, n_recent, ring_lo, q_start], dtype=torch.int32)
    buffers = DecodeBuffers(sink_k, sink_v, hk.codes, hk.meta, hv.codes, hv.meta, ring_k, ring_v)
    return q, buffers, LayerFormat(keys, values), mask, lengths, t, d ** -0.5


@pytest.mark.parametrize("case", [
    # n_hist ends inside a tile (and a chunk) of a history of whole chunks: the last tile is partial
    dict(d=64, h=4, t=1, capacity=384, n_hist=200, blocks=(128, 64, 32, 128), chunk=128),
    dict(b=1, d=128, h=2, t=1, capacity=256, n_hist=256, blocks=(32, 128), chunk=128),   # a full history
    # the split head's last tile (of 64) ends in its second block: 40 tokens of 64, rows 5 and 6 of chunk 1
    dict(b=1, d=64, h=3, t=1, capacity=256, n_hist=168, blocks=(64, 32, 128), chunk=128),
    dict(b=1, d=64, h=3, t=1, capacity=256, n_hist=144, blocks=(128, 64, 32), chunk=128),  # ... or in its first
    dict(b=1, d=64, h=2, t=1, capacity=256, n_hist=0, blocks=(32, 128), chunk=128),  # split heads, no history yet
    dict(b=1, d=128, h=2, t=3, capacity=256, n_hist=136, blocks=(64, 64), chunk=128),  # several query positions
    dict(b=1, d=64, h=2, t=1, capacity=192, n_hist=100, blocks=(), chunk=0),        # token-wise keys
    dict(b=1, d=128, h=3, t=1, capacity=256, n_hist=200, blocks=(64, 32, 128), chunk=128, head_bits=(2, 4, 4)),  # wide heads
    # wide key channels: split heads with n = 5 and 17, and n = d/2 beside a wide head, several query positions
    dict(d=64, h=3, t=1, capacity=256, n_hist=168, blocks=(64, 32, 128), chunk=128, wide_channels=(5, 0, 17)),
    dict(b=1, d=128, h=3, t=3, capacity=256, n_hist=200, blocks=(32, 64, 128), chunk=128, head_bits=(2, 4, 2),
         wide_channels=(64, 0, 3)),
])
def test_decode_kernel_reads_per_head_key_blocks_like_its_twin(case):
    """`decode_attention` on static-cache-shaped buffers (lengths on the device, ring wrapped) with each KV head's
    own key block, against `decode_attention_reference`."""
    args = _static_buffers(**{"b": 2, **case}, g=4, ring=24, n_recent=20, ring_lo=10,
                           seed=case["capacity"] + case["n_hist"])
    if case["chunk"] and len(set(case["blocks"])) > 1:  # the mixed blocks take the split tiles
        assert key_tile(128, case["blocks"])[1]
    out = ops.decode_attention(*args, kernel=True)
    ref, tolerance = _check_decode_kernel(args, out)
    if case.get("wide_channels"):  # the same bytes read without the wide channels: far off
        plain = ops.decode_attention(*args[:2], _without_wide_channels(args[2]), *args[3:], kernel=True)
        assert (plain.double() - ref.double()).abs().max().item() > 3 * tolerance


@pytest.mark.parametrize("d,position", [(64, 2), (128, 37), (64, 4), (256, 9)])
def test_rotate_store_token_writes_the_slot_its_twin_writes(d, position):
    """`rotate_store_token`: the token rotated (fp32 sums, one rounding, like the twin's matmul) into sink slot p
    (p < S) or ring slot (p − S) mod R, with the position read on the device; every other non-scratch slot of the
    four buffers untouched, the written slot and the returned rows the exact product within one bf16 rounding."""
    from oscar_hf.rotation import hadamard

    gen = torch.Generator().manual_seed(d + position)
    b, h, s, r = 2, 3, 4, 12
    keys = torch.randn(b, h, 1, d, generator=gen).to(torch.bfloat16)
    values = torch.randn(b, 1, h, d, generator=gen).to(torch.bfloat16).transpose(1, 2)  # strided, like v_proj's
    rk = torch.linalg.qr(torch.randn(h, d, d, generator=gen, dtype=torch.float64))[0].to(torch.bfloat16)
    rv = (hadamard(d).expand(h, d, d) * torch.tensor([1.0, -1.0, 1.0]).view(h, 1, 1)).to(torch.bfloat16)
    pos = torch.tensor(position, dtype=torch.int64)
    results = []
    for kernel in (False, True):
        buffers = [torch.randn(b, h, n, d, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
                   for n in (s + 1, s + 1, r + 1, r + 1)]
        out = ops.rotate_store_token(keys, values, rk, rv, *buffers, pos, s, r, kernel=kernel)
        results.append((out, [buf[:, :, :-1] for buf in buffers]))  # the scratch slots are the twin's alone
    (ref, ref_bufs), (out, bufs) = results
    expected = torch.stack([torch.matmul(keys.double(), rk.double()), torch.matmul(values.double(), rv.double())])
    assert out.shape == (2, b, h, 1, d) and out.dtype == torch.bfloat16
    # both round the float32 sum to nearest: half a bf16 ulp from the exact product, plus the float32 sums' own error
    half_ulp = expected.abs() * 2 ** -8 + 1e-6
    assert ((ref.double() - expected).abs() <= half_ulp).all()
    assert ((out.double() - expected).abs() <= half_ulp * 1.01).all()
    for got, want in zip(bufs, ref_bufs):  # same slot written, with the kernel's own rounding
        slot = position if position < s else (position - s) % r
        diff = (got.double() - want.double()).abs()
        assert (diff <= want.double().abs() * 2 ** -7 + 1e-6).all()
        untouched = torch.ones(got.shape[2], dtype=torch.bool)
        if (got.shape[2] == s) == (position < s):
            untouched[slot] = False
        assert torch.equal(got[:, :, untouched], want[:, :, untouched])
    if d == 64:
        torch.library.opcheck(torch.ops.oscar.rotate_store_token.default,
                              (keys, values, rk, rv, *[t.clone() for t in bufs], pos, s, r),
                              test_utils=("test_schema", "test_faketensor"))


def test_decode_kernel_un_rotates_its_output_in_the_merge():
    """`value_rotation`: the merge returns out·R_Vᵀ (float32, one rounding), what the twin computes."""
    d, h = 128, 2
    args = _static_buffers(b=2, g=4, t=1, d=d, h=h, capacity=256, n_hist=136, ring=24, n_recent=20, ring_lo=10,
                           blocks=(64, 64), chunk=128, seed=3)
    rot = torch.linalg.qr(torch.randn(h, d, d, generator=torch.Generator().manual_seed(4), dtype=torch.float64))[0]
    rot = rot.to(torch.bfloat16)
    ref = decode_attention_reference(*args, rot).double()
    plain = decode_attention_reference(*args).double()
    assert (ref - torch.einsum("bhmd,hed->bhme", plain, rot.double())).abs().max() < 2e-2  # it does un-rotate
    _check_decode_kernel(args, ops.decode_attention(*args, value_rotation=rot, kernel=True), rot)


def test_eager_calls_take_the_launchers_and_traced_calls_the_custom_ops(monkeypatch):
    """`ops.kernel_op`: outside dynamo the launcher itself (no dispatcher host work), the custom op while tracing or
    with OSCAR_HF_CUSTOM_OPS=1; every custom op has an eager stand-in that writes the same bytes, and the ops' format
    flattens into the custom op's arguments."""
    from oscar_hf.kernels import custom_ops

    names = [n for n in custom_ops.__all__ if n != "EAGER"]
    assert sorted(custom_ops.EAGER) == sorted(names)
    monkeypatch.delenv("OSCAR_HF_CUSTOM_OPS", raising=False)
    assert all(ops.kernel_op(n) is custom_ops.EAGER[n] for n in names)
    monkeypatch.setenv("OSCAR_HF_CUSTOM_OPS", "1")
    assert all(ops.kernel_op(n) is getattr(torch.ops.oscar, n) for n in names)
    monkeypatch.delenv("OSCAR_HF_CUSTOM_OPS")
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert all(ops.kernel_op(n) is getattr(torch.ops.oscar, n) for n in names)
    monkeypatch.undo()
    x = torch.randn(1, 2, 32, 64, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(3))
    fmt = _channels((32, 16), 32)
    assert ops._kernel_layout(fmt) == ([32, 16], 32, [], [])
    assert ops._kernel_layout(StreamFormat(2, 64, 2, wide_rows=(2, -1))) == ([], 0, [2, -1], [])
    written = []
    for use_custom_op in ("0", "1"):
        monkeypatch.setenv("OSCAR_HF_CUSTOM_OPS", use_custom_op)
        codes, meta = _fresh(fmt, 1, 64)
        ops.quantize_pack(x, None, codes, meta, 32, fmt, kernel=True)
        written.append((codes, meta))
    assert _same(written[0], written[1])
    assert not (written[0][0][:, :, 32:] == 0xAA).all() and not written[0][1][:, 1].isnan().any()


def test_more_programs_only_where_splits_stay_long():
    """`target_programs_for` asks for `programs_per_sm_long` per SM only where each history split keeps at least
    `long_split_tokens` tokens at that count, else `programs_per_sm` (132 SMs, the defaults)."""
    from oscar_hf.kernels.attention import DEFAULT_LAUNCH, target_programs_for

    few, many = DEFAULT_LAUNCH["programs_per_sm"] * 132, DEFAULT_LAUNCH["programs_per_sm_long"] * 132
    assert many > few
    splits = -(-many // 128)  # 128 (batch, head) pairs: 16 sequences of 8 KV heads
    edge = DEFAULT_LAUNCH["long_split_tokens"] * splits
    assert target_programs_for(128, edge, 132) == many
    assert target_programs_for(128, edge - 1, 132) == few
    assert target_programs_for(8, 100_000, 132) == few  # batch 1: splits of a few tiles at 24 per SM
    assert target_programs_for(256, 32_768, 132) == many
    assert target_programs_for(256, 8_192, 132) == few
