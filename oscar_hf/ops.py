"""The two hot operations of the cache, behind one signature each: the Triton kernel on CUDA (`oscar_hf.kernels`,
registered as torch custom ops `oscar::quantize_pack` and `oscar::segment_attention`), the pure-torch twin here
everywhere else. `OSCAR_HF_KERNELS=0` forces the twins; `OSCAR_HF_KERNELS=1` forces the kernels (on the CPU that
needs `TRITON_INTERPRET=1`, which is how the CI tests them).
"""

from __future__ import annotations

import functools
import os
import warnings

import torch

from .quant import clip_rows, dequantize_rows, quantize_rows, QuantizedRows

KERNEL_DTYPES = (torch.bfloat16, torch.float16)


@functools.lru_cache(maxsize=1)
def _load_kernels():
    try:
        from . import kernels  # noqa: F401  (registers torch.ops.oscar.*)
    except Exception as e:  # triton missing or too old: fall back to the torch twins
        return e
    return None


def kernels_enabled(tensor: torch.Tensor) -> bool:
    """Whether the Triton kernels run for `tensor` (CUDA, bf16/fp16, kernels importable)."""
    mode = os.environ.get("OSCAR_HF_KERNELS", "auto")
    if mode == "0" or tensor.dtype not in KERNEL_DTYPES:
        return False
    if mode != "1" and not tensor.is_cuda:
        return False
    error = _load_kernels()
    if error is not None:
        if tensor.is_cuda:
            warnings.warn(f"oscar_hf: Triton kernels unavailable ({error}); using the slower torch path", stacklevel=3)
        return False
    return True


# ------------------------------------------------------------------------------------------ quantize_pack
def quantize_pack_reference(
    x: torch.Tensor, rotation: torch.Tensor | None, clip_ratio: float, codes: torch.Tensor, meta: torch.Tensor, start: int
) -> None:
    """Rotates (if `rotation` `[H, d, d]` is given), clips, quantizes to 2 bits and packs rows `x` `[B, H, n, d]` into
    `codes[:, :, start:start+n]` (`[B, H, L, d/4]` uint8) and `meta[:, :, start:start+n]` (`[B, H, L, G, 2]`)."""
    n, d = x.shape[2], x.shape[3]
    if n == 0:
        return
    if rotation is not None:
        x = torch.matmul(x, rotation)
    group = d // meta.shape[3]
    q = quantize_rows(clip_rows(x.float(), clip_ratio), 2, group, meta.dtype)
    codes[:, :, start : start + n] = q.codes
    meta[:, :, start : start + n] = q.meta


def quantize_pack(x, rotation, clip_ratio, codes, meta, start) -> None:
    if kernels_enabled(x):
        torch.ops.oscar.quantize_pack(x, rotation, float(clip_ratio), codes, meta, int(start))
    else:
        quantize_pack_reference(x, rotation, clip_ratio, codes, meta, start)


# ------------------------------------------------------------------------------------------ segment_attention
def segment_attention_reference(
    q: torch.Tensor,
    sink_k: torch.Tensor, sink_v: torch.Tensor,
    hist_codes_k: torch.Tensor, hist_meta_k: torch.Tensor, hist_codes_v: torch.Tensor, hist_meta_v: torch.Tensor,
    recent_k: torch.Tensor, recent_v: torch.Tensor,
    extra_k: torch.Tensor, extra_v: torch.Tensor,
    key_mask: torch.Tensor | None,
    n_sink: int, n_hist: int, n_recent: int, n_extra: int,
    queries_per_group: int, query_start: int, scale: float,
    row_block: int = 1024, emulate_bf16: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of grouped query rows over [sink | INT2 history | recent | extra] (all rotated).

    Args:
        q: `[B, H, M, d]`, row r = g·T + t of KV head h is query head h·G + g at position `query_start + t`
            (T = `queries_per_group`).
        sink_k/v, recent_k/v, extra_k/v: `[B, H, ≥n, d]`, the first n_sink / n_recent / n_extra rows valid.
        hist_codes_k/v: `[B, H, ≥n_hist, d/4]` uint8 (2-bit planar), hist_meta_k/v: `[B, H, ≥n_hist, G, 2]`.
        key_mask: `[B, n_sink + n_hist + n_recent + n_extra]` bool (True = attend) or None. Causality comes from
            positions: sink at 0, history after it, then recent, then extra.
        emulate_bf16: round the probabilities to bfloat16 before they weigh the values, as the kernel's tensor-core
            dots do; tests use it to scale their tolerance by the error of a reference at the kernel's precision.
    Returns:
        `(out [B, H, M, d] in q.dtype, lse [B, H, M] float32)`; rows with no visible key give 0 and -inf.
    """
    d = q.shape[-1]
    hist_k = dequantize_rows(QuantizedRows(hist_codes_k[:, :, :n_hist], hist_meta_k[:, :, :n_hist], 2, d // hist_meta_k.shape[3]))
    hist_v = dequantize_rows(QuantizedRows(hist_codes_v[:, :, :n_hist], hist_meta_v[:, :, :n_hist], 2, d // hist_meta_v.shape[3]))
    keys = torch.cat([sink_k[:, :, :n_sink].float(), hist_k, recent_k[:, :, :n_recent].float(), extra_k[:, :, :n_extra].float()], 2)
    values = torch.cat([sink_v[:, :, :n_sink].float(), hist_v, recent_v[:, :, :n_recent].float(), extra_v[:, :, :n_extra].float()], 2)
    n = keys.shape[2]
    m = q.shape[2]
    kpos = torch.arange(n, device=q.device)
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    for r0 in range(0, m, row_block):
        r1 = min(r0 + row_block, m)
        qpos = query_start + torch.arange(r0, r1, device=q.device) % queries_per_group
        visible = (kpos[None, :] <= qpos[:, None])[None, None]  # [1, 1, rows, n]
        if key_mask is not None:
            visible = visible & key_mask[:, None, None, :n].bool()
        scores = torch.matmul(q[:, :, r0:r1].float(), keys.transpose(-1, -2)) * scale
        scores = scores.masked_fill(~visible, float("-inf"))
        block_lse = torch.logsumexp(scores, dim=-1)
        safe = torch.where(torch.isfinite(block_lse), block_lse, torch.zeros_like(block_lse))
        probs = torch.exp(scores - safe.unsqueeze(-1))
        if emulate_bf16:
            probs = probs.to(torch.bfloat16).float()
        out[:, :, r0:r1] = torch.matmul(probs, values)
        lse[:, :, r0:r1] = block_lse
    return out.to(q.dtype), lse


def segment_attention(
    q, sink_k, sink_v, hist_codes_k, hist_meta_k, hist_codes_v, hist_meta_v, recent_k, recent_v, extra_k, extra_v,
    key_mask, n_sink, n_hist, n_recent, n_extra, queries_per_group, query_start, scale,
):
    """`segment_attention_reference`'s contract, on the Triton kernel where it applies."""
    args = (q, sink_k, sink_v, hist_codes_k, hist_meta_k, hist_codes_v, hist_meta_v, recent_k, recent_v, extra_k, extra_v,
            key_mask, int(n_sink), int(n_hist), int(n_recent), int(n_extra), int(queries_per_group), int(query_start),
            float(scale))
    if kernels_enabled(q) and q.shape[-1] >= 64:
        return torch.ops.oscar.segment_attention(*args)
    return segment_attention_reference(*args)
