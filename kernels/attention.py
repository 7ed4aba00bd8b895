"""Split-K attention over OSCAR's segments, reading packed INT2 directly (Triton).

Stage 1 (`_segment_attention_kernel`), grid (batch·KV head, query-row tiles, splits): each program attends the query
rows of one KV head (its GQA group's query heads stacked, rows r = g·T + t) to one contiguous range of one segment —
the BF16 sink, a slice of the INT2 history, the BF16 recent window, or an extra BF16 segment (the current chunk of a
long prefill onto a filled cache) — with an online softmax, and writes its partial output and log-sum-exp.
Stage 2 (`_merge_kernel`) merges the splits by log-sum-exp (FlashInfer's merge_state), exactly.

The INT2 history is never dequantized into memory. A tile of BLOCK_N packed rows (`[BLOCK_N, d/4]` bytes) is
expanded in registers to `[BLOCK_N, d]` codes in *byte order* (column 4j + p holds plane p of byte j, i.e. head-dim
j + p·d/4), turned into bf16 by the exponent trick (0x4300 | c is the bf16 number 128 + c, no conversion
instruction), and multiplied by a query loaded in the same permuted column order — one `tl.dot` for keys, one for
values. With one (scale s, minimum m) per token (group = head_dim) the affine part is applied after the dots:
    q·k = s·(q·(128 + c)) + (m − 128·s)·Σq,      Σ_j p_j v_j = Σ_j w_j (1024 + c_j) − 1024·Σ_j w_j + Σ_j p_j m_j
with w_j = p_j s_j rounded to fp16 (values use fp16 codes 1024 + c for the finer weights), so the inner loop only
unpacks. Smaller groups (2 or 4 per row) dequantize in registers before the dot.

Masking: key positions are [sink | history | recent | extra] = [0, n_sink, n_sink+n_hist, ...]; query row r sits at
position q_start + (r mod T) and sees keys at positions <= its own (causal), where `key_mask[b, pos]` is True.
All 4-D tensors must have a unit last stride; the launcher passes the other three strides.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _dot(a, b, UPCAST: tl.constexpr):
    # The Triton interpreter (CPU tests) mishandles 16-bit dot operands: give it float32.
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    return tl.dot(a, b)


@triton.jit
def _byte_order_codes(packed, BLOCK_N: tl.constexpr, D: tl.constexpr):
    """`[BLOCK_N, D/4]` uint8 -> `[BLOCK_N, D]` int32 codes, columns in byte order (column 4j + p = plane p of byte j)."""
    shifts = tl.arange(0, 4) * 2
    codes = (packed[:, :, None].to(tl.int32) >> shifts[None, None, :]) & 3
    return tl.reshape(codes, (BLOCK_N, D))


@triton.jit
def _codes_plus_128_bf16(packed, BLOCK_N: tl.constexpr, D: tl.constexpr, UPCAST: tl.constexpr):
    """Codes as bf16 128 + c by the exponent trick (0x4300 | c), no conversion instruction."""
    codes = _byte_order_codes(packed, BLOCK_N, D)
    if UPCAST:  # the interpreter cannot bitcast into 16-bit floats
        out = (codes + 128).to(tl.float32).to(tl.bfloat16)
    else:
        out = (codes | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True)
    return out


@triton.jit
def _codes_plus_1024_fp16(packed, BLOCK_N: tl.constexpr, D: tl.constexpr, UPCAST: tl.constexpr):
    """Codes as fp16 1024 + c by the exponent trick (0x6400 | c)."""
    codes = _byte_order_codes(packed, BLOCK_N, D)
    if UPCAST:
        out = (codes + 1024).to(tl.float32).to(tl.float16)
    else:
        out = (codes | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)
    return out


@triton.jit
def _online_update(s, valid, m_i, l_i, acc, corr):
    s = tl.where(valid, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    return p, m_new, l_i, acc * alpha[:, None], corr * alpha


@triton.jit
def _visible(idx, hi, pos_offset, qpos, b, mask_ptr, smask_b, HAS_MASK: tl.constexpr):
    ok = idx < hi
    kpos = pos_offset + idx
    valid = ok[None, :] & (kpos[None, :] <= qpos[:, None])
    if HAS_MASK:
        km = tl.load(mask_ptr + b * smask_b + kpos, mask=ok, other=0)
        valid = valid & (km != 0)[None, :]
    return ok, valid


@triton.jit
def _bf16_range(
    q, qpos, m_i, l_i, acc, corr, k_ptr, v_ptr, s_b, s_h, s_t, b, h, lo, hi, pos_offset,
    mask_ptr, smask_b, scale, D: tl.constexpr, BLOCK_N: tl.constexpr, HAS_MASK: tl.constexpr, UPCAST: tl.constexpr,
):
    d = tl.arange(0, D)
    base = b * s_b + h * s_h
    for start in range(lo, hi, BLOCK_N):
        idx = start + tl.arange(0, BLOCK_N)
        ok, valid = _visible(idx, hi, pos_offset, qpos, b, mask_ptr, smask_b, HAS_MASK)
        offs = base + idx[:, None] * s_t + d[None, :]
        k = tl.load(k_ptr + offs, mask=ok[:, None], other=0.0)
        s = _dot(q, tl.trans(k), UPCAST) * scale
        p, m_i, l_i, acc, corr = _online_update(s, valid, m_i, l_i, acc, corr)
        v = tl.load(v_ptr + offs, mask=ok[:, None], other=0.0)
        acc += _dot(p.to(v.dtype), v, UPCAST)
    return m_i, l_i, acc, corr


@triton.jit
def _int2_range(
    q, qsum, qpos, m_i, l_i, acc, corr,
    ck_ptr, cv_ptr, sc_b, sc_h, sc_t, mk_ptr, mv_ptr, sm_b, sm_h, sm_t,
    b, h, lo, hi, pos_offset, mask_ptr, smask_b, scale,
    D: tl.constexpr, GROUPS: tl.constexpr, BLOCK_N: tl.constexpr, HAS_MASK: tl.constexpr, UPCAST: tl.constexpr,
    Q_FP16: tl.constexpr,
):
    QD: tl.constexpr = D // 4
    dq = tl.arange(0, QD)
    cbase = b * sc_b + h * sc_h
    mbase = b * sm_b + h * sm_h
    # group of each byte-order column 4j + p (head-dim j + p·D/4)
    col = tl.arange(0, D)
    group = ((col % 4) * QD + col // 4) // (D // GROUPS)
    for start in range(lo, hi, BLOCK_N):
        idx = start + tl.arange(0, BLOCK_N)
        ok, valid = _visible(idx, hi, pos_offset, qpos, b, mask_ptr, smask_b, HAS_MASK)
        coffs = cbase + idx[:, None] * sc_t + dq[None, :]
        # key codes in the query's dtype: bf16 128 + c, or fp16 1024 + c
        if Q_FP16:
            kc = _codes_plus_1024_fp16(tl.load(ck_ptr + coffs, mask=ok[:, None], other=0), BLOCK_N, D, UPCAST)
            KB: tl.constexpr = 1024.0
        else:
            kc = _codes_plus_128_bf16(tl.load(ck_ptr + coffs, mask=ok[:, None], other=0), BLOCK_N, D, UPCAST)
            KB: tl.constexpr = 128.0
        mrow = mbase + idx * sm_t
        if GROUPS == 1:
            ks = tl.load(mk_ptr + mrow, mask=ok, other=0.0).to(tl.float32)
            km = tl.load(mk_ptr + mrow + 1, mask=ok, other=0.0).to(tl.float32)
            s = (_dot(q, tl.trans(kc), UPCAST) * ks[None, :] + qsum[:, None] * (km - KB * ks)[None, :]) * scale
        else:
            ks = tl.load(mk_ptr + mrow[:, None] + group[None, :] * 2, mask=ok[:, None], other=0.0).to(tl.float32)
            km = tl.load(mk_ptr + mrow[:, None] + group[None, :] * 2 + 1, mask=ok[:, None], other=0.0).to(tl.float32)
            k = ((kc.to(tl.float32) - KB) * ks + km).to(q.dtype)
            s = _dot(q, tl.trans(k), UPCAST) * scale
        p, m_i, l_i, acc, corr = _online_update(s, valid, m_i, l_i, acc, corr)
        if GROUPS == 1:
            # fp16 weights (p·s <= 1): 8x finer than bf16; the 1024 offset cancels against the same rounded weights
            vc = _codes_plus_1024_fp16(tl.load(cv_ptr + coffs, mask=ok[:, None], other=0), BLOCK_N, D, UPCAST)
            vs = tl.load(mv_ptr + mrow, mask=ok, other=0.0).to(tl.float32)
            vm = tl.load(mv_ptr + mrow + 1, mask=ok, other=0.0).to(tl.float32)
            ps = (p * vs[None, :]).to(tl.float16)
            acc += _dot(ps, vc, UPCAST)
            corr += tl.sum(p * vm[None, :], axis=1) - 1024.0 * tl.sum(ps.to(tl.float32), axis=1)
        else:
            vc = _codes_plus_1024_fp16(tl.load(cv_ptr + coffs, mask=ok[:, None], other=0), BLOCK_N, D, UPCAST)
            vs = tl.load(mv_ptr + mrow[:, None] + group[None, :] * 2, mask=ok[:, None], other=0.0).to(tl.float32)
            vm = tl.load(mv_ptr + mrow[:, None] + group[None, :] * 2 + 1, mask=ok[:, None], other=0.0).to(tl.float32)
            v = ((vc.to(tl.float32) - 1024.0) * vs + vm).to(q.dtype)
            acc += _dot(p.to(q.dtype), v, UPCAST)
    return m_i, l_i, acc, corr


@triton.jit
def _segment_attention_kernel(
    q_ptr, sq_b, sq_h, sq_m,
    o_ptr, so_b, so_h, so_m, so_s,
    lse_ptr, sl_b, sl_h, sl_m,
    sink_k, sink_v, ss_b, ss_h, ss_t,
    codes_k, codes_v, sc_b, sc_h, sc_t,
    meta_k, meta_v, sm_b, sm_h, sm_t,
    rec_k, rec_v, sr_b, sr_h, sr_t,
    ext_k, ext_v, se_b, se_h, se_t,
    mask_ptr, smask_b,
    heads, M, T, q_start, n_sink, n_hist, n_recent, n_extra, hist_splits, hist_chunk, extra_chunk, scale,
    D: tl.constexpr, GROUPS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_MASK: tl.constexpr,
    UPCAST: tl.constexpr, Q_FP16: tl.constexpr,
):
    pid_bh = tl.program_id(0)
    pid_m = tl.program_id(1)
    split = tl.program_id(2)
    b = pid_bh // heads
    h = pid_bh % heads
    QD: tl.constexpr = D // 4
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    qpos = q_start + rows % T
    max_qpos = q_start + tl.max(tl.where(row_ok, rows % T, 0), axis=0)
    col = tl.arange(0, D)
    q_rows = q_ptr + b * sq_b + h * sq_h + rows[:, None] * sq_m
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, D), tl.float32)
    corr = tl.zeros((BLOCK_M,), tl.float32)
    recent_split = 1 + hist_splits
    # output columns: natural order, except the INT2 history which works in byte order
    out_col = col
    if split == 0:
        q = tl.load(q_rows + col[None, :], mask=row_ok[:, None], other=0.0)
        m_i, l_i, acc, corr = _bf16_range(
            q, qpos, m_i, l_i, acc, corr, sink_k, sink_v, ss_b, ss_h, ss_t, b, h, 0, tl.minimum(n_sink, max_qpos + 1), 0,
            mask_ptr, smask_b, scale, D, BLOCK_N, HAS_MASK, UPCAST)
    elif split < recent_split:
        perm = (col % 4) * QD + col // 4
        q = tl.load(q_rows + perm[None, :], mask=row_ok[:, None], other=0.0)
        qsum = tl.sum(q.to(tl.float32), axis=1)
        lo = (split - 1) * hist_chunk
        hi = tl.minimum(tl.minimum(lo + hist_chunk, n_hist), max_qpos + 1 - n_sink)
        m_i, l_i, acc, corr = _int2_range(
            q, qsum, qpos, m_i, l_i, acc, corr, codes_k, codes_v, sc_b, sc_h, sc_t, meta_k, meta_v, sm_b, sm_h, sm_t,
            b, h, lo, hi, n_sink, mask_ptr, smask_b, scale, D, GROUPS, BLOCK_N, HAS_MASK, UPCAST, Q_FP16)
        out_col = perm
    elif split == recent_split:
        q = tl.load(q_rows + col[None, :], mask=row_ok[:, None], other=0.0)
        offset = n_sink + n_hist
        m_i, l_i, acc, corr = _bf16_range(
            q, qpos, m_i, l_i, acc, corr, rec_k, rec_v, sr_b, sr_h, sr_t, b, h, 0,
            tl.minimum(n_recent, max_qpos + 1 - offset), offset, mask_ptr, smask_b, scale, D, BLOCK_N, HAS_MASK, UPCAST)
    else:
        q = tl.load(q_rows + col[None, :], mask=row_ok[:, None], other=0.0)
        offset = n_sink + n_hist + n_recent
        lo = (split - recent_split - 1) * extra_chunk
        hi = tl.minimum(tl.minimum(lo + extra_chunk, n_extra), max_qpos + 1 - offset)
        m_i, l_i, acc, corr = _bf16_range(
            q, qpos, m_i, l_i, acc, corr, ext_k, ext_v, se_b, se_h, se_t, b, h, lo, hi, offset,
            mask_ptr, smask_b, scale, D, BLOCK_N, HAS_MASK, UPCAST)

    inv_l = tl.where(l_i > 0.0, 1.0 / tl.maximum(l_i, 1e-30), 0.0)
    out = (acc + corr[:, None]) * inv_l[:, None]
    o_rows = o_ptr + b * so_b + h * so_h + rows[:, None] * so_m + split * so_s
    tl.store(o_rows + out_col[None, :], out, mask=row_ok[:, None])
    # log-sum-exp in natural-log units (the scores were scaled by log2(e) for exp2)
    lse = tl.where(l_i > 0.0, (m_i + tl.log2(tl.maximum(l_i, 1e-30))) / 1.4426950408889634, float("-inf"))
    tl.store(lse_ptr + b * sl_b + h * sl_h + rows * sl_m + split, lse, mask=row_ok)


@triton.jit
def _merge_kernel(o_ptr, lse_ptr, out_ptr, lse_out_ptr, n_splits, D: tl.constexpr, BLOCK_S: tl.constexpr):
    r = tl.program_id(0)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, D)
    lse = tl.load(lse_ptr + r * n_splits + s, mask=s < n_splits, other=float("-inf"))
    top = tl.max(lse, axis=0)
    top = tl.where(top == float("-inf"), 0.0, top)
    w = tl.exp(lse - top)
    total = tl.sum(w, axis=0)
    o = tl.load(o_ptr + (r * n_splits + s[:, None]) * D + d[None, :], mask=(s < n_splits)[:, None], other=0.0)
    out = tl.sum(o * w[:, None], axis=0) / tl.maximum(total, 1e-30)
    tl.store(out_ptr + r * D + d, out.to(out_ptr.dtype.element_ty))
    tl.store(lse_out_ptr + r, tl.where(total > 0.0, top + tl.log(tl.maximum(total, 1e-30)), float("-inf")))


# ------------------------------------------------------------------------------------------------- launcher
def plan_splits(batch_heads: int, m_tiles: int, n_hist: int, n_extra: int, block_n: int, target_programs: int):
    """History and extra-segment split sizes so that stage 1 has about `target_programs` programs."""
    want = max(1, math.ceil(target_programs / (batch_heads * m_tiles)))
    hist_splits = max(1, min(want, math.ceil(n_hist / block_n))) if n_hist > 0 else 1
    hist_chunk = max(block_n, math.ceil(math.ceil(n_hist / hist_splits) / block_n) * block_n)
    hist_splits = max(1, math.ceil(n_hist / hist_chunk)) if n_hist > 0 else 1
    extra_splits = max(1, min(want, math.ceil(n_extra / block_n))) if n_extra > 0 else 0
    extra_chunk = max(block_n, math.ceil(math.ceil(n_extra / max(extra_splits, 1)) / block_n) * block_n)
    extra_splits = math.ceil(n_extra / extra_chunk) if n_extra > 0 else 0
    return hist_splits, hist_chunk, extra_splits, extra_chunk


_SMS: dict = {}
# Launch parameters measured best on an H200 (eval/bench_gpu.py's tune section; eval/KERNEL_NOTES.md).
DEFAULT_LAUNCH = dict(block_n=64, num_warps=4, num_stages=2, programs_per_sm=4)


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    if device not in _SMS:
        _SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SMS[device]


def _strides3(t: torch.Tensor):
    if t.stride(-1) != 1:
        raise ValueError("segment_attention needs tensors with a unit stride in the last dimension")
    return t.stride(0), t.stride(1), t.stride(2)


def segment_attention_triton(
    q, sink_k, sink_v, hist_codes_k, hist_meta_k, hist_codes_v, hist_meta_v, recent_k, recent_v, extra_k, extra_v,
    key_mask, n_sink, n_hist, n_recent, n_extra, queries_per_group, query_start, scale,
    block_n: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
    target_programs: int | None = None,
):
    """See `oscar_hf.ops.segment_attention_reference` for the contract. Returns `(out [B, H, M, d] q.dtype, lse [B, H, M] f32)`."""
    b, h, m, d = q.shape
    block_n = block_n or DEFAULT_LAUNCH["block_n"]
    block_m = 16 if m <= 16 else 64
    m_tiles = triton.cdiv(m, block_m)
    target = target_programs or DEFAULT_LAUNCH["programs_per_sm"] * _sm_count(q.device)
    hist_splits, hist_chunk, extra_splits, extra_chunk = plan_splits(b * h, m_tiles, n_hist, n_extra, block_n, target)
    n_splits = 1 + hist_splits + 1 + extra_splits
    partial = torch.empty(b, h, m, n_splits, d, device=q.device, dtype=torch.float32)
    partial_lse = torch.empty(b, h, m, n_splits, device=q.device, dtype=torch.float32)
    has_mask = key_mask is not None
    mask = key_mask if has_mask else q.new_empty(1, 1, dtype=torch.bool)
    if mask.stride(-1) != 1:
        mask = mask.contiguous()
    mask = mask.view(torch.uint8)
    for a, b_ in ((sink_k, sink_v), (hist_codes_k, hist_codes_v), (hist_meta_k, hist_meta_v), (recent_k, recent_v),
                  (extra_k, extra_v)):
        if a.stride() != b_.stride():
            raise ValueError("keys and values of a segment must share their strides")
    meta_strides = hist_meta_k.stride()
    if meta_strides[-1] != 1 or meta_strides[-2] != 2:
        raise ValueError("history metadata must be [B, H, L, G, 2] with contiguous (scale, minimum) pairs")
    _segment_attention_kernel[(b * h, m_tiles, n_splits)](
        q, *_strides3(q),
        partial, partial.stride(0), partial.stride(1), partial.stride(2), partial.stride(3),
        partial_lse, partial_lse.stride(0), partial_lse.stride(1), partial_lse.stride(2),
        sink_k, sink_v, *_strides3(sink_k),
        hist_codes_k, hist_codes_v, *_strides3(hist_codes_k),
        hist_meta_k, hist_meta_v, *meta_strides[:3],
        recent_k, recent_v, *_strides3(recent_k),
        extra_k, extra_v, *_strides3(extra_k),
        mask, mask.stride(0),
        h, m, queries_per_group, query_start, n_sink, n_hist, n_recent, n_extra, hist_splits, hist_chunk, extra_chunk,
        scale * LOG2E,
        D=d, GROUPS=hist_meta_k.shape[3], BLOCK_M=block_m, BLOCK_N=block_n, HAS_MASK=has_mask, UPCAST=INTERPRET,
        Q_FP16=q.dtype == torch.float16,
        num_warps=num_warps or DEFAULT_LAUNCH["num_warps"], num_stages=num_stages or DEFAULT_LAUNCH["num_stages"],
    )
    out = torch.empty(b, h, m, d, device=q.device, dtype=q.dtype)
    lse = torch.empty(b, h, m, device=q.device, dtype=torch.float32)
    _merge_kernel[(b * h * m,)](partial, partial_lse, out, lse, n_splits, D=d, BLOCK_S=triton.next_power_of_2(n_splits))
    return out, lse
