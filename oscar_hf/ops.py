"""The hot operations of the cache, behind one signature each: the Triton kernel on CUDA (`oscar_hf.kernels`,
registered as torch custom ops `oscar::quantize_pack`, `oscar::quantize_pack_at`, `oscar::segment_attention`,
`oscar::decode_attention` and `oscar::rotate_store_token`), the pure-torch twin here everywhere else. `OSCAR_HF_KERNELS=0` forces the twins; `OSCAR_HF_KERNELS=1` forces the kernels (on the CPU that
needs `TRITON_INTERPRET=1`, which is how the CI tests them).
"""

from __future__ import annotations

import functools
import os
import warnings

import torch

from .quant import (KeyBlockLayout, QuantizedKeyChunks, QuantizedRows, clip_rows, dequantize_key_chunks, dequantize_rows,
                    quantize_key_chunks, quantize_rows)

KERNEL_DTYPES = (torch.bfloat16, torch.float16)


@functools.lru_cache(maxsize=1)
def _load_kernels():
    try:
        from . import kernels  # noqa: F401  (registers torch.ops.oscar.*)
    except Exception as e:  # triton missing or too old: fall back to the torch twins
        return e
    return None


def kernel_op(name: str):
    """The Triton kernel `name`: the custom op `torch.ops.oscar.<name>` while dynamo traces (it needs the op and its
    fake), the launcher itself otherwise (same signature, none of the dispatcher's per-call host work:
    `kernels.custom_ops.EAGER`). `OSCAR_HF_CUSTOM_OPS=1` takes the custom op always."""
    if torch.compiler.is_compiling() or os.environ.get("OSCAR_HF_CUSTOM_OPS") == "1":
        return getattr(torch.ops.oscar, name)
    from .kernels.custom_ops import EAGER

    return EAGER[name]


_WARNED: set[str] = set()


def warn_slow_path(reason: str) -> None:
    """One warning per reason when CUDA tensors take the torch twin: never slow without a word."""
    if reason not in _WARNED:
        _WARNED.add(reason)
        warnings.warn(f"oscar_hf: {reason}; using the slower torch path", RuntimeWarning, stacklevel=3)


def use_kernels(tensor: torch.Tensor, problem: str | None = None) -> bool:
    """Whether the Triton kernels run for `tensor` (CUDA, bf16/fp16, kernels importable, and no `problem` with the
    layout). `OSCAR_HF_KERNELS=1` turns every reason not to into an error; on CUDA each reason warns once."""
    mode = os.environ.get("OSCAR_HF_KERNELS", "auto")
    if mode == "0" or (mode != "1" and not tensor.is_cuda):
        return False
    error = _load_kernels()
    if error is not None:
        reason = f"Triton kernels unavailable ({error})"
    elif tensor.dtype not in KERNEL_DTYPES:
        reason = f"the kernels take bfloat16/float16 states, not {str(tensor.dtype).replace('torch.', '')}"
    else:
        reason = problem
    if reason is None:
        return True
    if mode == "1":
        raise RuntimeError(f"OSCAR_HF_KERNELS=1 but {reason}")
    if tensor.is_cuda:
        warn_slow_path(reason)
    return False


def attention_layout_problem(head_dim: int, value_groups: int, key_groups: int, key_blocks=(),
                             wide: bool = False) -> str | None:
    """Why the INT2 decode kernel cannot read this layout, or None. The kernel applies one scale per quarter plane of
    the packed bytes (1, 2 or 4 token-wise groups per row), tiles keys by 16..128 tokens (every channel-wise key block
    a multiple of the tile: powers of two >= 16 or multiples of 128) and needs head_dim >= 64; wide heads need
    channel-wise keys and one value group per row (the default layout)."""
    if wide and (not key_blocks or value_groups != 1):
        return "the INT2 decode kernel reads wide heads with channel-wise keys and one value group per row only"
    if head_dim < 64 or head_dim & (head_dim - 1):
        return f"the INT2 decode kernel needs a power-of-two head_dim >= 64, got {head_dim}"
    for name, groups in (("value", value_groups), ("key", key_groups)):
        if groups not in (1, 2, 4) and not (name == "key" and key_blocks):
            return (f"the INT2 decode kernel reads 1, 2 or 4 quantization groups per {name} row, not {groups} "
                    f"(group_size {head_dim // max(groups, 1)} at head_dim {head_dim})")
    for block in key_blocks:
        if block % 16 or (block & (block - 1) and block % 128):
            return (f"the INT2 decode kernel needs channel-wise key blocks that are powers of two >= 16 or multiples "
                    f"of 128, got {block}")
    return None


# ------------------------------------------------------------------------------------------ quantize_pack
def quantize_pack_reference(
    x: torch.Tensor, rotation: torch.Tensor | None, clip_ratio: float, codes: torch.Tensor, meta: torch.Tensor, start: int,
    key_blocks: list[int] = (), key_chunk: int = 0, wide_rows: list[int] = (), wide_channels: list[int] = (),
) -> None:
    """Rotates (if `rotation` `[H, d, d]` is given), clips, quantizes to 2 bits and packs rows `x` `[B, H, n, d]` into
    `codes[:, :, start:start+n]` (`[B, H, L, d/4]` uint8) and the matching `meta` rows: token-wise (`key_chunk == 0`,
    meta `[B, H, L, G, 2]`) or channel-wise with KV head h over blocks of `key_blocks[h]` tokens in chunks of
    `key_chunk` (meta `[B, L/key_chunk, R, d, 2]`, `quant.KeyBlockLayout`; `start` and n multiples of the chunk, no
    clip). `wide_rows` (`quant.wide_rows`): wide heads at 4 bits, their low planes in the codes' rows after the H heads
    (codes `[B, H + U, L, d/4]`). `wide_channels` (channel-wise keys): each KV head's wide key channels
    (`quant.quantize_wide_channels`; empty: none)."""
    n, d = x.shape[2], x.shape[3]
    if n == 0:
        return
    if rotation is not None:
        x = torch.matmul(x, rotation)
    wide = tuple(wide_rows)
    if key_chunk:
        q = quantize_key_chunks(x, 2, KeyBlockLayout(tuple(key_blocks), key_chunk), meta.dtype, wide, tuple(wide_channels))
        codes[:, :, start : start + n] = q.codes
        meta[:, start // key_chunk : (start + n) // key_chunk] = q.meta
        return
    group = d // meta.shape[3]
    q = quantize_rows(clip_rows(x.float(), clip_ratio), 2, group, meta.dtype, wide)
    codes[:, :, start : start + n] = q.codes
    meta[:, :, start : start + n] = q.meta


def quantize_pack(x, rotation, clip_ratio, codes, meta, start, key_blocks=(), key_chunk=0, wide_rows=(),
                  wide_channels=(), kernel: bool | None = None) -> None:
    """`quantize_pack_reference`'s contract, on the Triton kernel where it applies (`kernel`: decided by the caller,
    e.g. once outside a compiled region; None: decide here)."""
    if use_kernels(x) if kernel is None else kernel:
        kernel_op("quantize_pack")(x, rotation, float(clip_ratio), codes, meta, int(start),
                                      [int(b) for b in key_blocks], int(key_chunk), [int(r) for r in wide_rows],
                                      [int(n) for n in wide_channels])
    else:
        quantize_pack_reference(x, rotation, clip_ratio, codes, meta, start, key_blocks, key_chunk, wide_rows,
                                wide_channels)


def quantize_pack_at_reference(
    x: torch.Tensor, clip_ratio: float, codes: torch.Tensor, meta: torch.Tensor, start: torch.Tensor,
    key_blocks: list[int] = (), key_chunk: int = 0, ring: int = 0, wide_rows: list[int] = (),
    wide_channels: list[int] = (),
) -> None:
    """`quantize_pack_reference` (rows already rotated) with the first row `start` an int64 tensor of one element on
    x's device, so that a captured decode step can write where the token count says without a host synchronisation;
    a negative `start` writes nothing. Channel-wise: `start` and n multiples of `key_chunk` (the caller's contract:
    a device value cannot be checked without a synchronisation); `ring` > 0: x `[B, H, >= ring, d]` is a ring whose
    slot j mod ring holds history row j, and one chunk, rows [start, start + key_chunk), is read from it.
    Branch-free: the target rows are rewritten with their old contents where nothing is due."""
    start = start.reshape(())
    due = start >= 0
    first = start.clamp(min=0)
    if ring:
        if not key_chunk:
            raise ValueError("a ring source is for channel-wise key chunks")
        x = x.index_select(2, (first + torch.arange(key_chunk, device=x.device)) % ring)
    n, d = x.shape[2], x.shape[3]
    if n == 0:
        return
    rows = first + torch.arange(n, device=x.device)
    wide = tuple(wide_rows)
    if key_chunk:
        q = quantize_key_chunks(x, 2, KeyBlockLayout(tuple(key_blocks), key_chunk), meta.dtype, wide, tuple(wide_channels))
        meta_index, meta_dim = torch.div(first, key_chunk, rounding_mode="floor") + torch.arange(n // key_chunk, device=x.device), 1
    else:
        q = quantize_rows(clip_rows(x.float(), clip_ratio), 2, d // meta.shape[3], meta.dtype, wide)
        meta_index, meta_dim = rows, 2
    codes.index_copy_(2, rows, torch.where(due, q.codes, codes.index_select(2, rows)))
    meta.index_copy_(meta_dim, meta_index, torch.where(due, q.meta, meta.index_select(meta_dim, meta_index)))


def quantize_pack_at(x, clip_ratio, codes, meta, start, key_blocks=(), key_chunk=0, ring: int = 0, wide_rows=(),
                     wide_channels=(), kernel: bool | None = None) -> None:
    """`quantize_pack_at_reference`'s contract, on the Triton kernel `oscar::quantize_pack_at` where it applies."""
    if use_kernels(x) if kernel is None else kernel:
        kernel_op("quantize_pack_at")(x, float(clip_ratio), codes, meta, start, [int(b) for b in key_blocks],
                                         int(key_chunk), int(ring), [int(r) for r in wide_rows],
                                         [int(n) for n in wide_channels])
    else:
        quantize_pack_at_reference(x, clip_ratio, codes, meta, start, key_blocks, key_chunk, ring, wide_rows,
                                   wide_channels)


# ------------------------------------------------------------------------------------------ segment_attention
def segment_attention_reference(
    q: torch.Tensor,
    sink_k: torch.Tensor, sink_v: torch.Tensor,
    hist_codes_k: torch.Tensor, hist_meta_k: torch.Tensor, hist_codes_v: torch.Tensor, hist_meta_v: torch.Tensor,
    recent_k: torch.Tensor, recent_v: torch.Tensor,
    extra_k: torch.Tensor, extra_v: torch.Tensor,
    key_mask: torch.Tensor | None,
    n_sink: int, n_hist: int, n_recent: int, n_extra: int,
    queries_per_group: int, query_start: int, scale: float, key_blocks: list[int] = (), key_chunk: int = 0,
    wide_rows: list[int] = (), wide_channels: list[int] = (), row_block: int = 1024, emulate_bf16: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of grouped query rows over [sink | INT2 history | recent | extra] (all rotated).

    Args:
        q: `[B, H, M, d]`, row r = g·T + t of KV head h is query head h·G + g at position `query_start + t`
            (T = `queries_per_group`).
        sink_k/v, recent_k/v, extra_k/v: `[B, H, ≥n, d]`, the first n_sink / n_recent / n_extra rows valid.
        hist_codes_k/v: `[B, H, ≥n_hist, d/4]` uint8 (2-bit planar), hist_meta_v: `[B, H, ≥n_hist, G, 2]` (token-wise);
            hist_meta_k the same, or, when `key_chunk` > 0, channel-wise keys `[B, ≥n_hist/key_chunk, R, d, 2]`: KV
            head h over blocks of `key_blocks[h]` tokens in chunks of `key_chunk` (`quant.KeyBlockLayout`; n_hist a
            multiple of the chunk). `wide_rows` (`quant.wide_rows`): wide heads' low planes in both codes tensors
            (`[B, H + U, ...]`). `wide_channels` (channel-wise keys): each KV head's wide key channels
            (`quant.quantize_wide_channels`; empty: none).
        key_mask: `[B, n_sink + n_hist + n_recent + n_extra]` bool (True = attend) or None. Causality comes from
            positions: sink at 0, history after it, then recent, then extra.
        emulate_bf16: round the probabilities to bfloat16 before they weigh the values, as the kernel's tensor-core
            dots do; tests use it to scale their tolerance by the error of a reference at the kernel's precision.
    Returns:
        `(out [B, H, M, d] in q.dtype, lse [B, H, M] float32)`; rows with no visible key give 0 and -inf.
    """
    d, wide = q.shape[-1], tuple(wide_rows)
    if key_chunk:
        hist_k = dequantize_key_chunks(QuantizedKeyChunks(hist_codes_k[:, :, :n_hist], hist_meta_k[:, : -(-n_hist // key_chunk)],
                                                          2, KeyBlockLayout(tuple(key_blocks), key_chunk), wide,
                                                          tuple(wide_channels)))
    else:
        hist_k = dequantize_rows(QuantizedRows(hist_codes_k[:, :, :n_hist], hist_meta_k[:, :, :n_hist], 2,
                                               d // hist_meta_k.shape[3], wide))
    hist_v = dequantize_rows(QuantizedRows(hist_codes_v[:, :, :n_hist], hist_meta_v[:, :, :n_hist], 2,
                                           d // hist_meta_v.shape[3], wide))
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
    key_mask, n_sink, n_hist, n_recent, n_extra, queries_per_group, query_start, scale, key_blocks=(), key_chunk=0,
    wide_rows=(), wide_channels=(),
):
    """`segment_attention_reference`'s contract, on the Triton kernel where it applies."""
    key_blocks = [int(b) for b in key_blocks] if key_chunk else []
    args = (q, sink_k, sink_v, hist_codes_k, hist_meta_k, hist_codes_v, hist_meta_v, recent_k, recent_v, extra_k, extra_v,
            key_mask, int(n_sink), int(n_hist), int(n_recent), int(n_extra), int(queries_per_group), int(query_start),
            float(scale), key_blocks, int(key_chunk), [int(r) for r in wide_rows],
            [int(n) for n in wide_channels] if key_chunk else [])
    problem = attention_layout_problem(q.shape[-1], hist_meta_v.shape[3], 0 if key_chunk else hist_meta_k.shape[3],
                                       key_blocks, bool(wide_rows))
    if use_kernels(q, problem):
        return kernel_op("segment_attention")(*args)
    return segment_attention_reference(*args)


# ------------------------------------------------------------------------------------------ decode_attention
def decode_attention_reference(
    q: torch.Tensor,
    sink_k: torch.Tensor, sink_v: torch.Tensor,
    hist_codes_k: torch.Tensor, hist_meta_k: torch.Tensor, hist_codes_v: torch.Tensor, hist_meta_v: torch.Tensor,
    ring_k: torch.Tensor, ring_v: torch.Tensor,
    key_mask: torch.Tensor | None, lengths: torch.Tensor,
    queries_per_group: int, scale: float, key_blocks: list[int] = (), key_chunk: int = 0, wide_rows: list[int] = (),
    wide_channels: list[int] = (), value_rotation: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of grouped query rows over a static cache's fixed buffers, with the lengths on the device (no host
    synchronisation, fixed shapes: what a CUDA graph can replay).

    Args:
        q: `[B, H, M, d]` rotated queries, row r = g·T + t (as in `segment_attention_reference`).
        sink_k/v: `[B, H, S, d]`: positions [0, n_sink).
        hist_codes_k/v, hist_meta_k/v: the whole history buffers (capacity C rows, a whole number of chunks for
            channel-wise keys, laid out as in `segment_attention_reference`): rows [0, n_hist) hold positions S + j.
        ring_k/v: `[B, H, R, d]`: the recent positions [S + n_hist, S + n_hist + n_recent), position S + n_hist + i at
            slot (ring_lo + i) mod R.
        key_mask: `[B, N]` bool over positions, or None.
        lengths: int32 `[5]` on q's device: (n_sink, n_hist, n_recent, ring_lo, q_start); query row r is at position
            q_start + (r mod T) and sees positions <= its own.
        value_rotation: `[H, d, d]` R_V, or None: the output is un-rotated (·R_Vᵀ, in float32) before its rounding to
            q.dtype.
        wide_rows: wide heads' low planes in both codes tensors (`quant.wide_rows`).
        wide_channels: each KV head's wide key channels (channel-wise keys; `quant.quantize_wide_channels`).
    Returns:
        `out [B, H, M, d]` in q.dtype (rows with no visible key: 0).
    """
    n_sink, n_hist, n_recent, ring_lo, q_start = lengths.long().unbind()
    s, r, d = sink_k.shape[2], ring_k.shape[2], q.shape[-1]
    device, wide = q.device, tuple(wide_rows)
    if key_chunk:
        hist_k = dequantize_key_chunks(QuantizedKeyChunks(hist_codes_k, hist_meta_k, 2, KeyBlockLayout(tuple(key_blocks), key_chunk),
                                                          wide, tuple(wide_channels)))
    else:
        hist_k = dequantize_rows(QuantizedRows(hist_codes_k, hist_meta_k, 2, d // hist_meta_k.shape[3], wide))
    hist_v = dequantize_rows(QuantizedRows(hist_codes_v, hist_meta_v, 2, d // hist_meta_v.shape[3], wide))
    slot = torch.arange(r, device=device)
    ring_offset = (slot - ring_lo) % r  # recent token index held by each ring slot
    sink_pos = torch.arange(s, device=device)
    hist_pos = s + torch.arange(hist_k.shape[2], device=device)
    positions = torch.cat([sink_pos, hist_pos, s + n_hist + ring_offset])
    stored = torch.cat([sink_pos < n_sink, hist_pos - s < n_hist, ring_offset < n_recent])
    keys = torch.cat([sink_k.float(), hist_k, ring_k.float()], 2)
    values = torch.cat([sink_v.float(), hist_v, ring_v.float()], 2)
    values = torch.where(stored[None, None, :, None], values, 0.0)  # unwritten slots may hold anything
    m = q.shape[2]
    qpos = q_start + torch.arange(m, device=device) % queries_per_group
    visible = (stored[None, :] & (positions[None, :] <= qpos[:, None]))[None, None]  # [1, 1, M, N]
    if key_mask is not None:
        mask = key_mask.bool().gather(1, positions.clamp(max=key_mask.shape[1] - 1)[None].expand(key_mask.shape[0], -1))
        visible = visible & mask[:, None, None, :]
    scores = torch.matmul(q.float(), keys.transpose(-1, -2)) * scale
    scores = torch.where(visible, scores, float("-inf"))
    top = scores.amax(-1, keepdim=True)
    probs = torch.exp(scores - torch.where(torch.isfinite(top), top, 0.0))
    total = probs.sum(-1, keepdim=True)
    out = torch.matmul(probs, values) / torch.where(total > 0, total, 1.0)
    if value_rotation is not None:
        out = torch.einsum("bhmd,hed->bhme", out, value_rotation.float())
    return out.to(q.dtype)


def decode_attention(q, sink_k, sink_v, hist_codes_k, hist_meta_k, hist_codes_v, hist_meta_v, ring_k, ring_v, key_mask,
                     lengths, queries_per_group, scale, key_blocks=(), key_chunk=0, wide_rows=(), wide_channels=(),
                     value_rotation=None, kernel: bool = False):
    """`decode_attention_reference`'s contract; `kernel` (decided once by the caller, outside any compiled region)
    selects the Triton kernel `oscar::decode_attention`."""
    args = (q, sink_k, sink_v, hist_codes_k, hist_meta_k, hist_codes_v, hist_meta_v, ring_k, ring_v, key_mask, lengths,
            int(queries_per_group), float(scale), [int(b) for b in key_blocks] if key_chunk else [], int(key_chunk),
            [int(r) for r in wide_rows], [int(n) for n in wide_channels] if key_chunk else [], value_rotation)
    if kernel:
        return kernel_op("decode_attention")(*args)
    return decode_attention_reference(*args)


# ------------------------------------------------------------------------------------------ rotate_store_token
def rotate_store_token_reference(
    keys: torch.Tensor, values: torch.Tensor, key_rotation: torch.Tensor, value_rotation: torch.Tensor,
    sink_k: torch.Tensor, sink_v: torch.Tensor, ring_k: torch.Tensor, ring_v: torch.Tensor, position: torch.Tensor,
    sink_tokens: int, ring: int,
) -> torch.Tensor:
    """A static cache's decode-step store: one token's key and value rotated and written to its slot, branch-free.

    Args:
        keys, values: `[B, H, 1, d]` (keys already centered, if the cache centers them).
        key_rotation, value_rotation: `[H, d, d]`.
        sink_k/v: `[B, H, S + 1, d]`, S = sink_tokens; ring_k/v: `[B, H, R + 1, d]`, R = ring.
        position: int64 scalar on the device, the token's position p: sink slot p when p < S, else ring slot
            (p − S) mod R. This twin also writes the slot it does not use at the scratch slot (S, or R); the kernel
            writes only the real slot. Nothing reads a scratch slot.
    Returns:
        `[2, B, H, 1, d]`: the rotated key and value (for the history's quantizer).
    """
    from .rotation import rotate

    rk, rv = rotate(keys, key_rotation), rotate(values, value_rotation)
    in_sink = position < sink_tokens
    sink_slot = torch.where(in_sink, position, sink_tokens).reshape(1)
    ring_slot = torch.where(in_sink, ring, (position - sink_tokens) % ring).reshape(1)
    sink_k.index_copy_(2, sink_slot, rk)
    sink_v.index_copy_(2, sink_slot, rv)
    ring_k.index_copy_(2, ring_slot, rk)
    ring_v.index_copy_(2, ring_slot, rv)
    return torch.stack([rk, rv])


def rotate_store_token(keys, values, key_rotation, value_rotation, sink_k, sink_v, ring_k, ring_v, position,
                       sink_tokens, ring, kernel: bool = False) -> torch.Tensor:
    """`rotate_store_token_reference`'s contract; `kernel` selects the Triton kernel `oscar::rotate_store_token`."""
    args = (keys, values, key_rotation, value_rotation, sink_k, sink_v, ring_k, ring_v, position, int(sink_tokens),
            int(ring))
    if kernel:
        return kernel_op("rotate_store_token")(*args)
    return rotate_store_token_reference(*args)
