"""Fused rotate -> clip -> quantize -> pack (Triton), the kernel twin of `oscar_hf.quant` + `OscarLayer` demotion.

One program handles BLOCK_T rows (tokens) of one (batch, KV head): optionally rotates them (x·R_h with `tl.dot`,
rounded to the storage dtype exactly like the torch path's matmul), clips each row at its quantile threshold
τ = sort(|x|)[floor(r·d)] (found by bisection over the bit patterns, `_order_statistic_abs`), computes per-group
min/max, a 16-bit scale and minimum, codes rint((x − m)/s) ∈ [0, 3] from the *stored* scale/minimum, and packs 4
codes per byte along head_dim in quarter
planes (byte j = c[j] | c[j+d/4]<<2 | c[j+d/2]<<4 | c[j+3d/4]<<6), the convention of `oscar_hf.quant`.
Channel-wise keys (`_quantize_pack_channels_kernel`): one program per chunk of tokens of one (batch, KV head), one
(scale, minimum) per channel per block of the head's own block size, written into the layer's chunked key meta
`[B, n_chunks, R, d, 2]` (`oscar_hf.format.StreamFormat`; the per-head block and row offset come from a small
device table, `key_block_table`).
Wide heads (`wide_row_table`: per KV head the codes row of its low plane, or -1): both kernels quantize those heads'
rows with 15 levels and store the 4-bit code c = 4·h + l as the high plane h in the head's row and the low plane l in
its extra row, the meta's scale being the high plane's, 4·s (`oscar_hf.quant`, "wide heads").
Wide key channels (channel-wise keys; `wide_channel_table`: per KV head its n wide key channels): channels j < n of the
head are quantized like a wide head's (15 levels, stored scale 4·s_j) and keep their high plane in slot j; slot
d − n + j gets channel j's low plane, stored under (s_j, μ), μ the block mean of that slot's own channel
(`oscar_hf.quant.quantize_wide_channels`). The channel-wise kernel quantizes every channel in place and then gathers
the low planes into their slots (`tl.gather` of the tile's codes): the rows, rotated or not, are read as before.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from ..format import StreamFormat


@triton.jit
def _scale_minimum(lo, hi, META: tl.constexpr, wide):
    # The stored scale and minimum, rounded to the metadata dtype exactly as `quant.quantize_rows` does
    # (META: 0 float16, 1 bfloat16, 2 float32; clamped to the dtype's range, scale at least its smallest normal).
    # `wide` (a wide head): the 4-bit step, within a quarter of the range (its stored scale is 4x: `_stored_scale`).
    levels = tl.where(wide, 15.0, 3.0)
    if META == 1:
        scale = tl.minimum(tl.maximum((hi - lo) / levels, 1.1754943508222875e-38),
                           tl.where(wide, 8.507059173023462e37, 3.4028234663852886e38)).to(tl.bfloat16)
        minimum = lo.to(tl.bfloat16)
    elif META == 2:
        scale = tl.minimum(tl.maximum((hi - lo) / levels, 1.1754943508222875e-38),
                           tl.where(wide, 8.507059173023462e37, 3.4028234663852886e38))
        minimum = lo
    else:
        scale = tl.minimum(tl.maximum((hi - lo) / levels, 6.103515625e-05), tl.where(wide, 16376.0, 65504.0)).to(tl.float16)
        minimum = tl.minimum(tl.maximum(lo, -65504.0), 65504.0).to(tl.float16)
    return scale, minimum


@triton.jit
def _meta_value(v, META: tl.constexpr):
    """A float32 value rounded to the metadata dtype, clamped to its range (as `_scale_minimum`'s minimum)."""
    if META == 1:
        return v.to(tl.bfloat16)
    elif META == 2:
        return v
    else:
        return tl.minimum(tl.maximum(v, -65504.0), 65504.0).to(tl.float16)


@triton.jit
def _wide_codes(x, s, m, wide):
    """Codes rint((x − m)/s) in [0, 3], or, for a wide head, the 4-bit code's (high, low) 2-bit planes in [0, 15]."""
    v = tl.minimum(tl.maximum((x - m) / s, 0.0), tl.where(wide, 15.0, 3.0))  # clamping first: rint keeps integers
    # adding 1.5·2^23 rounds v to an integer half to even (as torch.round), left in the float's low mantissa bits
    codes = (v + 12582912.0).to(tl.int32, bitcast=True) & 15
    return tl.where(wide, codes >> 2, codes), codes & 3


@triton.jit
def _stored_scale(scale, wide):
    """The meta's scale: a wide head's is its high plane's, 4·s (exact in the meta dtype)."""
    return tl.where(wide, scale * 4.0, scale.to(tl.float32)).to(scale.dtype)


@triton.jit
def to_storage(y, dtype: tl.constexpr, INTERPRET: tl.constexpr):
    """float32 -> the storage dtype, rounded to nearest even as on a GPU: the Triton interpreter's bf16 conversion
    truncates, which in the CPU tests biased every stored token by up to an ulp towards zero."""
    if INTERPRET and dtype == tl.bfloat16:
        bits = y.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        y = bits.to(tl.float32, bitcast=True)
    return y.to(dtype)


@triton.jit
def _rotated_rows(x_ptr, r, b, h, rows, row_ok, cols, sx_b, sx_h, sx_t, sx_d,
                  ROTATE: tl.constexpr, STORE_BF16: tl.constexpr, UPCAST: tl.constexpr):
    x = tl.load(x_ptr + b * sx_b + h * sx_h + rows[:, None] * sx_t + cols[None, :] * sx_d, mask=row_ok[:, None], other=0.0)
    if ROTATE:
        if UPCAST:  # the Triton interpreter (CPU tests) mishandles 16-bit dot operands
            x = tl.dot(x.to(tl.float32), r.to(tl.float32))
        else:
            x = tl.dot(x, r, out_dtype=tl.float32)
        # the torch path rotates with a matmul in the storage dtype: round the same way
        x = to_storage(x, tl.bfloat16 if STORE_BF16 else tl.float16, UPCAST)
    return x.to(tl.float32)


@triton.jit
def _quantize_pack_channels_kernel(
    x_ptr, rot_ptr, codes_ptr, meta_ptr, table_ptr, wide_ptr, channels_ptr,
    heads, start_chunk, start, start_ptr,
    sx_b, sx_h, sx_t, sx_d,
    sr_h, sr_i, sr_j,
    sc_b, sc_h, sc_t, sc_d,
    sm_b, sm_c, sm_r, sm_d, sm_2,
    D: tl.constexpr, KEY_CHUNK: tl.constexpr, SUB: tl.constexpr,
    ROTATE: tl.constexpr, STORE_BF16: tl.constexpr, META: tl.constexpr, UPCAST: tl.constexpr,
    DEVICE_START: tl.constexpr, X_RING: tl.constexpr, ring_size, WIDE: tl.constexpr, WIDE_CHANNELS: tl.constexpr,
):
    # One program per (chunk of KEY_CHUNK tokens, batch·head). Head h splits the chunk into blocks of `block` tokens
    # (`table_ptr` [H, 2] int32: block, first meta row of the head within a chunk); per block, pass 1 finds each
    # channel's min/max, pass 2 quantizes and packs (rows rotated twice rather than held: a whole block does not fit
    # in registers at d = 256). Meta `[B, n_chunks, R, d, 2]`: block j of chunk c at row (c, offset + j).
    # DEVICE_START: the first row is read on the device (a static cache's decode step); negative: write nothing.
    # X_RING: x is a ring of `ring_size` slots, history row j at slot j mod ring_size (the static cache's BF16 ring,
    # read in place rather than gathered first: one launch fewer per layer and step).
    # WIDE_CHANNELS (`channels_ptr` [H] int32: n per head): channels j < n at 15 levels, the high plane in slot j
    # (stored scale 4·s_j), the low plane gathered into slot D − n + j, whose meta is (s_j, its own channel's block
    # mean). The mean sums in float64, exact whatever the order for 16-bit values (a float32 sum's last bit depends
    # on its order, which no twin can reproduce), then is divided by the block and rounded to float32.
    if DEVICE_START:
        start = tl.load(start_ptr)
        if start < 0:
            return
        start_chunk = start // KEY_CHUNK
    pid_c = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // heads
    h = pid_bh % heads
    block = tl.load(table_ptr + 2 * h)
    offset = tl.load(table_ptr + 2 * h + 1)
    if WIDE:
        wide_row = tl.load(wide_ptr + h)  # a wide head's low plane row, or -1
    else:
        wide_row = -1
    wide = wide_row >= 0
    cols = tl.arange(0, D)
    if WIDE_CHANNELS:
        n_wide = tl.load(channels_ptr + h)
        low_slot = cols >= D - n_wide  # slots of the 4-bit channels' low planes: meta (s_j, block mean)
        paired = tl.where(low_slot, cols - (D - n_wide), cols)  # the channel whose code each slot holds
        four = wide | (cols < n_wide)  # channels quantized at 15 levels (a wide head: all of them)
    else:
        four = wide
    if ROTATE:  # loaded once for every block of the chunk, both passes
        r = tl.load(rot_ptr + h * sr_h + cols[:, None] * sr_i + cols[None, :] * sr_j)
    else:
        r = 0.0
    qcols = tl.arange(0, D // 4)
    shifts = (tl.arange(0, 4) * 2)[None, :, None]
    meta_chunk = meta_ptr + b * sm_b + (start_chunk + pid_c) * sm_c + cols * sm_d
    for j in range(0, KEY_CHUNK // block):
        first = pid_c * KEY_CHUNK + j * block  # the block's first row of x
        lo = tl.full((D,), float("inf"), tl.float32)
        hi = tl.full((D,), float("-inf"), tl.float32)
        if WIDE_CHANNELS:
            total = tl.zeros((D,), tl.float64)
        for t0 in range(0, block, SUB):
            rows = first + t0 + tl.arange(0, SUB)
            xrows = (start + rows) % ring_size if X_RING else rows
            x = _rotated_rows(x_ptr, r, b, h, xrows, xrows >= 0, cols, sx_b, sx_h, sx_t, sx_d, ROTATE, STORE_BF16, UPCAST)
            lo = tl.minimum(lo, tl.min(x, axis=0))
            hi = tl.maximum(hi, tl.max(x, axis=0))
            if WIDE_CHANNELS:
                total += tl.sum(x.to(tl.float64), axis=0)
        scale, minimum = _scale_minimum(lo, hi, META, four)
        meta_base = meta_chunk + (offset + j) * sm_r
        if WIDE_CHANNELS:
            mean = _meta_value((total / block).to(tl.float32), META)
            tl.store(meta_base, _stored_scale(scale, four), mask=~low_slot)
            tl.store(meta_base + (D - n_wide) * sm_d, scale, mask=cols < n_wide)  # s_j into slot D − n + j
            tl.store(meta_base + sm_2, tl.where(low_slot, mean, minimum))
        else:
            tl.store(meta_base, _stored_scale(scale, wide))
            tl.store(meta_base + sm_2, minimum)
        s = scale.to(tl.float32)
        m = minimum.to(tl.float32)
        for t0 in range(0, block, SUB):
            rows = first + t0 + tl.arange(0, SUB)
            xrows = (start + rows) % ring_size if X_RING else rows
            x = _rotated_rows(x_ptr, r, b, h, xrows, xrows >= 0, cols, sx_b, sx_h, sx_t, sx_d, ROTATE, STORE_BF16, UPCAST)
            if WIDE_CHANNELS:
                codes, low = _wide_codes(x, s[None, :], m[None, :], four[None, :])
                index = tl.broadcast_to(paired[None, :], (SUB, D))
                codes = tl.where(low_slot[None, :], tl.gather(low, index, axis=1), codes)
            else:
                codes, low = _wide_codes(x, s[None, :], m[None, :], wide)
            codes = tl.reshape(codes, (SUB, 4, D // 4))
            packed = tl.sum(codes << shifts, axis=1).to(tl.uint8)  # disjoint bits: the sum is the bitwise or
            tl.store(codes_ptr + b * sc_b + h * sc_h + (start + rows)[:, None] * sc_t + qcols[None, :] * sc_d, packed)
            if WIDE:
                if wide:
                    low_packed = tl.sum(tl.reshape(low, (SUB, 4, D // 4)) << shifts, axis=1).to(tl.uint8)
                    tl.store(codes_ptr + b * sc_b + wide_row * sc_h + (start + rows)[:, None] * sc_t + qcols[None, :] * sc_d,
                             low_packed)


@triton.jit
def _count_at_most(keys, mid, PAIRS: tl.constexpr):
    """Per row, #{patterns <= mid}. PAIRS: `keys` holds two 15-bit patterns p per uint32, stored as 0x8000 − p in
    its 16-bit halves: adding mid (< 0x8000) to both halves sets bit 15 of a half exactly when p <= mid, with no
    carry into the other half, so one add counts two patterns."""
    if PAIRS:
        c = tl.sum(((keys + mid[:, None] * 0x10001) & 0x80008000) >> 15, axis=1)
        return ((c & 0xFFFF) + (c >> 16)).to(tl.int32)
    return tl.sum((keys <= mid[:, None]).to(tl.int32), axis=1)


@triton.jit
def _order_statistic_abs(x, k, STORE_BF16: tl.constexpr, SORT_BITS: tl.constexpr):
    """Per row of x [T, D], the k-th smallest |x| (0-based): exactly sort(|x|)[k], found without a sort.

    Non-negative floats order like their bit patterns, so the threshold is the smallest pattern t with
    #{|x| <= t} >= k + 1, found by bisection over the patterns up to the row's largest: one compare-and-count pass
    per bit. The first split is four octaves below the largest rather than halfway (clip thresholds that far below
    a row's largest |x| are rare: most rows are left with four octaves, 9 more passes for bf16 rather than 14); the
    passes then go on while some row of the tile has more than one candidate. Rows stored in 16 bits (bf16 / fp16,
    as the cache's are, rotated or not) have 15-bit patterns, counted two per 32-bit add (`_count_at_most`);
    float32 rows have 31-bit ones. (A four-way search, three counts per pass, measured slower on the H200: the
    compares cost, not the reductions; docs/research-log.md.)"""
    if SORT_BITS == 16:
        # pairs of neighbouring columns (in one thread: the split moves nothing, and the search stays in its layout)
        even, odd = tl.split(tl.reshape(x, (x.shape[0], x.shape[1] // 2, 2)))
        top = tl.max(tl.maximum(tl.abs(even), tl.abs(odd)), axis=1)
        if STORE_BF16:  # x holds bf16 values: a pattern is the top half of the float32's, less the sign
            pairs = (even.to(tl.uint32, bitcast=True) >> 16) | (odd.to(tl.uint32, bitcast=True) & 0xFFFF0000)
            pairs = pairs & 0x7FFF7FFF
            top = top.to(tl.uint32, bitcast=True) >> 16
            span: tl.constexpr = 4 << 7  # four octaves of patterns: 2^7 each (7 mantissa bits)
        else:
            pairs = (even.to(tl.float16).to(tl.uint16, bitcast=True).to(tl.uint32) | (
                odd.to(tl.float16).to(tl.uint16, bitcast=True).to(tl.uint32) << 16)) & 0x7FFF7FFF
            top = top.to(tl.float16).to(tl.uint16, bitcast=True).to(tl.uint32)
            span: tl.constexpr = 4 << 10
        keys = 0x80008000 - pairs
    else:
        keys = tl.abs(x).to(tl.uint32, bitcast=True)
        top = tl.max(keys, axis=1)
        span: tl.constexpr = 4 << 23
    lo = tl.zeros((x.shape[0],), tl.uint32)
    hi = top
    mid = tl.where(hi > span, hi - span, lo)
    enough = _count_at_most(keys, mid, SORT_BITS == 16) >= k + 1
    hi = tl.where(enough, mid, hi)
    lo = tl.where(enough, lo, mid + 1)
    # passes left: the bit length of the widest row's hi − lo (its float32 exponent; rounding up costs one pass)
    passes = (tl.max(hi - lo).to(tl.float32).to(tl.int32, bitcast=True) >> 23) - 126
    for _ in range(passes):
        mid = lo + ((hi - lo) >> 1)
        enough = _count_at_most(keys, mid, SORT_BITS == 16) >= k + 1
        hi = tl.where(enough, mid, hi)
        lo = tl.where(enough, lo, mid + 1)
    if SORT_BITS == 16:
        if STORE_BF16:
            return (lo << 16).to(tl.float32, bitcast=True)
        return lo.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo.to(tl.float32, bitcast=True)


@triton.jit
def _quantize_pack_kernel(
    x_ptr, rot_ptr, codes_ptr, meta_ptr, wide_ptr,
    n_rows, heads, start, start_ptr,
    sx_b, sx_h, sx_t, sx_d,
    sr_h, sr_i, sr_j,
    sc_b, sc_h, sc_t, sc_d,
    sm_b, sm_h, sm_t, sm_g, sm_2,
    clip_index,
    D: tl.constexpr, GROUPS: tl.constexpr, BLOCK_T: tl.constexpr,
    ROTATE: tl.constexpr, CLIP: tl.constexpr, STORE_BF16: tl.constexpr, META: tl.constexpr,
    UPCAST: tl.constexpr, SORT_BITS: tl.constexpr, TILES: tl.constexpr, DEVICE_START: tl.constexpr,
    WIDE: tl.constexpr,
):
    # One program per TILES consecutive tiles of BLOCK_T rows of one (batch, KV head): the rotation is read once per
    # program, not once per tile. DEVICE_START as in `_quantize_pack_channels_kernel`.
    if DEVICE_START:
        start = tl.load(start_ptr)
        if start < 0:
            return
    pid_t = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // heads
    h = pid_bh % heads
    if WIDE:
        wide_row = tl.load(wide_ptr + h)  # a wide head's low plane row, or -1
    else:
        wide_row = -1
    wide = wide_row >= 0
    cols = tl.arange(0, D)
    if ROTATE:
        r = tl.load(rot_ptr + h * sr_h + cols[:, None] * sr_i + cols[None, :] * sr_j)
    else:
        r = 0.0
    GS: tl.constexpr = D // GROUPS
    shifts = (tl.arange(0, 4) * 2)[None, :, None]
    qcols = tl.arange(0, D // 4)
    g = tl.arange(0, GROUPS)
    for tile in range(TILES):
        rows = (pid_t * TILES + tile) * BLOCK_T + tl.arange(0, BLOCK_T)
        row_ok = rows < n_rows
        x = _rotated_rows(x_ptr, r, b, h, rows, row_ok, cols, sx_b, sx_h, sx_t, sx_d, ROTATE, STORE_BF16, UPCAST)
        if CLIP:
            if wide_row < 0:  # a wide head's rows are stored unclipped (`quant.quantize`)
                tau = _order_statistic_abs(x, clip_index, STORE_BF16, SORT_BITS)
                x = tl.minimum(tl.maximum(x, -tau[:, None]), tau[:, None])
        xg = tl.reshape(x, (BLOCK_T, GROUPS, GS))
        lo = tl.min(xg, axis=2)
        hi = tl.max(xg, axis=2)
        scale, minimum = _scale_minimum(lo, hi, META, wide)
        s = scale.to(tl.float32)
        m = minimum.to(tl.float32)
        codes, low = _wide_codes(xg, s[:, :, None], m[:, :, None], wide)
        codes = tl.reshape(codes, (BLOCK_T, 4, D // 4))
        packed = tl.sum(codes << shifts, axis=1).to(tl.uint8)  # disjoint bits: the sum is the bitwise or
        tl.store(codes_ptr + b * sc_b + h * sc_h + (start + rows)[:, None] * sc_t + qcols[None, :] * sc_d,
                 packed, mask=row_ok[:, None])
        if WIDE:
            if wide:
                low_packed = tl.sum(tl.reshape(low, (BLOCK_T, 4, D // 4)) << shifts, axis=1).to(tl.uint8)
                tl.store(codes_ptr + b * sc_b + wide_row * sc_h + (start + rows)[:, None] * sc_t + qcols[None, :] * sc_d,
                         low_packed, mask=row_ok[:, None])
        meta_base = meta_ptr + b * sm_b + h * sm_h + (start + rows)[:, None] * sm_t + g[None, :] * sm_g
        tl.store(meta_base, _stored_scale(scale, wide), mask=row_ok[:, None])
        tl.store(meta_base + sm_2, minimum, mask=row_ok[:, None])


_META_CODES = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}
# Token-wise launches: how many row tiles one program quantizes (eval/bench_gpu.py's quant section times 1 and 8).
# 8 was faster before the clip search was bracketed (H200: 635 against 714 us for 100K tokens x 8 heads); since then
# 1 is (H100, two calls: 229.1 / 227.7 against 237.7 / 236.4 us; results/gpu/prefill_quantize_h100.log).
QUANTIZE_LAUNCH = dict(tiles_per_program=1)
_MIN_PROGRAMS = 512  # ~4 per SM on an H200: fewer tiles per program rather than an idle GPU
_KEY_BLOCK_TABLES: dict = {}


def stream_format(heads: int, head_dim: int, key_blocks=(), key_chunk: int = 0, wide_rows=(),
                  wide_channels=()) -> StreamFormat:
    """The 2-bit `oscar_hf.format.StreamFormat` the flat arguments of a launch describe (validated there; cached)."""
    key = (int(heads), int(head_dim), tuple(int(b) for b in key_blocks) if key_chunk else (), int(key_chunk),
           tuple(int(r) for r in wide_rows), tuple(int(n) for n in wide_channels))
    fmt = _FORMATS.get(key)
    if fmt is None:
        if key[5] and any(key[5]) and not key_chunk:
            raise ValueError(f"wide key channels {list(key[5])} are a layout of channel-wise keys, not of token-wise "
                             "rows")
        fmt = _FORMATS[key] = StreamFormat(key[0], key[1], 2, "channel" if key_chunk else "token", blocks=key[2],
                                           chunk=key[3] or 1, wide_rows=key[4], wide_channels=key[5])
    return fmt


_FORMATS: dict = {}


def key_block_table(key_blocks, key_chunk: int, device: torch.device) -> torch.Tensor:
    """The int32 `[H, 2]` device table (block, first meta row within a chunk) of each KV head's channel-wise key
    blocks (`oscar_hf.format.StreamFormat`), which the kernels read per head. Cached per (blocks, chunk, device):
    made on the first (eager) call, reused afterwards, so that a launch inside CUDA-graph capture creates no tensor."""
    key = (tuple(int(b) for b in key_blocks), int(key_chunk), device)
    table = _KEY_BLOCK_TABLES.get(key)
    if table is None:
        fmt = stream_format(len(key[0]), 1 << 16, key[0], key[1])  # checks that every block divides the chunk
        table = _KEY_BLOCK_TABLES[key] = torch.tensor(list(zip(fmt.blocks, fmt.offsets)), dtype=torch.int32,
                                                      device=device)
    return table


_WIDE_TABLES: dict = {}


def wide_row_table(wide_rows, heads: int, device: torch.device) -> torch.Tensor | None:
    """The int32 `[H]` device table of each KV head's low-plane codes row (`oscar_hf.format.wide_rows`; -1: not
    wide), or None when no head is wide. Cached like `key_block_table`."""
    rows = tuple(int(r) for r in wide_rows)
    if not rows:
        return None
    key = (rows, device)
    table = _WIDE_TABLES.get(key)
    if table is None:
        stream_format(heads, 64, wide_rows=rows)  # checks the numbering
        table = _WIDE_TABLES[key] = torch.tensor(rows, dtype=torch.int32, device=device)
    return table


_WIDE_CHANNEL_TABLES: dict = {}


def wide_channel_table(wide_channels, heads: int, head_dim: int, wide_rows,
                       device: torch.device) -> torch.Tensor | None:
    """The int32 `[H]` device table of each KV head's wide key channels (`oscar_hf.format.StreamFormat`), or None
    when no head has any. Cached like `key_block_table`."""
    counts = tuple(int(n) for n in wide_channels)
    if not any(counts):
        return None
    key = (counts, int(head_dim), tuple(int(r) for r in wide_rows), device)
    table = _WIDE_CHANNEL_TABLES.get(key)
    if table is None:
        stream_format(heads, head_dim, (1,) * heads, 1, key[2], counts)  # checks the counts
        table = _WIDE_CHANNEL_TABLES[key] = torch.tensor(counts, dtype=torch.int32, device=device)
    return table


def key_rows_per_chunk(key_blocks, key_chunk: int) -> int:
    """R: key meta rows per chunk, all heads together."""
    return stream_format(len(key_blocks), 1 << 16, key_blocks, key_chunk).rows_per_chunk


def quantize_pack_triton(
    x: torch.Tensor,
    rotation: torch.Tensor | None,
    clip_ratio: float,
    codes: torch.Tensor,
    meta: torch.Tensor,
    start: int | torch.Tensor,
    key_blocks=(),
    key_chunk: int = 0,
    wide_rows=(),
    wide_channels=(),
    tiles_per_program: int | None = None,
    ring: int = 0,
) -> None:
    """Writes rows `x` `[B, H, n, d]` (rotated by `rotation` `[H, d, d]` first, if given) into
    `codes[:, :, start:start+n]` `[B, H, L, d/4]` uint8 and the matching meta rows: token-wise (`key_chunk == 0`,
    meta `[B, H, L, G, 2]`, rows of 2-bit heads clipped at `clip_ratio`) or channel-wise with KV head h over blocks of
    `key_blocks[h]` tokens in chunks of `key_chunk` (meta `[B, L/key_chunk, R, d, 2]`, `quant.KeyBlockLayout`; no
    clip; `start` and n multiples of the chunk). `start` may be an int64 device tensor of one element, read by the
    kernel (nothing is written when it is negative; the caller keeps it a multiple of the chunk and in range).
    `ring` > 0 (channel-wise, device `start`): x `[B, H, >= ring, d]` is a ring, history row j at slot j mod ring, and
    the one chunk of rows [start, start + key_chunk) is read from it. `wide_rows`: wide heads, their low planes in
    the codes' rows after the H heads (`[B, H + U, L, d/4]`). `wide_channels` (channel-wise only): each KV head's
    wide key channels (`quant.quantize_wide_channels`; empty: none)."""
    b, h, n, d = x.shape
    wide = wide_row_table(wide_rows, h, x.device)
    channels = wide_channel_table(wide_channels, h, d, wide_rows, x.device)
    if channels is not None and not key_chunk:
        raise ValueError(f"wide key channels {list(wide_channels)} are a layout of channel-wise keys, not of "
                         f"token-wise rows")
    if codes.shape[1] != h + (0 if wide is None else sum(int(r) >= 0 for r in wide_rows)):
        raise ValueError(f"codes have {codes.shape[1]} head rows for {h} KV heads and wide rows {list(wide_rows)}")
    wide_ptr = codes if wide is None else wide  # never read without wide heads
    if ring:
        if not key_chunk or not isinstance(start, torch.Tensor) or x.shape[2] < ring:
            raise ValueError("a ring source is read by channel-wise writes at a device start, from a ring of x's rows")
        n = key_chunk
    if n == 0:
        return
    rot = rotation if rotation is not None else x.new_empty(1, 1, 1)
    upcast = os.environ.get("TRITON_INTERPRET") == "1"
    device_start = isinstance(start, torch.Tensor)
    start_ptr = start if device_start else codes  # never read for a host start
    start = 0 if device_start else int(start)
    if key_chunk:
        if n % key_chunk or start % key_chunk:
            raise ValueError(f"channel-wise quantization takes whole chunks of {key_chunk} tokens (n={n}, start={start})")
        if len(key_blocks) != h:
            raise ValueError(f"{len(key_blocks)} key blocks for {h} KV heads")
        rows = key_rows_per_chunk(key_blocks, key_chunk)
        if meta.dim() != 5 or meta.shape[2] != rows or meta.shape[3] != d:
            raise ValueError(f"channel-wise key meta must be [B, n_chunks, {rows}, {d}, 2], got {list(meta.shape)}")
        table = key_block_table(key_blocks, key_chunk, x.device)
        sub = math.gcd(16 if d >= 256 else 32, *(int(bk) for bk in key_blocks))  # divides every block
        _quantize_pack_channels_kernel[(n // key_chunk, b * h)](
            x, rot, codes, meta, table, wide_ptr, codes if channels is None else channels,
            h, start // key_chunk, start, start_ptr,
            *x.stride(), *rot.stride(), *codes.stride(), *meta.stride(),
            D=d, KEY_CHUNK=key_chunk, SUB=sub, ROTATE=rotation is not None, STORE_BF16=x.dtype == torch.bfloat16,
            META=_META_CODES[meta.dtype], UPCAST=upcast, DEVICE_START=device_start, X_RING=ring > 0, ring_size=max(ring, 1),
            WIDE=wide is not None, WIDE_CHANNELS=channels is not None,
            num_stages=1,  # no pipelined copies of the rotation
        )
        return
    groups = meta.shape[3]
    clip_index = min(int(clip_ratio * d + 1e-9), d)
    # rotated rows: 64 x 4 warps, one wgmma tile whose accumulator keeps each row within one warp (the clip search's
    # counts reduce without shared memory); 32 (16 at head_dim 256) otherwise, as registers allow
    block_t = 64 if rotation is not None and d <= 128 else 16 if d >= 256 else 32
    num_warps = 4
    if rotation is None and n < block_t:
        # a decode step's one token per head: a tile of one row in one warp (the passes of the clip search are
        # warp reductions then, no shared memory; 32 masked rows in 4 warps took 9 us per layer on the H200)
        block_t = triton.next_power_of_2(n)
        num_warps = 1 if block_t * d <= 2048 else 4
    # long prefills: several tiles per program (the rotation read once for all), while keeping >= ~4 programs per SM
    if tiles_per_program is None:
        tiles = max(1, min(QUANTIZE_LAUNCH["tiles_per_program"], triton.cdiv(n, block_t) * b * h // _MIN_PROGRAMS))
    else:  # as asked (benchmarks, tests)
        tiles = tiles_per_program
    grid = (triton.cdiv(n, block_t * tiles), b * h)
    _quantize_pack_kernel[grid](
        x, rot, codes, meta, wide_ptr,
        n, h, start, start_ptr,
        *x.stride(), *rot.stride(), *codes.stride(), *meta.stride(),
        clip_index,
        D=d, GROUPS=groups, BLOCK_T=block_t,
        ROTATE=rotation is not None, CLIP=clip_index < d, STORE_BF16=x.dtype == torch.bfloat16,
        META=_META_CODES[meta.dtype], UPCAST=upcast,
        # rows are 16-bit values (stored so, or rounded so after the rotation): 16-bit patterns for the clip search
        SORT_BITS=16 if rotation is not None or x.dtype in (torch.bfloat16, torch.float16) else 32,
        TILES=tiles, DEVICE_START=device_start, WIDE=wide is not None, num_warps=num_warps,
    )

