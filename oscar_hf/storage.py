"""The storage format of the quantized history: one class, `QuantizedHistory`, owns its buffers and lengths.

One stream (the keys, or the values) of one OSCAR layer, rotated before it gets here. Buffers (B batch, H KV heads,
cap capacity in tokens, d head_dim):

- codes `[B, H, cap, d·bits/8]` uint8, one packed row per token (planar packing, `quant.py`), for both granularities;
  with wide heads (`wide`, 2-bit histories) `[B, H + U, cap, d/4]`: their low planes after the H heads (`quant.py`);
- token-wise meta `[B, H, cap, d/group_size, 2]`: (scale, minimum) per group of channels of each token;
- channel-wise meta `[B, cap/chunk, R, d, 2]`: (scale, minimum) per channel of each block of tokens, KV head h in
  blocks of `layout.blocks[h]` tokens, all heads' blocks of one chunk of `layout.chunk` tokens in one slab of R rows
  (`quant.KeyBlockLayout`). Tokens arrive a whole chunk at a time (the cache demotes in chunks), so a block is
  quantized once and never touched again;
- bits == 16: `dense` `[B, H, cap, d]` in the model dtype (no quantization; the cache-logic check).

Channel-wise 2-bit keys may have wide key channels (`wide_channels`, per KV head; `quant.py`): same buffers, read and
written with the paired slots.

Rows `[0, length)` are valid. 2-bit rows are written by `ops.quantize_pack` (the fused Triton kernel on CUDA, its
torch twin elsewhere); other widths by `quant.py` directly.
"""

from __future__ import annotations

from typing import Callable

import torch

from . import ops
from .config import DTYPES
from .quant import (KeyBlockLayout, QuantizedKeyChunks, QuantizedRows, check_wide_channels, check_wide_rows, clip_rows,
                    dequantize, quantize_key_chunks, quantize_rows, wide_heads)

GRANULARITIES = ("token", "channel")
_BULK_RESERVE = 256  # spare rows after a bulk (prefill) append


class QuantizedHistory:
    """The quantized history of one stream of one layer.

    Args:
        bits: code width (16 = stored dense).
        granularity: `"token"` (a scale/minimum per group of `group_size` channels of each token) or `"channel"` (per
            channel per block of tokens, laid out by `layout`).
        group_size: channels per token-wise group. layout: the channel-wise blocks of each KV head (`KeyBlockLayout`;
            required for `"channel"`).
        scale_dtype: dtype of the scale and minimum. clip_ratio: per-row clip before token-wise quantization.
        wide: `quant.wide_rows` of the KV heads (2-bit histories): those heads are stored at 4 bits; `()`: none.
        wide_channels: wide key channels per KV head (2-bit channel-wise histories, `quant.quantize_wide_channels`);
            `()`: none.
    """

    def __init__(self, bits: int, granularity: str, group_size: int, layout: KeyBlockLayout | None, scale_dtype: str,
                 clip_ratio: float, head_dim: int, wide: tuple[int, ...] = (), wide_channels: tuple[int, ...] = ()):
        if granularity not in GRANULARITIES:
            raise ValueError(f"history granularity must be one of {GRANULARITIES}, got {granularity!r}")
        self.bits = bits
        self.granularity = granularity if bits < 16 else "token"
        if self.granularity == "channel" and layout is None:
            raise ValueError("a channel-wise history needs a KeyBlockLayout")
        self.group_size = group_size
        self.layout = layout if self.granularity == "channel" else None
        self.scale_dtype = scale_dtype
        self.clip_ratio = clip_ratio
        self.head_dim = head_dim
        self.wide = tuple(wide) if bits == 2 else ()
        if self.wide and self.layout is not None:
            check_wide_rows(self.wide, self.layout.heads)
        self.wide_channels = ()
        if any(int(n) for n in wide_channels):
            if bits != 2 or self.layout is None:
                raise ValueError(f"wide key channels need a 2-bit channel-wise history, not a {bits}-bit "
                                 f"{self.granularity}-wise one")
            self.wide_channels = check_wide_channels(wide_channels, self.layout.heads, head_dim, self.wide)
        self.length = 0
        self.buffers: dict[str, torch.Tensor] = {}
        self.kernel: bool | None = None  # the static cache decides once whether the Triton kernels run (None: per call)

    @property
    def channelwise(self) -> bool:
        return self.granularity == "channel"

    @property
    def chunk(self) -> int:
        """Tokens that enter a channel-wise history together (1 for token-wise histories)."""
        return self.layout.chunk if self.channelwise else 1

    @property
    def kernel_key_layout(self) -> tuple[list[int], int]:
        """(blocks per KV head, chunk) as the attention ops take them; `([], 0)` for token-wise keys."""
        return (list(self.layout.blocks), self.layout.chunk) if self.channelwise else ([], 0)

    @property
    def wide_count(self) -> int:
        """U: the wide heads, whose low planes follow the H heads' rows in the codes."""
        return len(wide_heads(self.wide))

    def _row_dim(self, name: str) -> int:
        """The buffer dimension that runs along tokens (chunks for channel-wise meta)."""
        return 1 if name == "meta" and self.channelwise else 2

    @property
    def capacity(self) -> int:
        return self.buffers["dense" if self.bits == 16 else "codes"].shape[2] if self.buffers else 0

    def _allocate(self, batch: int, heads: int, capacity: int, dtype: torch.dtype, device) -> dict[str, torch.Tensor]:
        d = self.head_dim
        if self.bits == 16:
            return {"dense": torch.empty(batch, heads, capacity, d, dtype=dtype, device=device)}
        meta_dtype = DTYPES[self.scale_dtype]
        if self.channelwise:
            if heads != self.layout.heads:
                raise ValueError(f"the key block layout is for {self.layout.heads} KV heads, the states have {heads}")
            chunk = self.layout.chunk
            capacity = -(-capacity // chunk) * chunk
            meta = torch.empty(batch, capacity // chunk, self.layout.rows_per_chunk, d, 2, dtype=meta_dtype, device=device)
        else:
            meta = torch.empty(batch, heads, capacity, d // self.group_size, 2, dtype=meta_dtype, device=device)
        if self.wide:
            check_wide_rows(self.wide, heads)
        codes = torch.empty(batch, heads + self.wide_count, capacity, d * self.bits // 8, dtype=torch.uint8, device=device)
        return {"codes": codes, "meta": meta}

    def initialize(self, rows: torch.Tensor) -> None:
        """Empty buffers with the batch, heads, dtype and device of `rows` `[B, H, n, d]`."""
        self.buffers = self._allocate(rows.shape[0], rows.shape[1], 0, rows.dtype, rows.device)
        self.length = 0

    def allocate_static(self, rows: torch.Tensor, capacity: int) -> None:
        """Zero-filled buffers for `capacity` rows (a whole number of chunks) with the batch, heads, dtype and device
        of `rows`, never reallocated afterwards: the static cache's history, written at device-side indices
        (`write_rows_at`, `write_chunks_at`) so that a captured decode step has fixed shapes and addresses."""
        self.buffers = {name: buf.zero_() for name, buf in
                        self._allocate(rows.shape[0], rows.shape[1], capacity, rows.dtype, rows.device).items()}
        self.length = 0

    def _quantized(self, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        """Rows `[B, H, n, d]` (rotated) in this history's format (bits other than 2), as new tensors named like the
        buffers."""
        if self.bits == 16:
            return {"dense": rows}
        if self.channelwise:
            q = quantize_key_chunks(rows, self.bits, self.layout, self.scale_dtype)
        else:
            q = quantize_rows(clip_rows(rows.float(), self.clip_ratio), self.bits, self.group_size, self.scale_dtype)
        return {"codes": q.codes, "meta": q.meta}

    def write_rows_at(self, rows: torch.Tensor, start: torch.Tensor) -> None:
        """Token-wise: quantizes rows `[B, H, n, d]` (rotated) into rows [start, start + n) of the buffers, `start` an
        int64 device tensor of one element (negative: nothing is written). No host synchronisation; `length` is left
        to the caller."""
        if self.channelwise:
            raise ValueError("write_rows_at is for token-wise histories; channel-wise ones take whole chunks")
        self._write_at(rows, start)

    def write_chunks_at(self, rows: torch.Tensor, start: torch.Tensor, ring: int = 0) -> None:
        """Channel-wise: quantizes whole chunks of rows `[B, H, nc·chunk, d]` (rotated) into rows [start, start +
        nc·chunk), `start` an int64 device tensor of one element, a multiple of the chunk (negative: nothing is
        written). No host synchronisation. `ring` > 0: `rows` is a ring of that many slots holding history row j at
        slot j mod ring, and the one chunk at `start` is read from it in place (2-bit histories)."""
        if not self.channelwise:
            raise ValueError("write_chunks_at is for channel-wise histories")
        self._write_at(rows, start, ring)

    def _write_at(self, rows: torch.Tensor, start: torch.Tensor, ring: int = 0) -> None:
        if self.bits == 2:  # straight into the buffers: the Triton kernel on CUDA reads `start` itself
            ops.quantize_pack_at(rows, 1.0 if self.channelwise else self.clip_ratio, self.buffers["codes"],
                                 self.buffers["meta"], start, *self.kernel_key_layout, ring=ring, wide_rows=self.wide,
                                 wide_channels=self.wide_channels, kernel=self.kernel)
            return
        if ring:
            raise ValueError(f"a ring source is read by 2-bit histories only, not {self.bits}-bit ones")
        start = start.reshape(())
        due, first = start >= 0, start.clamp(min=0)
        index = first + torch.arange(rows.shape[2], device=rows.device)
        for name, t in self._quantized(rows).items():
            dim = self._row_dim(name)
            if name == "meta" and self.channelwise:
                index_m = torch.div(first, self.chunk, rounding_mode="floor") + torch.arange(t.shape[1], device=rows.device)
            else:
                index_m = index
            buf = self.buffers[name]
            buf.index_copy_(dim, index_m, torch.where(due, t, buf.index_select(dim, index_m)))

    def _meta_rows(self, tokens: int) -> int:
        return tokens // self.chunk if self.channelwise else tokens

    def reserve(self, rows: torch.Tensor, needed: int, bulk: bool, extra: int | None = None) -> None:
        """Grows the buffers to hold `needed` rows: exact plus a small reserve after a bulk append, geometric
        (1/8) during decoding, or exactly `needed + extra` when `extra` is given."""
        if needed <= self.capacity:
            return
        if extra is None:
            extra = _BULK_RESERVE if bulk else max(_BULK_RESERVE, needed // 8)
        b, h = rows.shape[:2]
        new = self._allocate(b, h, needed + extra, rows.dtype, rows.device)  # (the codes' wide rows added there)
        for name, buf in self.buffers.items():
            n = self._meta_rows(self.length) if name == "meta" else self.length
            new[name].narrow(self._row_dim(name), 0, n).copy_(buf.narrow(self._row_dim(name), 0, n))
        self.buffers = new

    def append(self, rows: torch.Tensor, bulk: bool, rotation: torch.Tensor | None = None) -> None:
        """Appends `rows` `[B, H, n, d]` after the valid history: rotated by `rotation` `[H, d, d]` first if given
        (otherwise already rotated), then clipped (token-wise), quantized and packed. Channel-wise histories take
        whole chunks only."""
        n = rows.shape[2]
        if n == 0:
            return
        if self.channelwise and (n % self.chunk or self.length % self.chunk):
            raise ValueError(
                f"channel-wise history appends whole chunks of {self.chunk} tokens (got {n} after {self.length})"
            )
        self.reserve(rows, self.length + n, bulk)
        start, end = self.length, self.length + n
        if self.bits == 2:
            ops.quantize_pack(rows, rotation, 1.0 if self.channelwise else self.clip_ratio, self.buffers["codes"],
                              self.buffers["meta"], start, *self.kernel_key_layout, wide_rows=self.wide,
                              wide_channels=self.wide_channels)
        else:
            if rotation is not None:
                rows = torch.matmul(rows, rotation)
            if self.bits == 16:
                self.buffers["dense"][:, :, start:end] = rows
            elif self.channelwise:
                q = quantize_key_chunks(rows, self.bits, self.layout, self.scale_dtype)
                self.buffers["codes"][:, :, start:end] = q.codes
                self.buffers["meta"][:, start // self.chunk : end // self.chunk] = q.meta
            else:
                q = quantize_rows(clip_rows(rows.float(), self.clip_ratio), self.bits, self.group_size, self.scale_dtype)
                self.buffers["codes"][:, :, start:end] = q.codes
                self.buffers["meta"][:, :, start:end] = q.meta
        self.length = end

    def truncate(self, length: int) -> torch.Tensor | None:
        """Keeps the first `length` rows. A channel-wise history keeps whole chunks: the valid rows of a cut chunk
        are returned dequantized `[B, H, r, d]` float32 (exactly what was stored, for the caller to keep in full precision),
        else None."""
        if length >= self.length:
            return None
        tail = None
        if self.channelwise and length % self.chunk:
            kept = length // self.chunk * self.chunk
            tail = dequantize(self.packed(kept, kept + self.chunk), torch.float32)[:, :, : length - kept]
            length = kept
        self.length = length
        return tail

    def packed(self, start: int, end: int) -> QuantizedRows | QuantizedKeyChunks | torch.Tensor:
        """Rows `[start, end)` as a view: `QuantizedRows` (token-wise), `QuantizedKeyChunks` (channel-wise; `start`
        on a chunk boundary, the chunks covering `end`), or a dense tensor when bits == 16."""
        b = self.buffers
        if self.bits == 16:
            return b["dense"][:, :, start:end]
        if self.channelwise:
            return QuantizedKeyChunks(b["codes"][:, :, start:end], b["meta"][:, start // self.chunk : -(-end // self.chunk)],
                                      self.bits, self.layout, self.wide, self.wide_channels)
        return QuantizedRows(b["codes"][:, :, start:end], b["meta"][:, :, start:end], self.bits, self.group_size, self.wide)

    def dequantize(self, start: int, end: int, dtype: torch.dtype) -> torch.Tensor:
        return dequantize(self.packed(start, end), dtype)

    def map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.buffers = {name: fn(buf) for name, buf in self.buffers.items()}

    def nbytes(self) -> tuple[int, int]:
        """(allocated, used) bytes."""
        allocated = used = 0
        for name, buf in self.buffers.items():
            size = buf.numel() * buf.element_size()
            rows = self._meta_rows(self.length) if name == "meta" else self.length
            allocated += size
            total = buf.shape[self._row_dim(name)]
            used += size * rows // total if total else 0
        return allocated, used
