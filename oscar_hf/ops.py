"""The hot operations of the cache, one signature each over a `format.LayerFormat` (or one stream's `StreamFormat`):
the Triton kernel on CUDA (`oscar_hf.kernels`, registered as torch custom ops `oscar::quantize_pack`,
`oscar::quantize_pack_at`, `oscar::segment_attention`, `oscar::decode_attention` and `oscar::rotate_store_token`), the
pure-torch twin here everywhere else. The custom ops take flat arguments; `_kernel_layout` flattens a format into
them, in one place. `OSCAR_HF_KERNELS=0` forces the twins; `OSCAR_HF_KERNELS=1` forces the kernels (on the CPU that
needs `TRITON_INTERPRET=1`, which is how the CI tests them).
"""

from __future__ import annotations

import functools
import itertools
import math
import os
import warnings
from dataclasses import dataclass

import torch

from .format import LayerFormat, StreamFormat
from .quant import Packed, dequantize, quantize
from .rotation import rotate

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


def use_kernels(tensor: torch.Tensor, fmt: LayerFormat | StreamFormat | None = None) -> bool:
    """Whether the Triton kernels run for `tensor` and a layer or stream of format `fmt` (CUDA, bf16/fp16, kernels
    importable, a 2-bit layout they read). `OSCAR_HF_KERNELS=1` turns every reason not to into an error; on CUDA each
    reason warns once."""
    mode = os.environ.get("OSCAR_HF_KERNELS", "auto")
    if mode == "0" or (mode != "1" and not tensor.is_cuda):
        return False
    error = _load_kernels()
    if error is not None:
        reason = f"Triton kernels unavailable ({error})"
    elif tensor.dtype not in KERNEL_DTYPES:
        reason = f"the kernels take bfloat16/float16 states, not {str(tensor.dtype).replace('torch.', '')}"
    elif isinstance(fmt, LayerFormat):
        reason = fmt.kernel_problem()
    elif isinstance(fmt, StreamFormat) and fmt.bits != 2:
        reason = f"the quantize kernels write 2-bit histories, not {fmt.bits}-bit ones"
    else:
        reason = None
    if reason is None:
        return True
    if mode == "1":
        raise RuntimeError(f"OSCAR_HF_KERNELS=1 but {reason}")
    if tensor.is_cuda:
        warn_slow_path(reason)
    return False


def _kernel_layout(fmt: StreamFormat) -> tuple[list[int], int, list[int], list[int]]:
    """A stream's format as the custom ops take it: (key_blocks, key_chunk, wide_rows, wide_channels), `key_chunk`
    0 for token-wise streams."""
    if fmt.channelwise:
        return list(fmt.blocks), fmt.chunk, list(fmt.wide_rows), list(fmt.wide_channels)
    return [], 0, list(fmt.wide_rows), []


def make_kernel_tables(fmt: LayerFormat, device: torch.device) -> None:
    """Makes the kernels' small per-layout device tables (cached in `kernels.quantize`) for both streams of `fmt`,
    now: a layer calls this when it allocates its buffers, so that the first launch is never the one that makes them.
    Inside a compiled forward's CUDA graphs that first launch would put them in the graphs' memory pool, which
    cudagraph trees refuse ('tensor(s) in the cudagraph pool not tracked as outputs') and a later replay reuses.
    Unless `OSCAR_HF_DECODE_KERNEL=triton` rules it out, the CUDA history kernel's module is loaded now too, for the
    same reason."""
    from .kernels import cuda_history
    from .kernels.quantize import key_block_table, wide_channel_table, wide_row_table

    if device.type == "cuda" and cuda_history.requested():
        cuda_history.available(device, wide=bool(_kernel_layout(fmt.keys)[2]))
    for stream in (fmt.keys, fmt.values):
        blocks, chunk, wide_rows, wide_channels = _kernel_layout(stream)
        wide_row_table(wide_rows, stream.heads, device)
        wide_channel_table(wide_channels, stream.heads, stream.head_dim, wide_rows, device)
        if chunk:
            key_block_table(blocks, chunk, device)


# ------------------------------------------------------------------------------------------ quantize_pack
def _write_rows(packed: Packed, codes: torch.Tensor, meta: torch.Tensor | None, rows: torch.Tensor,
                due: torch.Tensor | None = None) -> None:
    """Writes `packed` (n rows) into history rows `rows` (int64 `[n]`), branch-free where `due` (a bool scalar) says
    whether to write: the rows are rewritten with their old contents where nothing is due."""
    fmt = packed.fmt
    targets = [(codes, packed.codes, 2, rows)]
    if meta is not None:
        if fmt.channelwise:
            first = torch.div(rows[:1], fmt.chunk, rounding_mode="floor")
            targets.append((meta, packed.meta, 1, first + torch.arange(packed.meta.shape[1], device=rows.device)))
        else:
            targets.append((meta, packed.meta, 2, rows))
    for buf, new, dim, index in targets:
        if due is not None:
            new = torch.where(due, new, buf.index_select(dim, index))
        buf.index_copy_(dim, index, new.to(buf.dtype))


def quantize_pack_reference(x: torch.Tensor, rotation: torch.Tensor | None, codes: torch.Tensor,
                            meta: torch.Tensor | None, start: int, fmt: StreamFormat) -> None:
    """Rotates (if `rotation` `[H, d, d]` is given), clips (token-wise), quantizes and packs rows `x` `[B, H, n, d]`
    into history rows [start, start + n) of `codes` / `meta` (`fmt`'s buffers; channel-wise: `start` and n whole
    chunks)."""
    n = x.shape[2]
    if n == 0:
        return
    if rotation is not None:
        x = torch.matmul(x, rotation)
    _write_rows(quantize(x, fmt), codes, meta, torch.arange(start, start + n, device=x.device))


def quantize_pack(x, rotation, codes, meta, start: int, fmt: StreamFormat, kernel: bool | None = None) -> None:
    """`quantize_pack_reference`'s contract, on the Triton kernel where it applies (`kernel`: decided by the caller,
    e.g. once outside a compiled region; None: decide here)."""
    if use_kernels(x, fmt) if kernel is None else kernel:
        blocks, chunk, wide_rows, wide_channels = _kernel_layout(fmt)
        kernel_op("quantize_pack")(x, rotation, float(fmt.clip), codes, meta, int(start), blocks, chunk, wide_rows,
                                   wide_channels)
    else:
        quantize_pack_reference(x, rotation, codes, meta, start, fmt)


def quantize_pack_at_reference(x: torch.Tensor, codes: torch.Tensor, meta: torch.Tensor | None, start: torch.Tensor,
                               fmt: StreamFormat, ring: int = 0) -> None:
    """`quantize_pack_reference` (rows already rotated) with the first row `start` an int64 tensor of one element on
    x's device, so that a captured decode step can write where the token count says without a host synchronisation;
    a negative `start` writes nothing. Channel-wise: `start` and n multiples of the chunk (the caller's contract: a
    device value cannot be checked without a synchronisation); `ring` > 0: x `[B, H, >= ring, d]` is a ring whose
    slot j mod ring holds history row j, and one chunk, rows [start, start + chunk), is read from it."""
    start = start.reshape(())
    first = start.clamp(min=0)
    if ring:
        if not fmt.channelwise:
            raise ValueError("a ring source is for channel-wise key chunks")
        x = x.index_select(2, (first + torch.arange(fmt.chunk, device=x.device)) % ring)
    if x.shape[2] == 0:
        return
    _write_rows(quantize(x, fmt), codes, meta, first + torch.arange(x.shape[2], device=x.device), due=start >= 0)


def quantize_pack_at(x, codes, meta, start, fmt: StreamFormat, ring: int = 0, kernel: bool | None = None) -> None:
    """`quantize_pack_at_reference`'s contract, on the Triton kernel `oscar::quantize_pack_at` where it applies."""
    if use_kernels(x, fmt) if kernel is None else kernel:
        blocks, chunk, wide_rows, wide_channels = _kernel_layout(fmt)
        kernel_op("quantize_pack_at")(x, float(fmt.clip), codes, meta, start, blocks, chunk, int(ring), wide_rows,
                                      wide_channels)
    else:
        quantize_pack_at_reference(x, codes, meta, start, fmt, ring)


# ------------------------------------------------------------------------------------------ segment_attention
@dataclass
class Segments:
    """What a chunk of queries attends to, rotated, at positions 0, 1, ... in this order:
    [sink | history | recent | extra]. sink/recent/extra: `[B, H, n, d]`; history: `Packed` keys and values."""

    sink_keys: torch.Tensor
    sink_values: torch.Tensor
    history_keys: Packed
    history_values: Packed
    recent_keys: torch.Tensor
    recent_values: torch.Tensor
    extra_keys: torch.Tensor
    extra_values: torch.Tensor

    @property
    def lengths(self) -> tuple[int, int, int, int]:
        return (self.sink_keys.shape[2], self.history_keys.length, self.recent_keys.shape[2],
                self.extra_keys.shape[2])


def segment_attention_reference(
    q: torch.Tensor, seg: Segments, key_mask: torch.Tensor | None, queries_per_group: int, query_start: int,
    scale: float, row_block: int = 1024, emulate_bf16: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of grouped query rows over `seg`.

    Args:
        q: `[B, H, M, d]` rotated, row r = g·T + t of KV head h is query head h·G + g at position `query_start + t`
            (T = `queries_per_group`).
        key_mask: `[B, N]` bool over the N positions of `seg` (True = attend), or None. Causality comes from
            positions: query row r sees keys at positions <= its own.
        emulate_bf16: round the probabilities to bfloat16 before they weigh the values, as the kernel's tensor-core
            dots do; tests use it to scale their tolerance by the error of a reference at the kernel's precision.
    Returns:
        `(out [B, H, M, d] in q.dtype, lse [B, H, M] float32)`; rows with no visible key give 0 and -inf.
    """
    # one float32 copy of the keys and of the values: the many query rows of a chunk read them as one matrix
    keys = torch.cat([seg.sink_keys.float(), dequantize(seg.history_keys), seg.recent_keys.float(),
                      seg.extra_keys.float()], 2)
    values = torch.cat([seg.sink_values.float(), dequantize(seg.history_values), seg.recent_values.float(),
                        seg.extra_values.float()], 2)
    out, lse = _attention(q, [keys], [values], key_mask, queries_per_group, query_start, scale, row_block,
                          emulate_bf16)
    return out.to(q.dtype), lse


def _attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], key_mask: torch.Tensor | None,
               queries_per_group: int, query_start: int, scale: float, row_block: int = 1024,
               emulate_bf16: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`segment_attention_reference` over keys and values given in parts `[B, H, n_i, d]`, at consecutive positions
    from 0: float32 `(out, lse)`. Each part is read where it is (in float32), and only the scores are concatenated:
    for a few query rows (a decode step), a smaller copy than the keys'."""
    parts = [(k.float(), v.float()) for k, v in zip(keys, values) if k.shape[2]]
    if not parts:
        return q.new_zeros(q.shape, dtype=torch.float32), q.new_full(q.shape[:3], float("-inf"), dtype=torch.float32)
    ends = list(itertools.accumulate((k.shape[2] for k, _ in parts), initial=0))
    n, m = ends[-1], q.shape[2]
    # the first query row's position is the lowest: where it sees every key and no key is masked (a decode step),
    # every row sees every key, and no mask is needed
    masked = key_mask is not None or query_start < n - 1
    outs, lses = [], []
    for r0 in range(0, m, row_block):
        r1 = min(r0 + row_block, m)
        rows = q[:, :, r0:r1].float()
        scores = [torch.matmul(rows, k.transpose(-1, -2)) for k, _ in parts]
        scores = (scores[0] if len(scores) == 1 else torch.cat(scores, -1)) * scale
        if masked:
            qpos = query_start + torch.arange(r0, r1, device=q.device) % queries_per_group
            visible = (torch.arange(n, device=q.device)[None, :] <= qpos[:, None])[None, None]  # [1, 1, rows, n]
            if key_mask is not None:
                visible = visible & key_mask[:, None, None, :n].bool()
            scores = scores.masked_fill(~visible, float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)
        safe = torch.where(torch.isfinite(lse), lse, 0.0) if masked else lse  # a row that sees no key gives 0
        probs = torch.exp(scores - safe.unsqueeze(-1))
        if emulate_bf16:
            probs = probs.to(torch.bfloat16).float()
        out = torch.matmul(probs[..., : ends[1]], parts[0][1])
        for (_, v), a, b in zip(parts[1:], ends[1:], ends[2:]):
            out.add_(torch.matmul(probs[..., a:b], v))
        outs.append(out)
        lses.append(lse)
    if len(outs) == 1:
        return outs[0], lses[0]
    return torch.cat(outs, 2), torch.cat(lses, 2)


def segment_attention(q, seg: Segments, fmt: LayerFormat, key_mask, queries_per_group: int, query_start: int,
                      scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`segment_attention_reference`'s contract, on the Triton kernel where it applies."""
    if not use_kernels(q, fmt):
        return segment_attention_reference(q, seg, key_mask, queries_per_group, query_start, scale)
    blocks, chunk, wide_rows, wide_channels = _kernel_layout(fmt.keys)
    hk, hv = seg.history_keys, seg.history_values
    n_sink, n_hist, n_recent, n_extra = seg.lengths
    return kernel_op("segment_attention")(
        q, seg.sink_keys, seg.sink_values, hk.codes, hk.meta, hv.codes, hv.meta, seg.recent_keys, seg.recent_values,
        seg.extra_keys, seg.extra_values, key_mask, n_sink, n_hist, n_recent, n_extra, int(queries_per_group),
        int(query_start), float(scale), blocks, chunk, wide_rows, wide_channels)


# ------------------------------------------------------------------------------------------ decode_attention
@dataclass
class DecodeBuffers:
    """A layer's whole buffers as a decode step reads them: sink `[B, H, S, d]` (positions [0, n_sink)), the
    history streams' `codes` / `meta` (capacity C rows, row j = position S + j), and the ring `[B, H, R, d]`
    (position S + n_hist + i at slot (ring_lo + i) mod R)."""

    sink_keys: torch.Tensor
    sink_values: torch.Tensor
    key_codes: torch.Tensor
    key_meta: torch.Tensor | None
    value_codes: torch.Tensor
    value_meta: torch.Tensor | None
    ring_keys: torch.Tensor
    ring_values: torch.Tensor


def decode_attention_reference(
    q: torch.Tensor, buffers: DecodeBuffers, fmt: LayerFormat, key_mask: torch.Tensor | None, lengths: torch.Tensor,
    queries_per_group: int, scale: float, value_rotation: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of grouped query rows over one layer's fixed buffers with the lengths on the device (no host
    synchronisation under torch.compile, fixed shapes: what a CUDA graph can replay).

    Args:
        q: `[B, H, M, d]` rotated queries, row r = g·T + t (as in `segment_attention_reference`).
        key_mask: `[B, N]` bool over positions, or None.
        lengths: int32 `[5]` on q's device: (n_sink, n_hist, n_recent, ring_lo, q_start) (`positions.PositionPlan`);
            query row r is at position q_start + (r mod T) and sees positions <= its own.
        value_rotation: `[H, d, d]` R_V, or None: the output is un-rotated (·R_Vᵀ, in float32) before its rounding to
            q.dtype.
    Returns:
        `out [B, H, M, d]` in q.dtype (rows with no visible key: 0).
    """
    b = buffers
    capacity = b.key_codes.shape[2]  # both histories hold the same rows, whole chunks of each (storage.py)
    if b.value_codes.shape[2] != capacity:
        raise ValueError(f"the key and value histories hold {capacity} and {b.value_codes.shape[2]} rows: a layer's "
                         "streams share one capacity")
    hist = [dequantize(Packed(codes[:, :, :capacity], None if meta is None else
                              meta[:, : capacity // stream.chunk] if stream.channelwise else meta[:, :, :capacity],
                              stream))
            for codes, meta, stream in ((b.key_codes, b.key_meta, fmt.keys), (b.value_codes, b.value_meta, fmt.values))]
    n_sink, n_hist, n_recent, ring_lo, q_start = lengths.long().unbind()
    s, r = b.sink_keys.shape[2], b.ring_keys.shape[2]
    device = q.device
    slot = torch.arange(r, device=device)
    ring_offset = (slot - ring_lo) % r  # recent token index held by each ring slot
    sink_pos = torch.arange(s, device=device)
    hist_pos = s + torch.arange(capacity, device=device)
    positions = torch.cat([sink_pos, hist_pos, s + n_hist + ring_offset])
    stored = torch.cat([sink_pos < n_sink, hist_pos - s < n_hist, ring_offset < n_recent])
    keys = torch.cat([b.sink_keys.float(), hist[0], b.ring_keys.float()], 2)
    values = torch.cat([b.sink_values.float(), hist[1], b.ring_values.float()], 2)
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


def decode_attention_host(
    q: torch.Tensor, buffers: DecodeBuffers, fmt: LayerFormat, key_mask: torch.Tensor | None, lengths: torch.Tensor,
    queries_per_group: int, scale: float, value_rotation: torch.Tensor | None = None,
) -> torch.Tensor:
    """`decode_attention_reference`'s contract with the lengths read on the host: attention to the stored tokens
    only, in position order (sink, the history's rows, the ring's recent slots), as a chunk attends to them, with no
    mask over the unused rows and slots. What the CPU runs eagerly, where reading the lengths costs nothing."""
    b = buffers
    n_sink, n_hist, n_recent, ring_lo, q_start = lengths.tolist()
    hist = [Packed(codes[:, :, :n_hist], None if meta is None else
                   meta[:, : n_hist // stream.chunk] if stream.channelwise else meta[:, :, :n_hist], stream)
            for codes, meta, stream in ((b.key_codes, b.key_meta, fmt.keys), (b.value_codes, b.value_meta, fmt.values))]
    ring = b.ring_keys.shape[2]
    recent = (slice(ring_lo, min(ring_lo + n_recent, ring)), slice(0, max(ring_lo + n_recent - ring, 0)))  # wrapped
    keys = [b.sink_keys[:, :, :n_sink], dequantize(hist[0]), *(b.ring_keys[:, :, r] for r in recent)]
    values = [b.sink_values[:, :, :n_sink], dequantize(hist[1]), *(b.ring_values[:, :, r] for r in recent)]
    out, _ = _attention(q, keys, values, key_mask, queries_per_group, q_start, scale)
    if value_rotation is not None:
        out = rotate(out, value_rotation.float().transpose(-1, -2))
    return out.to(q.dtype)


def decode_attention(q, buffers: DecodeBuffers, fmt: LayerFormat, key_mask, lengths, queries_per_group: int,
                     scale: float, value_rotation=None, kernel: bool = False):
    """`decode_attention_reference`'s contract; `kernel` (decided once by the caller, outside any compiled region)
    selects the Triton kernel `oscar::decode_attention`. Without it, an eager step on the CPU (which reads the
    lengths for free) runs `decode_attention_host`."""
    if not kernel:
        attend = decode_attention_reference if torch.compiler.is_compiling() or q.is_cuda else decode_attention_host
        return attend(q, buffers, fmt, key_mask, lengths, queries_per_group, scale, value_rotation)
    blocks, chunk, wide_rows, wide_channels = _kernel_layout(fmt.keys)
    b = buffers
    return kernel_op("decode_attention")(
        q, b.sink_keys, b.sink_values, b.key_codes, b.key_meta, b.value_codes, b.value_meta, b.ring_keys,
        b.ring_values, key_mask, lengths, int(queries_per_group), float(scale), blocks, chunk, wide_rows,
        wide_channels, value_rotation)


# ------------------------------------------------------------------------------------------ rotate_store_token
def rotate_store_token_reference(
    keys: torch.Tensor, values: torch.Tensor, key_rotation: torch.Tensor, value_rotation: torch.Tensor,
    sink_k: torch.Tensor, sink_v: torch.Tensor, ring_k: torch.Tensor, ring_v: torch.Tensor, position: torch.Tensor,
    sink_tokens: int, ring: int,
) -> torch.Tensor:
    """A decode step's store: one token's key and value rotated and written to its slot, branch-free.

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
