"""Split-K attention over OSCAR's segments, reading packed INT2 directly (Triton).

Stage 1 (`_segment_attention_kernel`), grid (batch·KV head, query-row tiles, splits): each program attends the query
rows of one KV head (its GQA group's query heads stacked, rows r = g·T + t) to one contiguous range of one segment —
the BF16 sink, a slice of the INT2 history, a slice of the BF16 recent window, or an extra BF16 segment (the current chunk of a
long prefill onto a filled cache) — with an online softmax, and writes its partial output and log-sum-exp.
The INT2 history is never dequantized into memory: a key row is k = c·s + m (codes c ∈ {0..3}, per-token scale s
and minimum m), so q·k = s·(q·c) + m·Σq, one `tl.dot` per quarter plane of the packed bytes; values likewise:
Σ_j p_j v_j = Σ_j (p_j s_j) c_j + Σ_j p_j m_j.
Channel-wise keys (the default) have one (scale, minimum) per channel per block of tokens, each KV head its own block
(`oscar_hf.format.StreamFormat`: meta `[B, n_chunks, R, d, 2]`, token t of head h at row
(t // chunk, offset_h + (t % chunk) // block_h)). A key tile (`key_tile`) is as wide as the smallest block, or, when
the heads' blocks mix (32, 64, 128 from calibration), twice as wide up to 64 tokens: a head whose block is a multiple
of the tile reads one meta row per tile and folds its per-channel scales into the query; a head whose block is half
the tile (`split`, a runtime branch per program) reads two rows and makes two sets of scaled-query dots over the same
unpacked codes, each token taking its half's scores. (With every tile at the smallest block, one head of 32 tokens
made decode 35-45% slower than uniform blocks of 64; split tiles take 12-19% off that, H200, 131K tokens.)
The per-head (block, offset) come from a small int32 device table (`quantize.key_block_table`, cached per layout and
device so that CUDA-graph capture creates no tensor).
Wide key channels (`oscar_hf.quant`, "wide key channels"; n per head from `quantize.wide_channel_table`): key
slot c of a head with n of them holds a code of channel π(c) (c, or c − (d − n) in the last n slots: the 4-bit
channels' low planes) under the slot's own (scale, minimum), so q·k̂ = Σ_c (q_π(c) s_c)·code_c + Σ_c q_c m_c: the
history loops take a second set of query planes, gathered by π once per program, for the scaled dots, and keep q for
the minima's term. Layers without (`WIDE_CHANNELS` off) pass the query planes themselves: the same code as before.
Codes become fp16 operands by the magic-number trick (see `_planes`: inline PTX, two codes per instruction), not by
int -> float conversions.
Stage 2 (`_merge_kernel`) merges the splits by log-sum-exp (FlashInfer's merge_state), exactly.

Masking: key positions are [sink | history | recent | extra] = [0, n_sink, n_sink+n_hist, ...]; query row r sits at
position q_start + (r mod T) and sees keys at positions <= its own (causal), where `key_mask[b, pos]` is True.
"""

from __future__ import annotations

import json
import math
import os

import torch
import triton
import triton.language as tl

from ..format import kernel_layout_problem
from . import cuda_history
from .quantize import key_block_table, key_rows_per_chunk, to_storage, wide_channel_table, wide_row_table

LOG2E = 1.4426950408889634
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _dot(a, b, UPCAST: tl.constexpr):
    # The Triton interpreter (CPU tests) mishandles 16-bit dot operands: give it float32.
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    return tl.dot(a, b)


@triton.jit
def _online_update(s, valid, m_i, l_i, acc0, acc1, acc2, acc3):
    s = tl.where(valid, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    return p, alpha, m_new, l_i, acc0 * alpha[:, None], acc1 * alpha[:, None], acc2 * alpha[:, None], acc3 * alpha[:, None]


@triton.jit
def _bf16_range(
    q0, q1, q2, q3, qpos, m_i, l_i, acc0, acc1, acc2, acc3,
    k_ptr, v_ptr, s_b, s_h, s_t, s_d, b, h, lo, hi, pos_offset,
    mask_ptr, smask_b, smask_n, scale,
    D: tl.constexpr, BLOCK_N: tl.constexpr, HAS_MASK: tl.constexpr, UPCAST: tl.constexpr,
):
    QD: tl.constexpr = D // 4
    dq = tl.arange(0, QD)
    base_k = k_ptr + b * s_b + h * s_h
    base_v = v_ptr + b * s_b + h * s_h
    for start in range(lo, hi, BLOCK_N):
        idx = start + tl.arange(0, BLOCK_N)
        ok = idx < hi
        rows = idx[:, None] * s_t
        k0 = tl.load(base_k + rows + (dq[None, :] + 0 * QD) * s_d, mask=ok[:, None], other=0.0)
        k1 = tl.load(base_k + rows + (dq[None, :] + 1 * QD) * s_d, mask=ok[:, None], other=0.0)
        k2 = tl.load(base_k + rows + (dq[None, :] + 2 * QD) * s_d, mask=ok[:, None], other=0.0)
        k3 = tl.load(base_k + rows + (dq[None, :] + 3 * QD) * s_d, mask=ok[:, None], other=0.0)
        s = (_dot(q0, tl.trans(k0), UPCAST) + _dot(q1, tl.trans(k1), UPCAST)
             + _dot(q2, tl.trans(k2), UPCAST) + _dot(q3, tl.trans(k3), UPCAST))
        valid = _valid_keys(ok, pos_offset + idx, qpos, b, mask_ptr, smask_b, smask_n, HAS_MASK)
        p, alpha, m_i, l_i, acc0, acc1, acc2, acc3 = _online_update(s * scale, valid, m_i, l_i, acc0, acc1, acc2, acc3)
        pv = p.to(k0.dtype)
        v0 = tl.load(base_v + rows + (dq[None, :] + 0 * QD) * s_d, mask=ok[:, None], other=0.0)
        v1 = tl.load(base_v + rows + (dq[None, :] + 1 * QD) * s_d, mask=ok[:, None], other=0.0)
        v2 = tl.load(base_v + rows + (dq[None, :] + 2 * QD) * s_d, mask=ok[:, None], other=0.0)
        v3 = tl.load(base_v + rows + (dq[None, :] + 3 * QD) * s_d, mask=ok[:, None], other=0.0)
        acc0 += _dot(pv, v0, UPCAST)
        acc1 += _dot(pv, v1, UPCAST)
        acc2 += _dot(pv, v2, UPCAST)
        acc3 += _dot(pv, v3, UPCAST)
    return m_i, l_i, acc0, acc1, acc2, acc3


# The PTX of `_planes` and `_wide_planes`, for 4 packed bytes in $8 (and a wide head's low-plane bytes in $9): a
# `prmt` orders the bytes [b0, b2, b1, b3] into t, so that t's 16-bit halves hold bytes 0 and 1 and u = t >> 8's
# hold bytes 2 and 3; output $i is the f16x2 pair of plane i // 2 from t (i even) or u (i odd), masked in place.
_PAIRS = [(src, 0x00030003 << (2 * plane)) for plane in range(4) for src in ("t", "u")]


def _planes_asm() -> str:
    lines = ["{", ".reg .b32 t, u, m;", "prmt.b32 t, $8, 0, 0x3120;", "shr.b32 u, t, 8;", "mov.b32 m, 0x64006400;"]
    lines += [f"lop3.b32 ${i}, {src}, {mask:#010x}, m, 0xEA;" for i, (src, mask) in enumerate(_PAIRS)]
    lines += [f"sub.f16x2 ${i}, ${i}, m;" for i in range(len(_PAIRS))]
    return "\n".join(lines + ["}"])


def _wide_planes_asm() -> str:
    lines = ["{", ".reg .b32 t, u, x, y, m, c, q, h, l;", "prmt.b32 t, $8, 0, 0x3120;", "shr.b32 u, t, 8;",
             "prmt.b32 x, $9, 0, 0x3120;", "shr.b32 y, x, 8;", "mov.b32 m, 0x64006400;",
             "mov.b32 c, 0x65006500;", "mov.b32 q, 0x34003400;"]  # 1024, 1280 and 1/4 as f16x2
    low = {"t": "x", "u": "y"}  # the low plane's bytes in the same order
    for i, (src, mask) in enumerate(_PAIRS):
        lines += [f"lop3.b32 h, {src}, {mask:#010x}, m, 0xEA;", f"lop3.b32 l, {low[src]}, {mask:#010x}, m, 0xEA;",
                  "sub.f16x2 h, h, c;", f"fma.rn.f16x2 ${i}, l, q, h;"]
    return "\n".join(lines + ["}"])


_PLANES_ASM = tl.constexpr(_planes_asm())
_WIDE_PLANES_ASM = tl.constexpr(_wide_planes_asm())


@triton.jit
def _planes(codes, ASM: tl.constexpr):
    """The four quarter planes of packed 2-bit codes as exact fp16 numbers, plane p scaled by 4^p: c_p·4^p.

    Each plane is selected by a mask, not shifted down: a code masked in place (c·4^p <= 192) or-ed into the mantissa
    of 1024.0 (0x6400) is the fp16 number 1024 + c·4^p, and subtracting 1024 leaves c·4^p exactly; callers fold 4^-p
    into the query (keys) or the accumulator (values). On the GPU (`ASM`) one block of PTX does this for 4 bytes at
    once, two codes per instruction: a `prmt` orders the bytes [b0, b2, b1, b3] so that the low and high halves of
    one 32-bit word hold bytes 0 and 1 (and, shifted by 8, bytes 2 and 3), then per plane one `lop3` ((x & mask) | magic)
    and one `sub.f16x2` per pair: 1.1 instructions per code where the compiler's byte extraction took ~1.8.
    The interpreter (CPU tests) runs the same arithmetic in plain Triton."""
    if ASM:
        return tl.inline_asm_elementwise(
            asm=_PLANES_ASM,
            constraints="=r,=r,=r,=r,=r,=r,=r,=r,r",
            args=[codes], dtype=(tl.float16, tl.float16, tl.float16, tl.float16), is_pure=True, pack=4)
    c0 = ((codes & 0x03).to(tl.int16) | 0x6400).to(tl.float16, bitcast=True) - 1024.0
    c1 = ((codes & 0x0C).to(tl.int16) | 0x6400).to(tl.float16, bitcast=True) - 1024.0
    c2 = ((codes & 0x30).to(tl.int16) | 0x6400).to(tl.float16, bitcast=True) - 1024.0
    c3 = ((codes & 0xC0).to(tl.int16) | 0x6400).to(tl.float16, bitcast=True) - 1024.0
    return c0, c1, c2, c3


@triton.jit
def _wide_planes(codes, low, ASM: tl.constexpr):
    """A wide head's four quarter planes (`_planes`) of its 4-bit codes, high plane `codes` and low plane `low`
    combined before any dot: (c_p + l_p/4)·4^p, exact in fp16 (at most 15·4^(p-1), in steps of 4^(p-1)), so a wide
    head's tile makes the same dots as a 2-bit head's (x̂ = h·S + m + l·S/4 = (h + l/4)·S + m, `oscar_hf.quant`,
    "wide heads"). On the GPU per pair of codes: the two masks of `_planes`, then h − 1280 (exact) and one
    fma(l + 1024, 1/4, h − 1280), which rounds once, to the exact value."""
    if ASM:
        return tl.inline_asm_elementwise(
            asm=_WIDE_PLANES_ASM,
            constraints="=r,=r,=r,=r,=r,=r,=r,=r,r,r",
            args=[codes, low], dtype=(tl.float16, tl.float16, tl.float16, tl.float16), is_pure=True, pack=4)
    c0, c1, c2, c3 = _planes(codes, ASM)
    l0, l1, l2, l3 = _planes(low, ASM)
    return c0 + l0 * 0.25, c1 + l1 * 0.25, c2 + l2 * 0.25, c3 + l3 * 0.25


@triton.jit
def _prefetch_l2(ptr, nbytes):
    """Asks the copy engine (one thread of the program) to bring `nbytes` from `ptr` into L2, and returns at once:
    `cp.async.bulk.prefetch.L2` (sm_90). A load that comes later then waits for L2, not for DRAM; this keeps bytes in
    flight without the registers a prefetch into registers costs. The range is widened to whole 16-byte units
    (the instruction's granule; never beyond the allocation's 512-byte granule). `nbytes` <= 0 asks for nothing when
    `ptr` is 16-byte aligned, as every caller's is (rows of whole 16-byte units from an aligned base); an unaligned
    `ptr` with `nbytes` 0 would still ask for the 16 bytes that hold it."""
    addr = ptr.to(tl.uint64, bitcast=True)
    lo = addr & 0xFFFFFFFFFFFFFFF0
    size = ((addr - lo).to(tl.int32) + nbytes + 15) & -16
    tl.inline_asm_elementwise(
        asm="""{
        .reg .pred p, q;
        .reg .b32 t;
        mov.u32 t, %tid.x;
        setp.eq.u32 p, t, 0;
        setp.gt.s32 q, $2, $3;
        and.pred p, p, q;
        @p cp.async.bulk.prefetch.L2.global [$1], $2;
        mov.b32 $0, 0;
        }""",
        constraints="=r,l,r,r", args=[lo, size, (addr - lo).to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _key_meta_row(base_mk, start, kinv, smk_c, smk_t, KEY_CHUNK: tl.constexpr):
    """The meta row of channel-wise keys holding token `start` of this KV head (`base_mk`: the head's first row of
    chunk 0; rows (t // chunk, offset + (t % chunk) // block) of `[B, n_chunks, R, d, 2]`, `smk_c` the chunk stride,
    `smk_t` the row stride): one row per tile, as the tile lies in one block. The head's block is a runtime value:
    `kinv` = 1/block, and (t % chunk) // block = floor((t % chunk + 0.5) / block), exact in float32 (the fraction
    stays >= 0.5/block away from an integer), a few instructions where an integer division by a runtime divisor
    took ~20 per tile (eval/compile_kernels.py --sass)."""
    t = tl.cast(start, tl.uint32)  # tokens are >= 0: unsigned // and % by the constant chunk are shifts and masks
    chunk = (t // KEY_CHUNK).to(tl.int32)
    within = (t % KEY_CHUNK).to(tl.float32)
    return base_mk + chunk * smk_c + ((within + 0.5) * kinv).to(tl.int32) * smk_t


@triton.jit
def _prefetch_tiles_l2(base_ck, sc_t, base_cv, scv_t, base_mk, smk_c, smk_t, kinv, base_mv, sm_t, base_lk, base_lv,
                       wide, start, n, split, KEY_CHUNK: tl.constexpr, BLOCK_N: tl.constexpr, TILES: tl.constexpr,
                       KEY_SPLIT: tl.constexpr):
    """L2 prefetch of tokens [start, start + n) (at most TILES tiles) of the history: key and value codes (uint8,
    rows contiguous: the launcher checks) and, for a wide head (`wide`), its low-plane rows (`base_lk`, `base_lv`),
    value meta (32-bit words, strides in words) as one range each, and the key meta row of each tile (a head's rows
    are not contiguous across chunks: one row per tile; two, one per half, for a head whose block is half the tile:
    `split`)."""
    HALF: tl.constexpr = BLOCK_N // 2
    _prefetch_l2(base_ck + start * sc_t, n * sc_t)
    _prefetch_l2(base_cv + start * scv_t, n * scv_t)
    _prefetch_l2(base_lk + start * sc_t, tl.where(wide, n, 0) * sc_t)
    _prefetch_l2(base_lv + start * scv_t, tl.where(wide, n, 0) * scv_t)
    _prefetch_l2(base_mv + start * sm_t, n * sm_t * 4)
    for i in tl.static_range(TILES):
        tile = start + i * BLOCK_N
        _prefetch_l2(_key_meta_row(base_mk, tile, kinv, smk_c, smk_t, KEY_CHUNK),
                     tl.where(n > i * BLOCK_N, smk_t * 4, 0))
        if KEY_SPLIT:
            if split:
                _prefetch_l2(_key_meta_row(base_mk, tile + HALF, kinv, smk_c, smk_t, KEY_CHUNK),
                             tl.where(n > i * BLOCK_N + HALF, smk_t * 4, 0))


@triton.jit
def _scale_min(row, offset, sm_2, ok):
    """The 16-bit scale and minimum of one quantization group for a tile's tokens (`row` per token), in float32."""
    scale = tl.load(row + offset, mask=ok, other=0.0).to(tl.float32)
    minimum = tl.load(row + offset + sm_2, mask=ok, other=0.0).to(tl.float32)
    return scale, minimum


@triton.jit
def _channel_key_meta(mblk, smk_g, smk_2, live, QD: tl.constexpr):
    """The per-channel scales and minima of one channel-wise key block, per quarter plane p, the scale times 4^-p
    (see `_planes`); `live` False (a prefetch past the range) loads nothing."""
    ch = tl.arange(0, QD)
    ok = live + 0 * ch > 0  # a bool per channel (the interpreter rejects scalar-and-vector masks)
    s0 = tl.load(mblk + ch * smk_g, mask=ok, other=0.0).to(tl.float32)
    m0 = tl.load(mblk + ch * smk_g + smk_2, mask=ok, other=0.0).to(tl.float32)
    s1 = tl.load(mblk + (QD + ch) * smk_g, mask=ok, other=0.0).to(tl.float32) * 0.25
    m1 = tl.load(mblk + (QD + ch) * smk_g + smk_2, mask=ok, other=0.0).to(tl.float32)
    s2 = tl.load(mblk + (2 * QD + ch) * smk_g, mask=ok, other=0.0).to(tl.float32) * 0.0625
    m2 = tl.load(mblk + (2 * QD + ch) * smk_g + smk_2, mask=ok, other=0.0).to(tl.float32)
    s3 = tl.load(mblk + (3 * QD + ch) * smk_g, mask=ok, other=0.0).to(tl.float32) * 0.015625
    m3 = tl.load(mblk + (3 * QD + ch) * smk_g + smk_2, mask=ok, other=0.0).to(tl.float32)
    return s0, m0, s1, m1, s2, m2, s3, m3


@triton.jit
def _channel_plane(s, bias, q, qp, plane, scale, minimum, UPCAST: tl.constexpr):
    """Adds quarter plane p (codes·4^p, see `_planes`) of channel-wise keys to the scores `s` and the products of
    its minima with the query to `bias` [M, D/4] (reduced once per tile, not per plane); `scale` carries 4^-p.
    `qp`: the query paired with each slot's code (wide key channels: slot c holds a code of channel π(c), so its
    scale meets q_π(c) while its minimum meets q_c); `q` itself without wide key channels."""
    s += _dot((qp.to(tl.float32) * scale[None, :]).to(tl.float16), tl.trans(plane), UPCAST)
    bias += q.to(tl.float32) * minimum[None, :]
    return s, bias


@triton.jit
def _word_halves(w):
    """The two fp16 numbers of 32-bit words holding (scale, minimum) pairs, as float32: one load for both."""
    scale = (w & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    minimum = (w >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return scale, minimum


@triton.jit
def _key_meta_words(mblk, smk_g, live, QD: tl.constexpr):
    """The per-channel (scale, minimum) of one channel-wise key block read as 32-bit words (`mblk`: the row, an int32
    view, `smk_g` the channel stride in words), per quarter plane p, the scale times 4^-p (see `_planes`); `live`
    [QD] bool, False loads nothing."""
    dq = tl.arange(0, QD)
    s0, m0 = _word_halves(tl.load(mblk + dq * smk_g, mask=live, other=0))
    s1, m1 = _word_halves(tl.load(mblk + (QD + dq) * smk_g, mask=live, other=0))
    s2, m2 = _word_halves(tl.load(mblk + (2 * QD + dq) * smk_g, mask=live, other=0))
    s3, m3 = _word_halves(tl.load(mblk + (3 * QD + dq) * smk_g, mask=live, other=0))
    return s0, m0, s1 * 0.25, m1, s2 * 0.0625, m2, s3 * 0.015625, m3


@triton.jit
def _tile_loads(base_ck, sc_t, sc_d, base_cv, scv_t, scv_d, base_mkw, smk_c, smk_t, smk_g, kinv, base_mvw, sm_t,
                start, hi, KEY_CHUNK: tl.constexpr, QD: tl.constexpr, BLOCK_N: tl.constexpr):
    """Everything one tile of channel-wise keys and one-group values reads from memory: key and value codes, the
    values' per-token (scale, minimum), the key block's per-channel (scale, minimum) — the meta read as 32-bit words
    (`base_mkw`, `base_mvw`: int32 views, strides in words), each word one pair; key scales carry 4^-p per plane."""
    idx = start + tl.arange(0, BLOCK_N)
    ok = idx < hi
    dq = tl.arange(0, QD)
    ck = tl.load(base_ck + idx[:, None] * sc_t + dq[None, :] * sc_d, mask=ok[:, None], other=0)
    cv = tl.load(base_cv + idx[:, None] * scv_t + dq[None, :] * scv_d, mask=ok[:, None], other=0)
    vs, vm = _word_halves(tl.load(base_mvw + idx * sm_t, mask=ok, other=0))
    mblk = _key_meta_row(base_mkw, start, kinv, smk_c, smk_t, KEY_CHUNK)
    live = (start + 0 * dq) < hi  # a bool per channel (the interpreter rejects scalar-and-vector masks)
    s0, m0, s1, m1, s2, m2, s3, m3 = _key_meta_words(mblk, smk_g, live, QD)
    return ck, cv, vs, vm, s0, m0, s1, m1, s2, m2, s3, m3


@triton.jit
def _valid_keys(ok, kpos, qpos, b, mask_ptr, smask_b, smask_n, HAS_MASK: tl.constexpr):
    """[M, BLOCK_N]: key positions `kpos` (in range: `ok`) each query row at `qpos` may see (causal, key mask)."""
    valid = ok[None, :] & (kpos[None, :] <= qpos[:, None])
    if HAS_MASK:
        km = tl.load(mask_ptr + b * smask_b + kpos * smask_n, mask=ok, other=0)
        valid = valid & (km != 0)[None, :]
    return valid


@triton.jit
def _add_values_one_group(p, v0, v1, v2, v3, vs, vm, acc0, acc1, acc2, acc3, UPCAST: tl.constexpr):
    """acc_p += Σ_j p_j (s_j c_j + m_j) for the quarter planes v_p of one-group values (codes·4^p, see `_planes`:
    the accumulators run scaled by 4^p, so the minima's term is too)."""
    ps = (p * vs[None, :]).to(tl.float16)  # weights p·s <= 1: fp16 is 8x finer than bf16
    bias = tl.sum(p * vm[None, :], axis=1)[:, None]
    acc0 += _dot(ps, v0, UPCAST) + bias
    acc1 += _dot(ps, v1, UPCAST) + bias * 4.0
    acc2 += _dot(ps, v2, UPCAST) + bias * 16.0
    acc3 += _dot(ps, v3, UPCAST) + bias * 64.0
    return acc0, acc1, acc2, acc3


@triton.jit
def _channel_dots(q0, q1, q2, q3, qp0, qp1, qp2, qp3, k0, k1, k2, k3, ks0, km0, ks1, km1, ks2, km2, ks3, km3,
                  BLOCK_N: tl.constexpr, UPCAST: tl.constexpr):
    """Scores [M, BLOCK_N] of unpacked key planes under one block's per-channel (scale, minimum):
    q·k = Σ_c (q_π(c) s_c)·code_c + Σ_c q_c m_c (`qp`: the paired query planes, see `_channel_plane`)."""
    QD: tl.constexpr = k0.shape[1]
    s = tl.zeros((q0.shape[0], BLOCK_N), tl.float32)
    bias = tl.zeros((q0.shape[0], QD), tl.float32)
    s, bias = _channel_plane(s, bias, q0, qp0, k0, ks0, km0, UPCAST)
    s, bias = _channel_plane(s, bias, q1, qp1, k1, ks1, km1, UPCAST)
    s, bias = _channel_plane(s, bias, q2, qp2, k2, ks2, km2, UPCAST)
    s, bias = _channel_plane(s, bias, q3, qp3, k3, ks3, km3, UPCAST)
    return s + tl.sum(bias, axis=1)[:, None]


@triton.jit
def _channel_dots_split(q0, q1, q2, q3, qp0, qp1, qp2, qp3, k0, k1, k2, k3, ks0, km0, ks1, km1, ks2, km2, ks3,
                        km3, ls0, lm0, ls1, lm1, ls2, lm2, ls3, lm3, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr):
    """`_channel_dots` for a tile over two key blocks: its first half under meta (ks, km), its second under
    (ls, lm). The codes are unpacked once; each half's scaled queries make their own dots over all the tile's planes
    (the MMA tile is the key tile either way), and each token keeps its half's scores."""
    s = _channel_dots(q0, q1, q2, q3, qp0, qp1, qp2, qp3, k0, k1, k2, k3, ks0, km0, ks1, km1, ks2, km2, ks3, km3,
                      BLOCK_N, UPCAST)
    t = _channel_dots(q0, q1, q2, q3, qp0, qp1, qp2, qp3, k0, k1, k2, k3, ls0, lm0, ls1, lm1, ls2, lm2, ls3, lm3,
                      BLOCK_N, UPCAST)
    first = tl.arange(0, BLOCK_N) < BLOCK_N // 2
    return tl.where(first[None, :], s, t)


@triton.jit
def _tile_planes(codes, low_base, idx, ok, s_t, s_d, wide_row, WIDE: tl.constexpr, ASM: tl.constexpr):
    """The quarter planes (`_planes`) of a tile's key or value codes [BLOCK_N, D/4]; a wide head's (`wide_row` >= 0,
    runtime) combined with its low plane, loaded here from the head's low-plane row `low_base` (`_wide_planes`), so
    that its tile makes the same dots as any other head's."""
    if WIDE:
        if wide_row >= 0:
            dq = tl.arange(0, codes.shape[1])
            low = tl.load(low_base + idx[:, None] * s_t + dq[None, :] * s_d, mask=ok[:, None], other=0)
            c0, c1, c2, c3 = _wide_planes(codes, low, ASM)
        else:
            c0, c1, c2, c3 = _planes(codes, ASM)
    else:
        c0, c1, c2, c3 = _planes(codes, ASM)
    return c0, c1, c2, c3


@triton.jit
def _int2_range_words(
    q0, q1, q2, q3, qp0, qp1, qp2, qp3, qpos, m_i, l_i, acc0, acc1, acc2, acc3,
    ck_ptr, sc_b, sc_h, sc_t, sc_d,
    cv_ptr, scv_b, scv_h, scv_t, scv_d,
    mk_ptr, smk_b, smk_c, smk_t, smk_g, kinv, koffset, split,
    mv_ptr, sm_b, sm_h, sm_t,
    b, h, lo, hi, pos_offset, mask_ptr, smask_b, smask_n, wide_row,
    D: tl.constexpr, KEY_CHUNK: tl.constexpr, BLOCK_N: tl.constexpr, HAS_MASK: tl.constexpr,
    UPCAST: tl.constexpr, ASM: tl.constexpr, REGISTER_PREFETCH: tl.constexpr, L2_AHEAD: tl.constexpr,
    KEY_SPLIT: tl.constexpr, WIDE: tl.constexpr,
):
    """`_int2_range` for the default layout (channel-wise keys, one value group per token), the meta read as 32-bit
    words (`mk_ptr`, `mv_ptr`: int32 views, one (scale, minimum) pair per word, strides in words), and bytes kept in
    flight while a tile computes (few programs fit on an SM, so their waits do not overlap): `REGISTER_PREFETCH`
    loads the next tile into registers before this tile's arithmetic; `L2_AHEAD` > 0 asks for the tile that many
    steps ahead in L2 and leaves the loads in place, where the compiler stages the packed bytes (not the unpacked
    fp16 planes) through shared memory for the MMAs. Key meta `[B, n_chunks, R, d]` words: this head's rows start
    at `koffset` in each chunk (`smk_c` apart), one per block of 1/`kinv` tokens (`_key_meta_row`). `KEY_SPLIT`: the
    launch's tiles may be twice some head's block; `split` (runtime, per program): this head's is, so each tile also
    reads the row of its second half, with the tile's other loads (masked off for other heads: the load waits on the
    same round trip), and computes its scores in a branch that other heads skip (`_channel_scores_split`). `WIDE`:
    the layer has wide heads; `wide_row` (runtime, per program): this head's low-plane codes row, or -1 (its low
    key and value planes join the high ones before the dots: `_tile_planes`). `qp0..qp3`: the query planes paired with the
    key slots' codes (wide key channels, `_channel_plane`; the query planes themselves without)."""
    QD: tl.constexpr = D // 4
    HALF: tl.constexpr = BLOCK_N // 2
    dq = tl.arange(0, QD)
    split_hi = tl.where(split, hi, 0)  # the second rows' loads stop here: nothing for a head that does not split
    base_ck = ck_ptr + b * sc_b + h * sc_h
    base_cv = cv_ptr + b * scv_b + h * scv_h
    base_mk = mk_ptr + b * smk_b + koffset * smk_t
    base_mv = mv_ptr + b * sm_b + h * sm_h
    # a wide head's low-plane rows (read only for one; other heads' point at their own rows)
    base_lk = ck_ptr + b * sc_b + tl.where(wide_row >= 0, wide_row, h) * sc_h
    base_lv = cv_ptr + b * scv_b + tl.where(wide_row >= 0, wide_row, h) * scv_h
    acc1 = acc1 * 4.0
    acc2 = acc2 * 16.0
    acc3 = acc3 * 64.0
    if REGISTER_PREFETCH:
        ck, cv, vs, vm, ks0, km0, ks1, km1, ks2, km2, ks3, km3 = _tile_loads(
            base_ck, sc_t, sc_d, base_cv, scv_t, scv_d, base_mk, smk_c, smk_t, smk_g, kinv, base_mv, sm_t, lo, hi,
            KEY_CHUNK, QD, BLOCK_N)
        if KEY_SPLIT:  # the row of the first tile's second half
            ls0, lm0, ls1, lm1, ls2, lm2, ls3, lm3 = _key_meta_words(
                _key_meta_row(base_mk, lo + HALF, kinv, smk_c, smk_t, KEY_CHUNK), smk_g,
                (lo + HALF + 0 * dq) < split_hi, QD)
    if L2_AHEAD > 0:  # the first L2_AHEAD tiles now, then one tile L2_AHEAD ahead per step
        _prefetch_tiles_l2(base_ck, sc_t, base_cv, scv_t, base_mk, smk_c, smk_t, kinv, base_mv, sm_t, base_lk,
                           base_lv, wide_row >= 0, lo, tl.minimum(hi - lo, L2_AHEAD * BLOCK_N), split, KEY_CHUNK,
                           BLOCK_N, L2_AHEAD, KEY_SPLIT)
    for start in range(lo, hi, BLOCK_N):
        if L2_AHEAD > 0:
            ahead = start + L2_AHEAD * BLOCK_N
            _prefetch_tiles_l2(base_ck, sc_t, base_cv, scv_t, base_mk, smk_c, smk_t, kinv, base_mv, sm_t, base_lk,
                               base_lv, wide_row >= 0, ahead, tl.minimum(hi - ahead, BLOCK_N), split, KEY_CHUNK,
                               BLOCK_N, 1, KEY_SPLIT)
        if REGISTER_PREFETCH:
            n_ck, n_cv, n_vs, n_vm, n_ks0, n_km0, n_ks1, n_km1, n_ks2, n_km2, n_ks3, n_km3 = _tile_loads(
                base_ck, sc_t, sc_d, base_cv, scv_t, scv_d, base_mk, smk_c, smk_t, smk_g, kinv, base_mv, sm_t,
                start + BLOCK_N, hi, KEY_CHUNK, QD, BLOCK_N)
            if KEY_SPLIT:
                nxt = start + BLOCK_N + HALF
                n_ls0, n_lm0, n_ls1, n_lm1, n_ls2, n_lm2, n_ls3, n_lm3 = _key_meta_words(
                    _key_meta_row(base_mk, nxt, kinv, smk_c, smk_t, KEY_CHUNK), smk_g, (nxt + 0 * dq) < split_hi, QD)
        else:
            ck, cv, vs, vm, ks0, km0, ks1, km1, ks2, km2, ks3, km3 = _tile_loads(
                base_ck, sc_t, sc_d, base_cv, scv_t, scv_d, base_mk, smk_c, smk_t, smk_g, kinv, base_mv, sm_t,
                start, hi, KEY_CHUNK, QD, BLOCK_N)
            if KEY_SPLIT:
                ls0, lm0, ls1, lm1, ls2, lm2, ls3, lm3 = _key_meta_words(
                    _key_meta_row(base_mk, start + HALF, kinv, smk_c, smk_t, KEY_CHUNK), smk_g,
                    (start + HALF + 0 * dq) < split_hi, QD)
        idx = start + tl.arange(0, BLOCK_N)
        ok = idx < hi
        k0, k1, k2, k3 = _tile_planes(ck, base_lk, idx, ok, sc_t, sc_d, wide_row, WIDE, ASM)
        if KEY_SPLIT:
            if split:
                s = _channel_dots_split(q0, q1, q2, q3, qp0, qp1, qp2, qp3, k0, k1, k2, k3, ks0, km0, ks1, km1, ks2,
                                        km2, ks3, km3, ls0, lm0, ls1, lm1, ls2, lm2, ls3, lm3, BLOCK_N, UPCAST)
            else:
                s = _channel_dots(q0, q1, q2, q3, qp0, qp1, qp2, qp3, k0, k1, k2, k3, ks0, km0, ks1, km1, ks2, km2,
                                  ks3, km3, BLOCK_N, UPCAST)
        else:
            s = _channel_dots(q0, q1, q2, q3, qp0, qp1, qp2, qp3, k0, k1, k2, k3, ks0, km0, ks1, km1, ks2, km2, ks3,
                              km3, BLOCK_N, UPCAST)
        valid = _valid_keys(ok, pos_offset + idx, qpos, b, mask_ptr, smask_b, smask_n, HAS_MASK)
        p, alpha, m_i, l_i, acc0, acc1, acc2, acc3 = _online_update(s, valid, m_i, l_i, acc0, acc1, acc2, acc3)
        v0, v1, v2, v3 = _tile_planes(cv, base_lv, idx, ok, scv_t, scv_d, wide_row, WIDE, ASM)
        acc0, acc1, acc2, acc3 = _add_values_one_group(p, v0, v1, v2, v3, vs, vm, acc0, acc1, acc2, acc3, UPCAST)
        if REGISTER_PREFETCH:
            ck, cv, vs, vm, ks0, km0, ks1, km1, ks2, km2, ks3, km3 = (
                n_ck, n_cv, n_vs, n_vm, n_ks0, n_km0, n_ks1, n_km1, n_ks2, n_km2, n_ks3, n_km3)
            if KEY_SPLIT:
                ls0, lm0, ls1, lm1, ls2, lm2, ls3, lm3 = n_ls0, n_lm0, n_ls1, n_lm1, n_ls2, n_lm2, n_ls3, n_lm3
    return m_i, l_i, acc0, acc1 * 0.25, acc2 * 0.0625, acc3 * 0.015625


@triton.jit
def _int2_range(
    q0, q1, q2, q3, qp0, qp1, qp2, qp3, qs0, qs1, qs2, qs3, qpos, m_i, l_i, acc0, acc1, acc2, acc3,
    ck_ptr, sc_b, sc_h, sc_t, sc_d,
    cv_ptr, scv_b, scv_h, scv_t, scv_d,
    mk_ptr, smk_b, smk_h, smk_t, smk_g, smk_2, kinv, koffset, split,
    mv_ptr, sm_b, sm_h, sm_t, sm_g, sm_2,
    b, h, lo, hi, pos_offset, mask_ptr, smask_b, smask_n, scale, wide_row,
    D: tl.constexpr, GROUPS: tl.constexpr, KEY_CHUNK: tl.constexpr, BLOCK_N: tl.constexpr, HAS_MASK: tl.constexpr,
    UPCAST: tl.constexpr, ASM: tl.constexpr, KEY_SPLIT: tl.constexpr, WIDE: tl.constexpr,
):
    """Online softmax over history tokens [lo, hi). Key meta: token-wise `[B, H, L, G, 2]`, or (`KEY_CHUNK` > 0)
    channel-wise `[B, n_chunks, R, d, 2]` (`smk_h` then is the chunk stride; this head's rows start at `koffset`,
    one per block of 1/`kinv` tokens; `split`: this head's block is half the tile, see `_int2_range_words`).
    `WIDE`, `wide_row`: wide heads (channel-wise keys and one value group only: the launcher checks), and `qp0..qp3`
    (channel-wise keys' paired query planes), as in `_int2_range_words`."""
    QD: tl.constexpr = D // 4
    HALF: tl.constexpr = BLOCK_N // 2
    dq = tl.arange(0, QD)
    split_hi = tl.where(split, hi, 0)
    base_ck = ck_ptr + b * sc_b + h * sc_h
    base_cv = cv_ptr + b * scv_b + h * scv_h
    if KEY_CHUNK > 0:
        base_mk = mk_ptr + b * smk_b + koffset * smk_t
    else:
        base_mk = mk_ptr + b * smk_b + h * smk_h
    base_mv = mv_ptr + b * sm_b + h * sm_h
    base_lk = ck_ptr + b * sc_b + wide_row * sc_h  # read only for a wide head
    base_lv = cv_ptr + b * scv_b + wide_row * scv_h
    # quarter plane p lies in group p * GROUPS // 4 (GROUPS in {1, 2, 4})
    G1: tl.constexpr = 1 * GROUPS // 4
    G2: tl.constexpr = 2 * GROUPS // 4
    G3: tl.constexpr = 3 * GROUPS // 4
    # `_planes` yields codes·4^p: token-wise key dots take queries scaled by 4^-p (exact), value accumulators run
    # scaled by 4^p and are scaled back after the loop
    r1 = (q1.to(tl.float32) * 0.25).to(q1.dtype)
    r2 = (q2.to(tl.float32) * 0.0625).to(q2.dtype)
    r3 = (q3.to(tl.float32) * 0.015625).to(q3.dtype)
    acc1 = acc1 * 4.0
    acc2 = acc2 * 16.0
    acc3 = acc3 * 64.0
    for start in range(lo, hi, BLOCK_N):
        idx = start + tl.arange(0, BLOCK_N)
        ok = idx < hi
        ck = tl.load(base_ck + idx[:, None] * sc_t + dq[None, :] * sc_d, mask=ok[:, None], other=0)
        if KEY_CHUNK > 0:
            # Channel-wise keys: the tile lies in one block (the tile divides the head's block), whose per-channel
            # scale s_c and minimum m_c fold into the query; or (`split`) in two, each half with its own scaled
            # queries. (An earlier kernel that spanned two blocks in every tile measured slower on the H200, 169 vs
            # 146 us at 100K, batch 1: the launcher splits only the smallest blocks' heads, when blocks mix.)
            ks0, km0, ks1, km1, ks2, km2, ks3, km3 = _channel_key_meta(
                _key_meta_row(base_mk, start, kinv, smk_h, smk_t, KEY_CHUNK), smk_g, smk_2, start < hi, QD)
            k0, k1, k2, k3 = _tile_planes(ck, base_lk, idx, ok, sc_t, sc_d, wide_row, WIDE, ASM)
            if KEY_SPLIT:  # the second half's row loads with the first (nothing loaded for other heads)
                ls0, lm0, ls1, lm1, ls2, lm2, ls3, lm3 = _channel_key_meta(
                    _key_meta_row(base_mk, start + HALF, kinv, smk_h, smk_t, KEY_CHUNK), smk_g, smk_2,
                    start + HALF < split_hi, QD)
                if split:
                    s = _channel_dots_split(q0, q1, q2, q3, qp0, qp1, qp2, qp3, k0, k1, k2, k3, ks0, km0, ks1, km1,
                                            ks2, km2, ks3, km3, ls0, lm0, ls1, lm1, ls2, lm2, ls3, lm3, BLOCK_N, UPCAST)
                else:
                    s = _channel_dots(q0, q1, q2, q3, qp0, qp1, qp2, qp3, k0, k1, k2, k3, ks0, km0, ks1, km1, ks2, km2,
                                      ks3, km3, BLOCK_N, UPCAST)
            else:
                s = _channel_dots(q0, q1, q2, q3, qp0, qp1, qp2, qp3, k0, k1, k2, k3, ks0, km0, ks1, km1, ks2, km2,
                                  ks3, km3, BLOCK_N, UPCAST)
        else:
            k0, k1, k2, k3 = _planes(ck, ASM)
            mrow = base_mk + idx * smk_t
            ks0, km0 = _scale_min(mrow, 0, smk_2, ok)
            s = _dot(q0, tl.trans(k0), UPCAST) * ks0[None, :] + qs0[:, None] * km0[None, :]
            if GROUPS == 1:
                s += (_dot(r1, tl.trans(k1), UPCAST) + _dot(r2, tl.trans(k2), UPCAST)
                      + _dot(r3, tl.trans(k3), UPCAST)) * ks0[None, :] + (qs1 + qs2 + qs3)[:, None] * km0[None, :]
            else:
                ks1, km1 = _scale_min(mrow, G1 * smk_g, smk_2, ok)
                ks2, km2 = _scale_min(mrow, G2 * smk_g, smk_2, ok)
                ks3, km3 = _scale_min(mrow, G3 * smk_g, smk_2, ok)
                s += _dot(r1, tl.trans(k1), UPCAST) * ks1[None, :] + qs1[:, None] * km1[None, :]
                s += _dot(r2, tl.trans(k2), UPCAST) * ks2[None, :] + qs2[:, None] * km2[None, :]
                s += _dot(r3, tl.trans(k3), UPCAST) * ks3[None, :] + qs3[:, None] * km3[None, :]
        valid = _valid_keys(ok, pos_offset + idx, qpos, b, mask_ptr, smask_b, smask_n, HAS_MASK)
        p, alpha, m_i, l_i, acc0, acc1, acc2, acc3 = _online_update(s * scale, valid, m_i, l_i, acc0, acc1, acc2, acc3)
        cv = tl.load(base_cv + idx[:, None] * scv_t + dq[None, :] * scv_d, mask=ok[:, None], other=0)
        v0, v1, v2, v3 = _tile_planes(cv, base_lv, idx, ok, scv_t, scv_d, wide_row, WIDE, ASM)
        vrow = base_mv + idx * sm_t
        vs0, vm0 = _scale_min(vrow, 0, sm_2, ok)
        if GROUPS == 1:
            acc0, acc1, acc2, acc3 = _add_values_one_group(p, v0, v1, v2, v3, vs0, vm0, acc0, acc1, acc2, acc3, UPCAST)
        else:
            vs1, vm1 = _scale_min(vrow, G1 * sm_g, sm_2, ok)
            vs2, vm2 = _scale_min(vrow, G2 * sm_g, sm_2, ok)
            vs3, vm3 = _scale_min(vrow, G3 * sm_g, sm_2, ok)
            acc0 += _dot((p * vs0[None, :]).to(tl.float16), v0, UPCAST) + tl.sum(p * vm0[None, :], axis=1)[:, None]
            acc1 += _dot((p * vs1[None, :]).to(tl.float16), v1, UPCAST) + tl.sum(p * vm1[None, :], axis=1)[:, None] * 4.0
            acc2 += _dot((p * vs2[None, :]).to(tl.float16), v2, UPCAST) + tl.sum(p * vm2[None, :], axis=1)[:, None] * 16.0
            acc3 += _dot((p * vs3[None, :]).to(tl.float16), v3, UPCAST) + tl.sum(p * vm3[None, :], axis=1)[:, None] * 64.0
    return m_i, l_i, acc0, acc1 * 0.25, acc2 * 0.0625, acc3 * 0.015625


@triton.jit
def _paired_query_plane(q_base, sq_d, row_ok, PLANE: tl.constexpr, n_wide, scale, D: tl.constexpr):
    """Quarter plane PLANE of the query paired with the key slots (wide key channels,
    `oscar_hf.quant.paired_channels`: slot c holds a code of channel c, or of c − (D − n) in the last n slots), in
    fp16 pre-scaled like h0..h3."""
    QD: tl.constexpr = D // 4
    slots = PLANE * QD + tl.arange(0, QD)
    paired = tl.where(slots >= D - n_wide, slots - (D - n_wide), slots)
    q = tl.load(q_base + paired[None, :] * sq_d, mask=row_ok[:, None], other=0.0)
    return (q.to(tl.float32) * scale).to(tl.float16)


@triton.jit
def _segment_attention_kernel(
    q_ptr, sq_b, sq_h, sq_m, sq_d,
    o_ptr, so_b, so_h, so_m, so_s, so_d,
    lse_ptr, sl_b, sl_h, sl_m, sl_s,
    sink_k, sink_v, ss_b, ss_h, ss_t, ss_d,
    codes_k, sc_b, sc_h, sc_t, sc_d,
    codes_v, scv_b, scv_h, scv_t, scv_d,
    meta_k, smk_b, smk_h, smk_t, smk_g, smk_2, key_table, wide_table, channel_table,
    meta_v, sm_b, sm_h, sm_t, sm_g, sm_2,
    rec_k, rec_v, sr_b, sr_h, sr_t, sr_d,
    ext_k, ext_v, se_b, se_h, se_t, se_d,
    mask_ptr, smask_b, smask_n,
    heads, M, T, q_start,
    n_sink, n_hist, n_recent, n_extra,
    hist_splits, hist_chunk, recent_splits, recent_chunk, extra_chunk,
    scale, len_ptr, ring_size,
    D: tl.constexpr, GROUPS: tl.constexpr, KEY_CHUNK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_MASK: tl.constexpr, UPCAST: tl.constexpr, DEVICE_LENGTHS: tl.constexpr, PTX_UNPACK: tl.constexpr,
    META_WORDS: tl.constexpr, PREFETCH: tl.constexpr, L2_AHEAD: tl.constexpr, KEY_SPLIT: tl.constexpr,
    WIDE: tl.constexpr, WIDE_CHANNELS: tl.constexpr, SKIP_HISTORY: tl.constexpr,
):
    pid_bh = tl.program_id(0)
    pid_m = tl.program_id(1)
    split = tl.program_id(2)
    if SKIP_HISTORY:  # the history splits are the CUDA kernel's: this launch has programs for the others only
        split = tl.where(split > 0, split + hist_splits, split)
    b = pid_bh // heads
    h = pid_bh % heads
    QD: tl.constexpr = D // 4
    if DEVICE_LENGTHS:
        # A static cache's decode step: lengths on the device (a CUDA graph replays this launch unchanged); the
        # recent window is a ring whose position n_sink + n_hist sits at slot ring_lo.
        n_sink = tl.load(len_ptr + 0)
        n_hist = tl.load(len_ptr + 1)
        n_recent = tl.load(len_ptr + 2)
        ring_lo = tl.load(len_ptr + 3)
        q_start = tl.load(len_ptr + 4)
    else:
        ring_lo = 0
    if KEY_CHUNK > 0:
        # channel-wise keys (meta [B, n_chunks, R, d, 2], smk_h the chunk stride): this head's block and first row
        # of each chunk, from the launcher's [H, 2] int32 table
        kblock = tl.load(key_table + 2 * h)
        kinv = 1.0 / kblock.to(tl.float32)
        koffset = tl.load(key_table + 2 * h + 1)
        # KEY_SPLIT: the tile is twice the smallest block (`key_tile`), a head of that block reads two rows per tile
        key_split = kblock < BLOCK_N
    else:
        kinv = 1.0
        koffset = 0
        key_split = False
    if WIDE:
        wide_row = tl.load(wide_table + h)  # this head's low-plane codes row (a wide head), or -1
    else:
        wide_row = -1
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    qpos = q_start + rows % T
    max_qpos = q_start + tl.max(tl.where(row_ok, rows % T, 0), axis=0)
    dq = tl.arange(0, QD)
    q_base = q_ptr + b * sq_b + h * sq_h + rows[:, None] * sq_m
    q0 = tl.load(q_base + (dq[None, :] + 0 * QD) * sq_d, mask=row_ok[:, None], other=0.0)
    q1 = tl.load(q_base + (dq[None, :] + 1 * QD) * sq_d, mask=row_ok[:, None], other=0.0)
    q2 = tl.load(q_base + (dq[None, :] + 2 * QD) * sq_d, mask=row_ok[:, None], other=0.0)
    q3 = tl.load(q_base + (dq[None, :] + 3 * QD) * sq_d, mask=row_ok[:, None], other=0.0)

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc0 = tl.zeros((BLOCK_M, QD), tl.float32)
    acc1 = tl.zeros((BLOCK_M, QD), tl.float32)
    acc2 = tl.zeros((BLOCK_M, QD), tl.float32)
    acc3 = tl.zeros((BLOCK_M, QD), tl.float32)

    recent_split = 1 + hist_splits
    if split == 0:
        hi = tl.minimum(n_sink, max_qpos + 1)
        m_i, l_i, acc0, acc1, acc2, acc3 = _bf16_range(
            q0, q1, q2, q3, qpos, m_i, l_i, acc0, acc1, acc2, acc3,
            sink_k, sink_v, ss_b, ss_h, ss_t, ss_d, b, h, 0, hi, 0,
            mask_ptr, smask_b, smask_n, scale, D, BLOCK_N, HAS_MASK, UPCAST)
    elif split < recent_split:
        if not SKIP_HISTORY:  # (never reached with it: the CUDA history kernel writes these splits, cuda_history.py)
            lo = (split - 1) * hist_chunk
            hi = tl.minimum(tl.minimum(lo + hist_chunk, n_hist), max_qpos + 1 - n_sink)
            # The codes are fp16 (see _planes), so are the queries here, pre-scaled (fp16 is 8x finer than bf16; the
            # scale keeps |q| far from fp16's range limit).
            h0 = (q0.to(tl.float32) * scale).to(tl.float16)
            h1 = (q1.to(tl.float32) * scale).to(tl.float16)
            h2 = (q2.to(tl.float32) * scale).to(tl.float16)
            h3 = (q3.to(tl.float32) * scale).to(tl.float16)
            qs0 = tl.sum(h0.to(tl.float32), axis=1)
            qs1 = tl.sum(h1.to(tl.float32), axis=1)
            qs2 = tl.sum(h2.to(tl.float32), axis=1)
            qs3 = tl.sum(h3.to(tl.float32), axis=1)
            if WIDE_CHANNELS:
                # channel-wise keys with wide key channels (`channel_table` [H] int32: n per head): key slot c holds a
                # code of channel π(c) (c, or c − (D − n) in the last n slots), so its scale meets the query gathered
                # by π, loaded and pre-scaled as h0..h3 (`_channel_plane`)
                n_wide = tl.load(channel_table + h)
                g0 = _paired_query_plane(q_base, sq_d, row_ok, 0, n_wide, scale, D)
                g1 = _paired_query_plane(q_base, sq_d, row_ok, 1, n_wide, scale, D)
                g2 = _paired_query_plane(q_base, sq_d, row_ok, 2, n_wide, scale, D)
                g3 = _paired_query_plane(q_base, sq_d, row_ok, 3, n_wide, scale, D)
            else:
                g0, g1, g2, g3 = h0, h1, h2, h3
            if META_WORDS:
                m_i, l_i, acc0, acc1, acc2, acc3 = _int2_range_words(
                    h0, h1, h2, h3, g0, g1, g2, g3, qpos, m_i, l_i, acc0, acc1, acc2, acc3,
                    codes_k, sc_b, sc_h, sc_t, sc_d, codes_v, scv_b, scv_h, scv_t, scv_d,
                    meta_k, smk_b, smk_h, smk_t, smk_g, kinv, koffset, key_split, meta_v, sm_b, sm_h, sm_t,
                    b, h, lo, hi, n_sink, mask_ptr, smask_b, smask_n, wide_row, D, KEY_CHUNK, BLOCK_N, HAS_MASK, UPCAST,
                    PTX_UNPACK, PREFETCH, L2_AHEAD, KEY_SPLIT, WIDE)
            else:
                m_i, l_i, acc0, acc1, acc2, acc3 = _int2_range(
                    h0, h1, h2, h3, g0, g1, g2, g3, qs0, qs1, qs2, qs3, qpos, m_i, l_i, acc0, acc1, acc2, acc3,
                    codes_k, sc_b, sc_h, sc_t, sc_d, codes_v, scv_b, scv_h, scv_t, scv_d,
                    meta_k, smk_b, smk_h, smk_t, smk_g, smk_2, kinv, koffset, key_split, meta_v, sm_b, sm_h, sm_t, sm_g,
                    sm_2, b, h, lo, hi, n_sink, mask_ptr, smask_b, smask_n, 1.0, wide_row, D, GROUPS, KEY_CHUNK, BLOCK_N,
                    HAS_MASK, UPCAST, PTX_UNPACK, KEY_SPLIT, WIDE)
    elif split < recent_split + recent_splits:
        # recent tokens [a, a + recent_chunk) of this split: ring slots ring_lo + a... modulo ring_size, at most two
        # contiguous pieces (one without a ring). Split like the history so that a short history does not leave the
        # whole BF16 window to one program (the step's longest at 4K tokens: H200, docs/research-log.md, "Decode kernel").
        a = (split - recent_split) * recent_chunk
        end = tl.minimum(a + recent_chunk, n_recent)
        offset = n_sink + n_hist - ring_lo
        hi = tl.minimum(tl.minimum(ring_lo + end, ring_size), max_qpos + 1 - offset)
        m_i, l_i, acc0, acc1, acc2, acc3 = _bf16_range(
            q0, q1, q2, q3, qpos, m_i, l_i, acc0, acc1, acc2, acc3,
            rec_k, rec_v, sr_b, sr_h, sr_t, sr_d, b, h, ring_lo + a, hi, offset,
            mask_ptr, smask_b, smask_n, scale, D, BLOCK_N, HAS_MASK, UPCAST)
        if DEVICE_LENGTHS:
            offset = offset + ring_size
            hi = tl.minimum(ring_lo + end - ring_size, max_qpos + 1 - offset)
            m_i, l_i, acc0, acc1, acc2, acc3 = _bf16_range(
                q0, q1, q2, q3, qpos, m_i, l_i, acc0, acc1, acc2, acc3,
                rec_k, rec_v, sr_b, sr_h, sr_t, sr_d, b, h, tl.maximum(ring_lo + a - ring_size, 0), hi, offset,
                mask_ptr, smask_b, smask_n, scale, D, BLOCK_N, HAS_MASK, UPCAST)
    else:
        offset = n_sink + n_hist + n_recent
        lo = (split - recent_split - recent_splits) * extra_chunk
        hi = tl.minimum(tl.minimum(lo + extra_chunk, n_extra), max_qpos + 1 - offset)
        m_i, l_i, acc0, acc1, acc2, acc3 = _bf16_range(
            q0, q1, q2, q3, qpos, m_i, l_i, acc0, acc1, acc2, acc3,
            ext_k, ext_v, se_b, se_h, se_t, se_d, b, h, lo, hi, offset,
            mask_ptr, smask_b, smask_n, scale, D, BLOCK_N, HAS_MASK, UPCAST)

    inv_l = tl.where(l_i > 0.0, 1.0 / l_i, 0.0)
    o_base = o_ptr + b * so_b + h * so_h + rows[:, None] * so_m + split * so_s
    tl.store(o_base + (dq[None, :] + 0 * QD) * so_d, acc0 * inv_l[:, None], mask=row_ok[:, None])
    tl.store(o_base + (dq[None, :] + 1 * QD) * so_d, acc1 * inv_l[:, None], mask=row_ok[:, None])
    tl.store(o_base + (dq[None, :] + 2 * QD) * so_d, acc2 * inv_l[:, None], mask=row_ok[:, None])
    tl.store(o_base + (dq[None, :] + 3 * QD) * so_d, acc3 * inv_l[:, None], mask=row_ok[:, None])
    # log-sum-exp in natural-log units (scores were scaled by log2(e) for exp2)
    lse = tl.where(l_i > 0.0, (m_i + tl.log2(tl.maximum(l_i, 1e-30))) / 1.4426950408889634, float("-inf"))
    tl.store(lse_ptr + b * sl_b + h * sl_h + rows * sl_m + split * sl_s, lse, mask=row_ok)


@triton.jit
def _merge_kernel(
    o_ptr, so_r, so_s, so_d, lse_ptr, sl_r, sl_s, out_ptr, sout_r, sout_d, lse_out_ptr,
    rot_ptr, srot_h, srot_i, srot_o, rows_per_head, heads,
    n_splits, D: tl.constexpr, BLOCK_S: tl.constexpr, ROTATE: tl.constexpr, BLOCK_E: tl.constexpr,
    INTERPRET_ROUNDING: tl.constexpr, CHUNK_S: tl.constexpr,
):
    r = tl.program_id(0)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, D)
    lse = tl.load(lse_ptr + r * sl_r + s * sl_s, mask=s < n_splits, other=float("-inf"))
    top = tl.max(lse, axis=0)
    top = tl.where(top == float("-inf"), 0.0, top)
    w = tl.exp(lse - top)
    total = tl.sum(w, axis=0)
    if CHUNK_S == BLOCK_S:
        o = tl.load(o_ptr + r * so_r + s[:, None] * so_s + d[None, :] * so_d, mask=(s < n_splits)[:, None], other=0.0)
        acc = tl.sum(o * w[:, None], axis=0)
    else:
        # the partial outputs CHUNK_S splits at a time: a whole [BLOCK_S, D] float32 tile would spill (`MERGE_TILE`)
        c = tl.arange(0, CHUNK_S)
        acc = tl.zeros([D], dtype=tl.float32)
        for s0 in range(0, n_splits, CHUNK_S):
            sc = s0 + c
            wc = tl.exp(tl.load(lse_ptr + r * sl_r + sc * sl_s, mask=sc < n_splits, other=float("-inf")) - top)
            o = tl.load(o_ptr + r * so_r + sc[:, None] * so_s + d[None, :] * so_d, mask=(sc < n_splits)[:, None],
                        other=0.0)
            acc += tl.sum(o * wc[:, None], axis=0)
    out = acc / tl.maximum(total, 1e-30)
    if ROTATE:
        # the output un-rotated here, out·R_Vᵀ (out_e = Σ_d out_d R[e, d]) in float32: one launch fewer per layer
        # than a GEMV after the op; BLOCK_E output columns at a time keep R's tile in registers
        h = (r // rows_per_head) % heads
        for e0 in tl.static_range(0, D, BLOCK_E):
            e = e0 + tl.arange(0, BLOCK_E)
            rot = tl.load(rot_ptr + h * srot_h + e[:, None] * srot_i + d[None, :] * srot_o).to(tl.float32)
            tl.store(out_ptr + r * sout_r + e * sout_d,
                     to_storage(tl.sum(rot * out[None, :], axis=1), out_ptr.dtype.element_ty, INTERPRET_ROUNDING))
    else:
        tl.store(out_ptr + r * sout_r + d * sout_d, to_storage(out, out_ptr.dtype.element_ty, INTERPRET_ROUNDING))
    tl.store(lse_out_ptr + r, tl.where(total > 0.0, top + tl.log(tl.maximum(total, 1e-30)), float("-inf")))


# ------------------------------------------------------------------------------------------------- launcher
def plan_splits(batch_heads: int, m_tiles: int, n_hist: int, n_extra: int, block_n: int, target_programs: int,
                min_tiles: int = 1):
    """History and extra-segment split sizes so that stage 1 has about `target_programs` programs, each history
    split at least `min_tiles` key tiles long (a program's fixed work, its query set-up and partial output, is
    then spread over several tiles)."""
    per_split = batch_heads * m_tiles
    want = max(1, math.ceil(target_programs / per_split))
    hist_splits = max(1, min(want, math.ceil(n_hist / (block_n * max(min_tiles, 1))))) if n_hist > 0 else 1
    hist_chunk = max(block_n, math.ceil(math.ceil(n_hist / hist_splits) / block_n) * block_n)
    hist_splits = max(1, math.ceil(n_hist / hist_chunk)) if n_hist > 0 else 1
    extra_splits = max(1, min(want, math.ceil(n_extra / block_n))) if n_extra > 0 else 0
    extra_chunk = max(block_n, math.ceil(math.ceil(n_extra / max(extra_splits, 1)) / block_n) * block_n)
    extra_splits = math.ceil(n_extra / extra_chunk) if n_extra > 0 else 0
    return hist_splits, hist_chunk, extra_splits, extra_chunk


def target_programs_for(per_split: int, n_hist: int, sms: int) -> int:
    """Stage 1's program count when the caller names none: `programs_per_sm` per SM, or `programs_per_sm_long` where
    the history would still give each split at least `long_split_tokens` tokens at that count (many (batch, head)
    pairs over a long history: more programs keep more loads in flight without making splits short, where a
    program's fixed work would dominate). `per_split`: programs per history split (batch × KV heads × query tiles)."""
    many = DEFAULT_LAUNCH["programs_per_sm_long"] * sms
    if n_hist >= DEFAULT_LAUNCH["long_split_tokens"] * math.ceil(many / per_split):
        return many
    return DEFAULT_LAUNCH["programs_per_sm"] * sms


# The merge reads a row's partial outputs as one [BLOCK_S, D] float32 tile up to MERGE_TILE elements, in chunks of
# MERGE_CHUNK elements beyond. ptxas (eval/compile_kernels.py, with the un-rotation): one KV head at batch 1 (about
# 1,600 splits, BLOCK_S 2,048) spills 27,636 bytes per thread at D 128 as one tile and none in chunks of 64 splits;
# 256 splits at D 256, 1,624 bytes and 12 in chunks of 32. At D 128 and 256 splits (8 KV heads at batch 1) the one
# tile spills 60 bytes and is kept: that launch's timings are the measured ones.
MERGE_TILE = 32 * 1024
MERGE_CHUNK = 8 * 1024


def merge_chunk(block_s: int, d: int) -> int:
    """The splits the merge reads at a time: all `block_s` (a power of two) if their tile is at most `MERGE_TILE`
    elements, else `MERGE_CHUNK` elements' worth (a power of two, at least 16)."""
    if block_s * d <= MERGE_TILE:
        return block_s
    return max(16, MERGE_CHUNK // d)


def recent_split_plan(n_recent: int, hist_chunk: int, block_n: int) -> tuple[int, int]:
    """(splits, tokens per split) of the BF16 recent window: about as much work per program as a history split
    (`hist_chunk` tokens), in whole key tiles."""
    chunk = max(block_n, min(hist_chunk, -(-max(n_recent, 1) // block_n) * block_n))
    return max(1, -(-n_recent // chunk)), chunk


_SMS: dict = {}
_BULK_PREFETCH: dict = {}
# Launch parameters that measured best on an H200 (eval/bench_gpu.py's tune section, docs/research-log.md, "Decode kernel");
# `ptx_unpack`: codes unpacked by inline PTX (`_planes`; never in the interpreter, which cannot run PTX).
# Decode tiles of the default layout (channel-wise keys, one value group): v6's sweep (results/gpu/bench_gpu.json,
# 30 launches x 3 points) found 4 warps, 12 programs per SM, loads left in the loop with the tiles 2 steps ahead
# asked for in L2 (`l2_ahead`), inline-PTX unpacking best: 78.8 / 185.0 / 2855 us at (B=1, 100K) / (8, 32K) /
# (32, 128K) against v5's loop at 120.2 / 293.4 / 4693 with the same launch. Token-wise keys and multi-token chunks
# keep v4's plain loop with 4 warps. `min_split_tiles`: the fewest key tiles per history split; 1 (splits sized by
# programs per SM alone) stays: at 8, batch 1 measured 52.4 against 58.2 us at 32K but 22.0 against 14.0 us at 4K, and
# 79.1 against 83.2 tokens/s through generate at 4K (H100, results/gpu/decode_split_min_tiles_h100.log).
# `decode_maxnreg`: a register cap (ptxas `.maxnreg`) for the decode tile of the default layout at head_dim 128, where
# the compiler takes 192 registers per thread, so 2 programs of 4 warps fit on an SM; at 168 (no spills, 1% more
# instructions per tile: eval/compile_kernels.py --sass) 3 fit, and their loads overlap (results/gpu/
# decode_register_cap_h100.log). `maxnreg`, when set, caps every launch instead.
# `programs_per_sm_long`, `long_split_tokens` (`target_programs_for`): 24 programs per SM where splits keep at least
# 1,024 tokens. Kernel, format 6, H100 (results/gpu/decode_programs_per_sm_h100.log), 12 against 24 per SM: 32K x 16
# 628.7 -> 586.9 us, 32K x 32 1,230 -> 1,153, 100K x 16 1,859 -> 1,726, 100K x 8 911.3 -> 879.2 (these keep
# >= 1,024 tokens a split at 24); 32K x 8 308.0 / 307.2, 8K x 32 304.1 / 310.2, 32K x 4 163.4 / 164.7, 32K x 1
# 52.5 / 63.1, 100K x 1 126.2 / 152.3 (these would not, and keep 12).
# `cuda_history_min_tokens`: under OSCAR_HF_DECODE_KERNEL=auto (the default), the history (as planned: a static
# cache's capacity) from which the CUDA history kernel reads it. H100, format 6, per layer against the Triton kernel
# alone (results/gpu/cuda_history_h100.log): 4K x 1 0.76x (its extra launch), 8K x 1 1.06x, 32K x 1 1.57x.
# `cuda_history_warps_per_sm`: the CUDA history kernel's splits (cuda_history.py), one warp each; None: as many as
# an SM keeps resident (`cuda_history.RESIDENT_WARPS_PER_SM`), in one wave. With 8 resident, fewer and longer splits
# lost (H100, format 6, per layer with the merge, splits of at least 512 / 1,024 / 2,048 / 4,096 tokens:
# results/gpu/cuda_history_split_sweep_h100.log): 100K x 1 140.9 / 131.6 / 221.5 / 400.1 us, 32K x 8 294.0 / 293.8 /
# 243.3 / 404.0, 32K x 1 68.1 / 114.9 / 209.5 / 387.5 (a warp is slow alone).
DEFAULT_LAUNCH = dict(block_n=128, num_warps=4, num_warps_channel_keys=4, num_stages=1, programs_per_sm=12,
                      min_split_tiles=1, ptx_unpack=True, prefetch=False, l2_ahead=2, split_tile_max=64, maxnreg=None,
                      decode_maxnreg=168, programs_per_sm_long=24, long_split_tokens=1024,
                      cuda_history_warps_per_sm=None, cuda_history_min_tokens=8192)
# launch parameters for a whole process (JSON, e.g. '{"l2_ahead": 4}'): experiments without editing this file
DEFAULT_LAUNCH.update(json.loads(os.environ.get("OSCAR_HF_DECODE_LAUNCH", "{}")))


def key_tile(block_n: int, key_blocks, split_tile_max: int | None = None) -> tuple[int, bool]:
    """The key tile of a launch over channel-wise keys with these per-head blocks, and whether it splits: a tile never
    straddles more than two blocks of a head. Normally the tile is min(block_n, smallest block), dividing every
    block and the chunk (blocks are powers of two >= 16 or multiples of 128). When the blocks mix (calibration's 32,
    64 and 128), the smallest block is half of at most block_n and every other block is a multiple of twice it, the
    tile is twice the smallest block (`split`: heads of the smallest block read two meta rows per tile) instead of
    holding every head at the smallest block's tile (35-45% slower decode on the H200 with one head of 32), up to
    `split_tile_max` (DEFAULT_LAUNCH: 64; blocks of 64 and 128 split at tiles of 128 measured slower than tiles of 64)."""
    smallest = min(key_blocks)
    limit = min(block_n, DEFAULT_LAUNCH["split_tile_max"] if split_tile_max is None else split_tile_max)
    if 2 * smallest <= limit and max(key_blocks) > smallest \
            and all(bk == smallest or bk % (2 * smallest) == 0 for bk in key_blocks):
        return 2 * smallest, True
    return min(block_n, smallest), False


def register_cap(meta_words: bool, register_prefetch: bool, head_dim: int) -> int | None:
    """The launch's ptxas register cap: `DEFAULT_LAUNCH['maxnreg']` when set, else `decode_maxnreg` for the decode tile
    of the default layout (`meta_words`) at head_dim 128 in the loop that leaves its loads in place, the one whose
    registers and spills were counted (the register-prefetching loop spills under it); None (the compiler's choice)
    otherwise."""
    if DEFAULT_LAUNCH["maxnreg"] is not None:
        return DEFAULT_LAUNCH["maxnreg"]
    return DEFAULT_LAUNCH["decode_maxnreg"] if meta_words and not register_prefetch and head_dim == 128 else None


def _pairs_as_words(meta: torch.Tensor) -> bool:
    """Whether every (scale, minimum) pair of a 16-bit meta tensor `[..., 2]` can be read as one aligned 32-bit word."""
    return meta.element_size() == 2 and meta.stride(-1) == 1 and all(st % 2 == 0 for st in meta.stride()[:-1]) \
        and meta.data_ptr() % 4 == 0


def _has_bulk_prefetch(device: torch.device) -> bool:
    """sm_90+ (`cp.async.bulk.prefetch.L2`); on the CPU (compile_kernels.py's no-GPU profile) the launch is kept as
    asked. Cached per device: this runs on every launch."""
    if device.type != "cuda":
        return True
    if device not in _BULK_PREFETCH:
        _BULK_PREFETCH[device] = torch.cuda.get_device_capability(device)[0] >= 9
    return _BULK_PREFETCH[device]


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    if device not in _SMS:
        _SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SMS[device]


def segment_attention_triton(
    q, sink_k, sink_v, hist_codes_k, hist_meta_k, hist_codes_v, hist_meta_v, recent_k, recent_v, extra_k, extra_v,
    key_mask, n_sink, n_hist, n_recent, n_extra, queries_per_group, query_start, scale, key_blocks=(),
    key_chunk: int = 0, wide_rows=(), wide_channels=(), block_n: int | None = None, num_warps: int | None = None,
    num_stages: int | None = None, target_programs: int | None = None, prefetch: bool | None = None,
    l2_ahead: int | None = None, history_kernel=None,
):
    """See `oscar_hf.ops.segment_attention_reference` for the contract. Returns `(out [B, H, M, d] q.dtype, lse [B, H, M] f32)`.
    `history_kernel`: see `_launch`."""
    return _launch(q, sink_k, sink_v, hist_codes_k, hist_meta_k, hist_codes_v, hist_meta_v, recent_k, recent_v,
                   extra_k, extra_v, key_mask, (n_sink, n_hist, n_recent, n_extra, query_start), None,
                   queries_per_group, scale, key_blocks, key_chunk, block_n, num_warps, num_stages, target_programs,
                   prefetch, l2_ahead, wide_rows=wide_rows, wide_channels=wide_channels, history_kernel=history_kernel)


def decode_attention_triton(
    q, sink_k, sink_v, hist_codes_k, hist_meta_k, hist_codes_v, hist_meta_v, ring_k, ring_v, key_mask, lengths,
    queries_per_group, scale, key_blocks=(), key_chunk: int = 0, block_n: int | None = None,
    num_warps: int | None = None, num_stages: int | None = None, target_programs: int | None = None, prefetch: bool | None = None,
    l2_ahead: int | None = None, value_rotation=None, wide_rows=(), wide_channels=(), history_kernel=None,
):
    """See `oscar_hf.ops.decode_attention_reference` for the contract: the same kernel with the lengths read on the
    device (`lengths` int32 [5]) and a fixed grid over the whole history capacity (splits beyond n_hist exit at
    once), so the launch is the same every step; `value_rotation` un-rotates the output in the merge. Returns
    `out [B, H, M, d]` q.dtype."""
    out, _ = _launch(q, sink_k, sink_v, hist_codes_k, hist_meta_k, hist_codes_v, hist_meta_v, ring_k, ring_v,
                     sink_k[:, :, :0], sink_v[:, :, :0], key_mask, None, lengths, queries_per_group, scale, key_blocks,
                     key_chunk, block_n, num_warps, num_stages, target_programs, prefetch, l2_ahead, value_rotation,
                     wide_rows, wide_channels, history_kernel)
    return out


def _launch(q, sink_k, sink_v, hist_codes_k, hist_meta_k, hist_codes_v, hist_meta_v, recent_k, recent_v, extra_k,
            extra_v, key_mask, host_lengths, device_lengths, queries_per_group, scale, key_blocks, key_chunk, block_n,
            num_warps, num_stages, target_programs, prefetch, l2_ahead, value_rotation=None, wide_rows=(),
            wide_channels=(), history_kernel=None):
    """Stage 1 (Triton, every split; or every split but the INT2 history's, which the CUDA history kernel then
    writes) and the merge. `history_kernel`: a function `(params: cuda_history.HistoryParams) -> None` that runs the
    CUDA history kernel on these tensors (the tests' CPU emulation), or None: the CUDA driver's launch where
    `OSCAR_HF_DECODE_KERNEL` lets it take the launch (`cuda_history.wanted`: by default from
    `cuda_history_min_tokens` of history) and it covers the layout (`cuda_history.history_kernel_problem`)."""
    b, h, m, d = q.shape
    key_chunk = int(key_chunk)
    key_blocks = tuple(int(bk) for bk in key_blocks) if key_chunk else ()
    problem = kernel_layout_problem(d, hist_meta_v.shape[3], None if key_chunk else hist_meta_k.shape[3], key_blocks,
                                       bool(wide_rows))
    if problem:
        raise ValueError(problem)
    wide_table = wide_row_table(wide_rows, h, q.device)  # cached: no tensor made on later calls
    channel_table = wide_channel_table(wide_channels, h, d, wide_rows, q.device)  # cached likewise
    if channel_table is not None and not key_chunk:
        raise ValueError(f"wide key channels {list(wide_channels)} are a layout of channel-wise keys, not of "
                         f"token-wise key rows")
    extra_rows = 0 if wide_table is None else sum(int(r) >= 0 for r in wide_rows)
    if hist_codes_k.shape[1] != h + extra_rows or hist_codes_v.shape[1] != h + extra_rows:
        raise ValueError(f"history codes have {hist_codes_k.shape[1]} / {hist_codes_v.shape[1]} head rows for {h} KV "
                         f"heads and wide rows {list(wide_rows)}")
    if key_chunk:
        if len(key_blocks) != h:
            raise ValueError(f"{len(key_blocks)} channel-wise key blocks for {h} KV heads")
        rows_per_chunk = key_rows_per_chunk(key_blocks, key_chunk)
        if hist_meta_k.dim() != 5 or hist_meta_k.shape[2] != rows_per_chunk or hist_meta_k.shape[3] != d:
            raise ValueError(f"channel-wise key meta must be [B, n_chunks, {rows_per_chunk}, {d}, 2] for blocks "
                             f"{list(key_blocks)} in chunks of {key_chunk}, got {list(hist_meta_k.shape)}")
        key_table = key_block_table(key_blocks, key_chunk, q.device)  # cached: no tensor made on later calls
    else:
        key_table = hist_codes_k  # never read
    block_m = 16 if m <= 16 else 64
    # long query tiles with wide key tiles exceed the shared memory; 64 keys suffice there
    block_n = block_n or (DEFAULT_LAUNCH["block_n"] if block_m == 16 and d <= 128 else 64)
    key_split = False
    if key_chunk:
        # a key tile straddles at most two channel-wise blocks of a head (`key_tile`)
        block_n, key_split = key_tile(block_n, key_blocks)
    # decode tiles (16 query rows) of channel-wise keys have their own measured warp count (v5: 2, v6: 4)
    num_warps = num_warps or DEFAULT_LAUNCH["num_warps_channel_keys" if key_chunk and block_m == 16 else "num_warps"]
    num_stages = num_stages or DEFAULT_LAUNCH["num_stages"]
    m_tiles = triton.cdiv(m, block_m)
    if device_lengths is None:
        n_sink, n_hist, n_recent, n_extra, query_start = host_lengths
        plan_hist, plan_recent, ring_size = n_hist, n_recent, recent_k.shape[2]
    else:  # planned for the whole capacity: the same grid every step
        n_sink = n_hist = n_recent = n_extra = query_start = 0
        plan_hist, plan_recent, ring_size = hist_codes_k.shape[2], recent_k.shape[2], recent_k.shape[2]
    has_mask = key_mask is not None
    mask = key_mask if has_mask else q.new_empty(1, 1, dtype=torch.bool)
    if mask.dtype == torch.bool:
        mask = mask.view(torch.uint8)
    groups = hist_meta_v.shape[3]
    # Decode tiles of the default layout take `_int2_range_words` (each (scale, minimum) pair read as one 32-bit
    # word), with the next tile prefetched into registers (`prefetch`) or `l2_ahead` tiles ahead into L2 (sm_90's bulk
    # prefetch; not in the interpreter). The register prefetch spills with 64-row chunk tiles or head_dim 256
    # (ptxas, eval/compile_kernels.py): those keep the plain loop.
    prefetch = bool(DEFAULT_LAUNCH["prefetch"] if prefetch is None else prefetch)
    l2_ahead = int(DEFAULT_LAUNCH["l2_ahead"] if l2_ahead is None else l2_ahead)
    meta_words = key_chunk > 0 and groups == 1 and block_m == 16 and d <= 128 and (prefetch or l2_ahead > 0) \
        and _pairs_as_words(hist_meta_k) and _pairs_as_words(hist_meta_v)
    if meta_words:
        hist_meta_k, hist_meta_v = hist_meta_k.view(torch.int32), hist_meta_v.view(torch.int32)
    else:
        prefetch, l2_ahead = False, 0
    maxnreg = register_cap(meta_words, prefetch, d)
    rows_contiguous = all(t.stride(-1) == 1 and t.stride(-2) == t.shape[-1] for t in (hist_codes_k, hist_codes_v))
    if INTERPRET or not rows_contiguous or not _has_bulk_prefetch(q.device):
        l2_ahead = 0  # the same loop without the hint (the interpreter cannot run PTX)
    problem = lambda: cuda_history.history_kernel_problem(  # noqa: E731
        q, hist_codes_k, hist_meta_k, hist_codes_v, hist_meta_v, key_chunk, groups, wide_table, meta_words)
    if history_kernel is not None:  # a caller's runner (the CPU emulation) must be covered
        if problem() is not None:
            raise ValueError(f"the CUDA history kernel does not cover this launch: {problem()}")
    elif (q.device.type == "cuda" and cuda_history.wanted(plan_hist, DEFAULT_LAUNCH["cuda_history_min_tokens"], problem)
          and cuda_history.available(q.device, wide_table is not None)):
        history_kernel = lambda params: cuda_history.launch(params, q.device)  # noqa: E731
    if history_kernel is not None and target_programs is None:
        # the CUDA kernel: one warp a split, whole splits per (batch, KV head) that keep the warps within one wave of
        # what an SM keeps resident (a few warps over it would run as a second wave alone and nearly double the time:
        # 32K x 8 had 17 splits a head at 8 warps per SM)
        per_split = b * h * m_tiles
        warps = DEFAULT_LAUNCH["cuda_history_warps_per_sm"] or cuda_history.RESIDENT_WARPS_PER_SM[wide_table is not None]
        target = per_split * max(1, warps * _sm_count(q.device) // per_split)
    else:
        target = target_programs or target_programs_for(b * h * m_tiles, plan_hist, _sm_count(q.device))
    min_tiles = DEFAULT_LAUNCH["min_split_tiles"]
    hist_splits, hist_chunk, extra_splits, extra_chunk = plan_splits(b * h, m_tiles, plan_hist, n_extra, block_n, target,
                                                                     min_tiles)
    # with the CUDA kernel reading the history, this launch is the sink and the window alone: the window in key tiles,
    # one program each (a program over a whole history split's worth, 384 tokens, took 22 us at 100K x 1 on an H100,
    # a quarter of the layer: eval/results/gpu/cuda_history_h100.log)
    recent_splits, recent_chunk = recent_split_plan(plan_recent, block_n if history_kernel is not None else hist_chunk,
                                                    block_n)
    n_splits = 1 + hist_splits + recent_splits + extra_splits
    partial = torch.empty(b, h, m, n_splits, d, device=q.device, dtype=torch.float32)
    partial_lse = torch.empty(b, h, m, n_splits, device=q.device, dtype=torch.float32)
    launched_splits = n_splits - (hist_splits if history_kernel is not None else 0)
    _segment_attention_kernel[(b * h, m_tiles, launched_splits)](
        q, *q.stride(),
        partial, *partial.stride(),
        partial_lse, *partial_lse.stride(),
        sink_k, sink_v, *sink_k.stride(),
        hist_codes_k, *hist_codes_k.stride(),
        hist_codes_v, *hist_codes_v.stride(),
        hist_meta_k, *hist_meta_k.stride(), key_table, hist_codes_k if wide_table is None else wide_table,
        hist_codes_k if channel_table is None else channel_table,
        hist_meta_v, *hist_meta_v.stride(),
        recent_k, recent_v, *recent_k.stride(),
        extra_k, extra_v, *extra_k.stride(),
        mask, *mask.stride(),
        h, m, queries_per_group, query_start,
        n_sink, n_hist, n_recent, n_extra,
        hist_splits, hist_chunk, recent_splits, recent_chunk, extra_chunk,
        scale * LOG2E, device_lengths if device_lengths is not None else q, ring_size,
        D=d, GROUPS=groups, KEY_CHUNK=key_chunk, BLOCK_M=block_m, BLOCK_N=block_n, HAS_MASK=has_mask, UPCAST=INTERPRET,
        DEVICE_LENGTHS=device_lengths is not None, PTX_UNPACK=DEFAULT_LAUNCH["ptx_unpack"] and not INTERPRET,
        META_WORDS=meta_words, PREFETCH=prefetch, L2_AHEAD=l2_ahead, KEY_SPLIT=key_split, WIDE=wide_table is not None,
        WIDE_CHANNELS=channel_table is not None, SKIP_HISTORY=history_kernel is not None, num_warps=num_warps,
        num_stages=num_stages,
        # a register cap (ptxas `.maxnreg`) trades spills for more programs per SM; None: the compiler's choice
        **({} if maxnreg is None or INTERPRET else {"maxnreg": maxnreg}),
    )
    if history_kernel is not None:
        history_kernel(cuda_history.history_params(
            q, partial, partial_lse, hist_codes_k, hist_meta_k, hist_codes_v, hist_meta_v, key_table, channel_table,
            wide_table, mask if has_mask else None, device_lengths,
            None if device_lengths is not None else (n_sink, n_hist, n_recent, n_extra, query_start),
            queries_per_group, hist_splits, hist_chunk, key_chunk, scale * LOG2E))
    out = torch.empty(b, h, m, d, device=q.device, dtype=q.dtype)
    lse = torch.empty(b, h, m, device=q.device, dtype=torch.float32)
    rows = b * h * m
    rotate = value_rotation is not None
    if rotate and tuple(value_rotation.shape) != (h, d, d):
        raise ValueError(f"value_rotation must be [{h}, {d}, {d}], got {list(value_rotation.shape)}")
    rot = value_rotation if rotate else q
    block_s = triton.next_power_of_2(n_splits)
    _merge_kernel[(rows,)](
        partial.view(rows, n_splits, d), n_splits * d, d, 1,
        partial_lse.view(rows, n_splits), n_splits, 1,
        out.view(rows, d), d, 1, lse.view(rows),
        rot, *(rot.stride() if rotate else (0, 0, 0)), m, h,
        n_splits, D=d, BLOCK_S=block_s, ROTATE=rotate, BLOCK_E=max(16, min(d, 4096 // d)),
        INTERPRET_ROUNDING=INTERPRET, CHUNK_S=merge_chunk(block_s, d),
    )
    return out, lse
