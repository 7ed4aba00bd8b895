"""One OSCAR layer's buffers, in the layout its `format.LayerFormat` describes (see format.py for the bytes):

    sink     `[B, H, S + 1, d]`   position p < S at slot p;                 slot S: scratch
    ring     `[B, H, R + 1, d]`   position p >= S at slot (p − S) mod R;    slot R: scratch   (positions.py)
    history  keys and values (`QuantizedHistory`): row j = position S + j

Growable (the dynamic cache: history capacity grows geometrically as tokens arrive) or fixed (the static cache:
allocated once for `max_cache_len`, addresses never change, so a captured step can write at device-side rows). The
storage holds no lengths and makes no decisions: the position plan says what is where, the layer says what to write.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from . import ops
from .format import LayerFormat, StreamFormat
from .quant import Packed, dequantize

_MIN_GROWTH = 256  # spare history rows when a growable history must grow


class QuantizedHistory:
    """The history buffers of one stream (keys or values) of one layer, rows [0, capacity): `codes` and `meta`
    (a 16-bit stream keeps its rows dense in `codes`, in the model dtype, and has no `meta`)."""

    def __init__(self, fmt: StreamFormat):
        self.fmt = fmt
        self.codes: torch.Tensor | None = None
        self.meta: torch.Tensor | None = None
        self.kernel: bool | None = None  # whether the Triton kernels write (decided once by the layer; None: per call)

    @property
    def buffers(self) -> list[torch.Tensor]:
        return [t for t in (self.codes, self.meta) if t is not None]

    @property
    def capacity(self) -> int:
        return 0 if self.codes is None else self.codes.shape[2]

    def _empty(self, batch: int, capacity: int, dtype: torch.dtype, device):
        fmt = self.fmt
        if fmt.dense:
            return torch.zeros(batch, fmt.heads, capacity, fmt.head_dim, dtype=dtype, device=device), None
        if fmt.channelwise:
            meta = torch.zeros(batch, capacity // fmt.chunk, fmt.rows_per_chunk, fmt.head_dim, 2, dtype=fmt.meta_dtype,
                               device=device)
        else:
            meta = torch.zeros(batch, fmt.heads, capacity, fmt.groups, 2, dtype=fmt.meta_dtype, device=device)
        codes = torch.zeros(batch, fmt.code_rows, capacity, fmt.row_bytes, dtype=torch.uint8, device=device)
        return codes, meta

    def allocate(self, batch: int, capacity: int, dtype: torch.dtype, device) -> None:
        """Zero-filled buffers for `capacity` rows (whole chunks: `LayerStorage` gives both streams one capacity)."""
        self.codes, self.meta = self._empty(batch, capacity, dtype, device)

    def resize(self, capacity: int) -> None:
        """Buffers for `capacity` rows (whole chunks, at least as many as now), keeping the rows already written."""
        codes, meta = self._empty(self.codes.shape[0], capacity, self.codes.dtype, self.codes.device)
        codes.narrow(2, 0, self.codes.shape[2]).copy_(self.codes)
        if meta is not None:
            dim = 1 if self.fmt.channelwise else 2
            meta.narrow(dim, 0, self.meta.shape[dim]).copy_(self.meta)
        self.codes, self.meta = codes, meta

    def write(self, rows: torch.Tensor, start: int, rotation: torch.Tensor | None = None) -> None:
        """Quantizes rows `[B, H, n, d]` (rotated by `rotation` `[H, d, d]` first, if given) into rows
        [start, start + n) (channel-wise: whole chunks)."""
        if rows.shape[2]:
            ops.quantize_pack(rows, rotation, self.codes, self.meta, start, self.fmt, kernel=self.kernel)

    def write_at(self, rows: torch.Tensor, start: torch.Tensor | int, ring: int = 0) -> None:
        """Quantizes rows (rotated) into rows [start, start + n); a negative `start` writes nothing. `start` an int64
        device tensor of one element: with no host synchronisation (branch-free: the rows are quantized and the old
        bytes written back where nothing is due); an int: a plain `write`, where one is due. `ring` > 0
        (channel-wise): `rows` is the ring, history row j at slot j mod ring, and the one chunk at `start` is read
        from it."""
        if isinstance(start, int):
            if start >= 0:
                if ring:
                    rows = rows.index_select(2, torch.arange(start, start + self.fmt.chunk, device=rows.device) % ring)
                self.write(rows, start)
            return
        ops.quantize_pack_at(rows, self.codes, self.meta, start, self.fmt, ring=ring, kernel=self.kernel)

    def packed(self, start: int, end: int) -> Packed:
        """Rows [start, end) as a view (channel-wise: `start` on a chunk boundary)."""
        fmt = self.fmt
        if fmt.dense:
            return Packed(self.codes[:, :, start:end], None, fmt)
        if fmt.channelwise:
            return Packed(self.codes[:, :, start:end], self.meta[:, start // fmt.chunk : -(-end // fmt.chunk)], fmt)
        return Packed(self.codes[:, :, start:end], self.meta[:, :, start:end], fmt)

    def dequantize(self, start: int, end: int, dtype: torch.dtype) -> torch.Tensor:
        return dequantize(self.packed(start, end), dtype)

    def map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.codes = fn(self.codes)
        self.meta = None if self.meta is None else fn(self.meta)

    def nbytes(self, rows: int | None = None) -> int:
        """Bytes allocated, or (`rows`) those holding rows [0, rows)."""
        total = 0
        for t, per_row in ((self.codes, 1), (self.meta, self.fmt.chunk if self.fmt.channelwise else 1)):
            if t is None:
                continue
            size = t.numel() * t.element_size()
            if rows is not None:
                n = t.shape[1 if t is self.meta and self.fmt.channelwise else 2]
                size = size * min(-(-rows // per_row), n) // n if n else 0
            total += size
        return total


class LayerStorage:
    """Sink, ring and the two histories of one OSCAR layer (module docstring)."""

    def __init__(self, fmt: LayerFormat, sink: int, ring: int):
        self.fmt, self.sink_size, self.ring_size = fmt, sink, ring
        self.keys, self.values = QuantizedHistory(fmt.keys), QuantizedHistory(fmt.values)
        self.sink_keys = self.sink_values = self.ring_keys = self.ring_values = None

    def allocate(self, like: torch.Tensor, capacity: int) -> None:
        """Zero-filled buffers with the batch, dtype and device of `like` `[B, H, n, d]`, the histories for at least
        `capacity` rows."""
        b, h, _, d = like.shape
        self.sink_keys, self.sink_values = (like.new_zeros(b, h, self.sink_size + 1, d) for _ in range(2))
        self.ring_keys, self.ring_values = (like.new_zeros(b, h, self.ring_size + 1, d) for _ in range(2))
        for history in (self.keys, self.values):
            history.allocate(b, self._whole_chunks(capacity), like.dtype, like.device)

    def _whole_chunks(self, rows: int) -> int:
        """`rows` rounded up to whole chunks of both streams: keys and values always hold the same number of rows,
        since a token's value row is written when it arrives and its key row when its block completes."""
        unit = math.lcm(self.fmt.keys.chunk, self.fmt.values.chunk)
        return -(-rows // unit) * unit

    @property
    def capacity(self) -> int:
        """History rows, the same in both streams."""
        return self.keys.capacity

    def grow(self, rows: int) -> None:
        """At least `rows` history rows in both streams, keeping those written (geometric growth)."""
        if rows > self.capacity:
            capacity = self._whole_chunks(rows + max(_MIN_GROWTH, rows // 8))
            for history in (self.keys, self.values):
                history.resize(capacity)

    def buffers(self) -> list[torch.Tensor]:
        """Every tensor the layer writes (what a captured step depends on)."""
        return [self.sink_keys, self.sink_values, self.ring_keys, self.ring_values, *self.keys.buffers,
                *self.values.buffers]

    def map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.sink_keys, self.sink_values = fn(self.sink_keys), fn(self.sink_values)
        self.ring_keys, self.ring_values = fn(self.ring_keys), fn(self.ring_values)
        self.keys.map_batch(fn)
        self.values.map_batch(fn)

    def copy_batch_(self, index: torch.Tensor) -> None:
        """Reorders the batch in place (beam search), keeping every buffer's address."""
        for t in self.buffers():
            t.copy_(t.index_select(0, index.to(t.device)))
