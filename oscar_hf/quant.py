"""The one quantizer and the one packing convention of oscar-hf (pure torch; the Triton kernels mirror it).

Quantizer (token-wise asymmetric, oscar-method.md §1.7): each row x (one token, one KV head, `head_dim` values,
already rotated) is optionally clipped at τ = sort(|x|)[floor(r·d)], then every group of `group_size` consecutive
values gets a scale s = (max − min) / (2^b − 1) and a minimum m, both stored in 16 bits, and codes
c = round((x − m) / s) ∈ [0, 2^b − 1]; x̂ = c·s + m. Codes are computed from the *stored* (rounded) s and m, so
that dequantization reproduces exactly what the quantizer intended.

Packing convention ("planar", as OSCAR and HQQ): a row of d codes of b bits (b in {1, 2, 4, 8}) goes into d·b/8
bytes; with k = 8/b codes per byte, byte j holds codes j, j + d/k, j + 2d/k, ... in bits 0, b, 2b, ...:

    2 bits:  byte[j] = c[j] | c[j + d/4] << 2 | c[j + d/2] << 4 | c[j + 3d/4] << 6

3-bit codes are stored as a 2-bit plane (low bits) followed by a 1-bit plane (high bit): 3 bits per element exactly.

Two granularities of (scale, minimum), one packing:
- token-wise (`quantize_rows`): one pair per group of `group_size` consecutive channels of one row (one token);
  meta `[..., L, d/group_size, 2]`. OSCAR's values (and the paper's keys).
- channel-wise (`quantize_channels`): one pair per channel per block of `block` consecutive tokens (KIVI's keys);
  meta `[..., L/block, d, 2]`. The codes stay token-major and packed along head_dim exactly as above, so one
  packed row is one token for both granularities and a kernel reads keys and values the same way.

The cache's channel-wise keys give each KV head its own block (`KeyBlockLayout`, allocated at calibration so that
the heads whose attention suffers most from coarse key ranges get finer blocks, at equal average bits): tokens go in
chunks of `chunk` (the demotion unit), head h splits each chunk into blocks of `blocks[h]` tokens, and the meta of a
layer is one tensor `[B, n_chunks, R, d, 2]`, R = Σ_h chunk/blocks[h] rows per chunk, head h owning rows
offsets[h] .. offsets[h] + chunk/blocks[h] − 1 of each chunk. Token t (row t of the codes) of head h has its
(scale, minimum) per channel at meta row (t // chunk, offsets[h] + (t % chunk) // blocks[h]). Uniform blocks are the
special case blocks[h] == chunk (R = H).

Wide heads (both streams, both granularities): the few KV heads that calibration finds retrieving by content keep
their history at 4 bits inside the 2-bit layout. A wide head's 4-bit code c = 4·h + l is stored as two 2-bit rows
under the head's one (scale, minimum) pair: the high plane h in the head's own row of the codes, the low plane l in
an extra row after the layer's H KV heads (codes `[B, H + U, L, d/4]`, `wide_rows[h]` = H + j for the j-th wide head,
−1 for the others), and the stored scale is the high plane's, S = 4·s (s, the 4-bit step, rounded to the meta dtype
first, so S is exact): x̂ = h·S + m + l·S/4. Every reader adds the low plane; the meta tensors keep H heads.

Wide key channels (channel-wise keys of 2-bit heads; `OscarConfig.key_channel_bits`): within one head, calibration
gives n channels 4 bits and n others none, at the bits of 2 everywhere, and orders the head's channels (its key
rotation is that permutation) as [n four-bit | 2-bit | n zero-bit]. In each block, four-bit channel j < n keeps its
high plane in its own slot under (4·s_j, m_j), as a wide head does, and its low plane in slot d − n + j, whose own
channel keeps only its block mean μ: that slot's meta is (s_j, μ). So x̂_j = h_j·4s_j + m_j + l_j·s_j and
x̂_{d−n+j} = μ, in the same bytes and meta as 2 bits everywhere, and a score is
q·k̂ = Σ_c (q_{π(c)}·scale_c)·code_c + Σ_c q_c·min_c with π = `paired_channels(d, n)` (slot c holds the code of
channel π(c)): a reader gathers the query once per head and changes nothing else. `wide_channels[h]` is head h's n
(0 for wide heads and heads without).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import DTYPES


# --------------------------------------------------------------------------------------------- packing
def _pack_planar_u8(codes: torch.Tensor, bits: int) -> torch.Tensor:
    per_byte = 8 // bits
    d = codes.shape[-1]
    if d % per_byte:
        raise ValueError(f"cannot pack {d} codes of {bits} bits into whole bytes")
    planes = codes.to(torch.uint8).reshape(*codes.shape[:-1], per_byte, d // per_byte)
    packed = planes[..., 0, :].clone()
    for p in range(1, per_byte):
        packed |= planes[..., p, :] << (bits * p)
    return packed


def _unpack_planar_u8(packed: torch.Tensor, bits: int) -> torch.Tensor:
    per_byte = 8 // bits
    mask = (1 << bits) - 1
    planes = [(packed >> (bits * p)) & mask for p in range(per_byte)]
    return torch.cat(planes, dim=-1)


def pack_1bit_u8(codes: torch.Tensor) -> torch.Tensor:
    """`[..., d]` codes in {0, 1} -> `[..., d/8]` uint8, planar."""
    return _pack_planar_u8(codes, 1)


def unpack_1bit_u8(packed: torch.Tensor) -> torch.Tensor:
    return _unpack_planar_u8(packed, 1)


def pack_2bit_u8(codes: torch.Tensor) -> torch.Tensor:
    """`[..., d]` codes in [0, 3] -> `[..., d/4]` uint8: byte j = c[j] | c[j+d/4]<<2 | c[j+d/2]<<4 | c[j+3d/4]<<6."""
    return _pack_planar_u8(codes, 2)


def unpack_2bit_u8(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_2bit_u8`: `[..., d/4]` uint8 -> `[..., d]` uint8 codes."""
    return _unpack_planar_u8(packed, 2)


def pack_4bit_u8(codes: torch.Tensor) -> torch.Tensor:
    """`[..., d]` codes in [0, 15] -> `[..., d/2]` uint8: byte j = c[j] | c[j + d/2] << 4."""
    return _pack_planar_u8(codes, 4)


def unpack_4bit_u8(packed: torch.Tensor) -> torch.Tensor:
    return _unpack_planar_u8(packed, 4)


def pack_3bit_u8(codes: torch.Tensor) -> torch.Tensor:
    """`[..., d]` codes in [0, 7] -> `[..., 3d/8]` uint8: the 2-bit plane of the low bits, then the 1-bit plane."""
    return torch.cat([pack_2bit_u8(codes & 3), pack_1bit_u8(codes >> 2)], dim=-1)


def unpack_3bit_u8(packed: torch.Tensor) -> torch.Tensor:
    d = packed.shape[-1] * 8 // 3
    low, high = packed[..., : d // 4], packed[..., d // 4 :]
    return unpack_2bit_u8(low) | (unpack_1bit_u8(high) << 2)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Packs `[..., d]` codes of `bits` bits into `[..., d·bits/8]` uint8."""
    if bits == 3:
        return pack_3bit_u8(codes)
    if bits in (1, 2, 4, 8):
        return _pack_planar_u8(codes, bits)
    raise ValueError(f"no packing for {bits}-bit codes")


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    if bits == 3:
        return unpack_3bit_u8(packed)
    if bits in (1, 2, 4, 8):
        return _unpack_planar_u8(packed, bits)
    raise ValueError(f"no packing for {bits}-bit codes")


# --------------------------------------------------------------------------------------------- clipping
def clip_threshold_index(ratio: float, d: int) -> int:
    """Index into ascending sorted |x| whose value is the clip threshold: floor(ratio·d); d means "no clip"."""
    return min(int(ratio * d + 1e-9), d)


def clip_rows(x: torch.Tensor, ratio: float) -> torch.Tensor:
    """Clamps each row of `x` (`[..., d]`) to ±τ with τ = sort(|x|)[floor(ratio·d)]. ratio >= 1 is a no-op."""
    d = x.shape[-1]
    k = clip_threshold_index(ratio, d)
    if k >= d:
        return x
    tau = x.abs().kthvalue(k + 1, dim=-1, keepdim=True).values
    return torch.maximum(torch.minimum(x, tau), -tau)


# --------------------------------------------------------------------------------------------- wide heads
WIDE_BITS = 4  # the history bits of a wide head (module docstring)


def wide_rows(head_bits) -> tuple[int, ...]:
    """The codes row of each KV head's low plane, from its history bits (2 or `WIDE_BITS`): H + j for the j-th wide
    head, −1 for the others; `()` when no head is wide."""
    head_bits = tuple(int(b) for b in head_bits)
    bad = [b for b in head_bits if b not in (2, WIDE_BITS)]
    if bad:
        raise ValueError(f"head bits must be 2 or {WIDE_BITS}, got {list(head_bits)}")
    if WIDE_BITS not in head_bits:
        return ()
    out, extra = [], len(head_bits)
    for b in head_bits:
        out.append(extra if b == WIDE_BITS else -1)
        extra += b == WIDE_BITS
    return tuple(out)


def wide_heads(rows) -> list[int]:
    """The wide KV heads of `wide_rows`."""
    return [h for h, r in enumerate(rows) if r >= 0]


def check_wide_rows(rows, heads: int) -> tuple[int, ...]:
    """`rows` as a tuple, checked against `heads` KV heads and the numbering of `wide_rows` (`()`: none wide)."""
    rows = tuple(int(r) for r in rows)
    if rows and rows != wide_rows([WIDE_BITS if r >= 0 else 2 for r in rows]) or (rows and len(rows) != heads):
        raise ValueError(f"wide rows {list(rows)} do not number the low planes of {heads} KV heads in order "
                         f"(H + j for the j-th wide head, -1 otherwise)")
    return rows


def _split_wide(packed4: torch.Tensor, meta4: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """4-bit packed codes and their (scale, minimum) -> (high plane, low plane) as packed 2-bit codes, and the meta
    with the high plane's scale 4·s (exact: a power of two)."""
    codes = unpack_4bit_u8(packed4)
    meta = meta4.clone()
    meta[..., 0] = meta4[..., 0] * 4
    return pack_2bit_u8(codes >> 2), pack_2bit_u8(codes & 3), meta


# --------------------------------------------------------------------------------------------- wide key channels
def paired_channels(d: int, n: int, device=None) -> torch.Tensor:
    """π `[d]` int64 with n wide key channels (module docstring): slot c holds the code of channel π(c), c itself
    except the last n slots, which hold the low planes of channels 0..n−1."""
    slots = torch.arange(d, device=device)
    return torch.where(slots >= d - n, slots - (d - n), slots)


def check_wide_channels(counts, heads: int, head_dim: int, rows=()) -> tuple[int, ...]:
    """`counts` (wide key channels per KV head) as a tuple, checked: one per head, each in [0, head_dim/2], 0 for
    the wide heads of `rows`; `()` when no head has any."""
    counts = tuple(int(n) for n in counts)
    if not counts or not any(counts):
        return ()
    if len(counts) != heads:
        raise ValueError(f"{len(counts)} wide key channel counts for {heads} KV heads")
    if any(not 0 <= n <= head_dim // 2 for n in counts):
        raise ValueError(f"wide key channel counts {list(counts)} must lie in [0, {head_dim // 2}] (head_dim {head_dim})")
    if rows and any(n and r >= 0 for n, r in zip(counts, rows)):
        raise ValueError(f"wide heads (rows {list(rows)}) store 4-bit keys already and take no wide key channels, "
                         f"got {list(counts)}")
    return counts


# --------------------------------------------------------------------------------------------- quantizer
@dataclass
class QuantizedRows:
    """Packed rows: `codes` `[..., d·bits/8]` uint8 and `meta` `[..., d/group_size, 2]` (scale, minimum).
    With `wide_rows` (2-bit rows `[B, H + U, L, d/4]`, meta `[B, H, L, G, 2]`): wide heads' low planes (module
    docstring)."""

    codes: torch.Tensor
    meta: torch.Tensor
    bits: int
    group_size: int
    wide_rows: tuple[int, ...] = ()


def quantize_rows(x: torch.Tensor, bits: int, group_size: int, meta_dtype: str | torch.dtype = "float16",
                  wide: tuple[int, ...] = ()) -> QuantizedRows:
    """Token-wise asymmetric quantization of `x` `[..., d]` (float) into packed codes and (scale, minimum) pairs.
    `wide` (2 bits, `x` `[B, H, n, d]`): the KV heads' `wide_rows`; those heads' rows are quantized at 4 bits and
    stored as two 2-bit planes (module docstring)."""
    if not wide:
        return _quantize_rows(x, bits, group_size, meta_dtype)
    if bits != 2:
        raise ValueError(f"wide heads are stored in a 2-bit history, not a {bits}-bit one")
    heads = wide_heads(check_wide_rows(wide, x.shape[1]))
    q = _quantize_rows(x, 2, group_size, meta_dtype)
    q4 = _quantize_rows(x[:, heads], WIDE_BITS, group_size, meta_dtype, wide=True)
    high, low, q.meta[:, heads] = _split_wide(q4.codes, q4.meta)
    codes = torch.cat([q.codes, low], dim=1)
    codes[:, heads] = high
    return QuantizedRows(codes, q.meta, 2, group_size, tuple(wide))


def _quantize_rows(x: torch.Tensor, bits: int, group_size: int, meta_dtype: str | torch.dtype = "float16",
                   wide: bool = False) -> QuantizedRows:
    if isinstance(meta_dtype, str):
        meta_dtype = DTYPES[meta_dtype]
    d = x.shape[-1]
    if d % group_size:
        raise ValueError(f"group_size {group_size} does not divide the row length {d}")
    levels = (1 << bits) - 1
    xg = x.float().reshape(*x.shape[:-1], d // group_size, group_size)
    lo = xg.amin(-1)
    hi = xg.amax(-1)
    finfo = torch.finfo(meta_dtype)
    top = finfo.max / 4 if wide else finfo.max  # a wide head stores 4·s: s within a quarter of the dtype's range
    scale = ((hi - lo) / levels).clamp(min=finfo.tiny, max=top).to(meta_dtype)
    minimum = lo.clamp(min=finfo.min, max=finfo.max).to(meta_dtype)
    s, m = scale.float().unsqueeze(-1), minimum.float().unsqueeze(-1)
    codes = torch.round((xg - m) / s).clamp_(0, levels).to(torch.uint8).reshape(x.shape)
    return QuantizedRows(pack_codes(codes, bits), torch.stack([scale, minimum], dim=-1), bits, group_size)


def _low_meta(meta: torch.Tensor) -> torch.Tensor:
    """The (scale, minimum) a wide head's low plane is read with: a quarter of the stored scale, no minimum."""
    scale = meta[..., 0].float() / 4
    return torch.stack([scale, torch.zeros_like(scale)], dim=-1)


def dequantize_rows(q: QuantizedRows | tuple, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x̂ = code·scale + minimum, as `[..., d]` in `dtype` (wide heads: plus their low planes)."""
    if isinstance(q, tuple):
        q = QuantizedRows(*q)
    if q.wide_rows:
        heads = len(q.wide_rows)
        out = dequantize_rows(QuantizedRows(q.codes[:, :heads], q.meta, q.bits, q.group_size))
        for h, r in enumerate(q.wide_rows):
            if r >= 0:
                out[:, h] += dequantize_rows(QuantizedRows(q.codes[:, r], _low_meta(q.meta[:, h]), 2, q.group_size))
        return out.to(dtype)
    codes = unpack_codes(q.codes, q.bits)
    d = codes.shape[-1]
    cg = codes.float().reshape(*codes.shape[:-1], d // q.group_size, q.group_size)
    meta = q.meta.float()
    out = cg * meta[..., 0:1] + meta[..., 1:2]
    return out.reshape(codes.shape).to(dtype)


@dataclass
class QuantizedBlocks:
    """Channel-wise packed tokens: `codes` `[..., L, d·bits/8]` uint8 (planar, one row per token) and `meta`
    `[..., ceil(L/block), d, 2]`: (scale, minimum) of each channel over each block of `block` consecutive tokens."""

    codes: torch.Tensor
    meta: torch.Tensor
    bits: int
    block: int


def quantize_channels(x: torch.Tensor, bits: int, block: int, meta_dtype: str | torch.dtype = "float16",
                      wide: bool = False) -> QuantizedBlocks:
    """Channel-wise asymmetric quantization of `x` `[..., L, d]` (L a multiple of `block`): every channel gets one
    scale and minimum per block of tokens, the codes are packed per token like `quantize_rows`. `wide`: 4-bit codes
    of a wide head (their scale kept within a quarter of the meta dtype's range)."""
    codes, meta = _channel_codes(x, bits, block, meta_dtype, wide)
    return QuantizedBlocks(pack_codes(codes, bits), meta, bits, block)


def _channel_codes(x: torch.Tensor, bits: int, block: int, meta_dtype, wide: bool = False):
    """`quantize_channels` before packing: codes `[..., L, d]` uint8 and meta `[..., L/block, d, 2]`."""
    length, d = x.shape[-2], x.shape[-1]
    if length % block:
        raise ValueError(f"channel-wise quantization needs whole blocks: {length} tokens, block {block}")
    columns = x.float().reshape(*x.shape[:-2], length // block, block, d).transpose(-1, -2)  # [..., nb, d, block]
    q = _quantize_rows(columns, bits, block, meta_dtype, wide)
    codes = unpack_codes(q.codes, bits).reshape(columns.shape).transpose(-1, -2).reshape(x.shape)
    return codes, q.meta.squeeze(-2)


def quantize_wide_channels(x: torch.Tensor, block: int, n: int, meta_dtype: str | torch.dtype = "float16") -> QuantizedBlocks:
    """One head's 2-bit channel-wise keys `x` `[..., L, d]` with n wide channels (module docstring): channels
    0..n−1 at 4 bits (high planes in their slots, low planes in the last n slots), channels d−n..d−1 their block
    means, the rest at 2 bits."""
    codes, meta = _channel_codes(x, 2, block, meta_dtype)
    if n:
        d, length = x.shape[-1], x.shape[-2]
        codes4, meta4 = _channel_codes(x[..., :n], WIDE_BITS, block, meta_dtype, wide=True)
        codes[..., :n], codes[..., d - n :] = codes4 >> 2, codes4 & 3
        meta[..., :n, 0], meta[..., :n, 1] = meta4[..., 0] * 4, meta4[..., 1]
        finfo = torch.finfo(meta.dtype)
        # summed in float64: exact for 16-bit keys whatever the order, so the Triton kernel's mean is this one
        mean = (x[..., d - n :].double().reshape(*x.shape[:-2], length // block, block, n).sum(-2) / block).float()
        meta[..., d - n :, 0], meta[..., d - n :, 1] = meta4[..., 0], mean.clamp(finfo.min, finfo.max).to(meta.dtype)
    return QuantizedBlocks(pack_2bit_u8(codes), meta, 2, block)


def dequantize_wide_channels(q: QuantizedBlocks, n: int) -> torch.Tensor:
    """Inverse of `quantize_wide_channels`: float32 keys `[..., L, d]` (L may end inside a block)."""
    keys = dequantize_channels(q)
    if n:
        d = keys.shape[-1]
        low = unpack_2bit_u8(q.codes)[..., d - n :].float()  # the last n slots' codes: low planes
        meta = q.meta.float().repeat_interleave(q.block, dim=-3)[..., : keys.shape[-2], d - n :, :]  # [..., L, n, 2]
        keys[..., :n] += low * meta[..., 0]
        keys[..., d - n :] = meta[..., 1]
    return keys


def dequantize_channels(q: QuantizedBlocks, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x̂ = code·scale + minimum per channel and block, as `[..., L, d]` in `dtype`. L need not fill the last block
    (a view that ends inside one): meta covers ceil(L / block) blocks."""
    codes = unpack_codes(q.codes, q.bits).float()
    length = codes.shape[-2]
    meta = q.meta.float().repeat_interleave(q.block, dim=-3)[..., :length, :, :]  # [..., L, d, 2]
    return (codes * meta[..., 0] + meta[..., 1]).to(dtype)


@dataclass(frozen=True)
class KeyBlockLayout:
    """Where the channel-wise key metadata of one layer lives (module docstring): `blocks[h]` tokens per block of KV
    head h, each a divisor of `chunk`, the tokens moved into the history at once."""

    blocks: tuple[int, ...]
    chunk: int

    def __post_init__(self):
        object.__setattr__(self, "blocks", tuple(int(b) for b in self.blocks))
        bad = [b for b in self.blocks if b < 1 or self.chunk % b]
        if not self.blocks or bad:
            raise ValueError(f"key blocks {list(self.blocks)} must be non-empty and divide the chunk of {self.chunk} tokens")

    @classmethod
    def uniform(cls, heads: int, block: int, chunk: int | None = None) -> "KeyBlockLayout":
        return cls((block,) * heads, chunk or block)

    @property
    def heads(self) -> int:
        return len(self.blocks)

    @property
    def rows_per_chunk(self) -> int:
        """R: meta rows per chunk, all heads together."""
        return sum(self.chunk // b for b in self.blocks)

    @property
    def offsets(self) -> tuple[int, ...]:
        """First meta row of each head within a chunk."""
        out, row = [], 0
        for b in self.blocks:
            out.append(row)
            row += self.chunk // b
        return tuple(out)

    def select(self, heads) -> "KeyBlockLayout":
        """The layout of a subset of the KV heads (tensor-parallel shards, head slicing)."""
        return KeyBlockLayout(tuple(self.blocks[h] for h in heads), self.chunk)

    def bits_per_element(self, bits: int, meta_bits: int) -> float:
        """Average key bits per element: codes plus one (scale, minimum) per channel per block."""
        return bits + 2 * meta_bits * self.rows_per_chunk / (self.chunk * self.heads)


@dataclass
class QuantizedKeyChunks:
    """Channel-wise keys of one layer in the cache's layout: `codes` `[B, H, L, d·bits/8]` uint8 (one packed row per
    token; with `wide_rows`, `[B, H + U, L, d/4]`: wide heads' low planes after the H heads) and `meta`
    `[B, ceil(L/chunk), R, d, 2]` laid out by `layout` (module docstring). L need not fill the last chunk (a view)."""

    codes: torch.Tensor
    meta: torch.Tensor
    bits: int
    layout: KeyBlockLayout
    wide_rows: tuple[int, ...] = ()
    wide_channels: tuple[int, ...] = ()


def quantize_key_chunks(x: torch.Tensor, bits: int, layout: KeyBlockLayout,
                        meta_dtype: str | torch.dtype = "float16", wide: tuple[int, ...] = (),
                        wide_channels: tuple[int, ...] = ()) -> QuantizedKeyChunks:
    """Channel-wise quantization of keys `x` `[B, H, L, d]` (L a multiple of `layout.chunk`), head h over blocks of
    `layout.blocks[h]` tokens (`quantize_channels` per head); `wide`: the heads' `wide_rows` (2 bits only), those
    heads at 4 bits in two 2-bit planes; `wide_channels`: each head's wide key channels (2 bits only,
    `quantize_wide_channels`)."""
    b, h, length, d = x.shape
    if h != layout.heads:
        raise ValueError(f"key block layout is for {layout.heads} KV heads, got {h}")
    if length % layout.chunk:
        raise ValueError(f"keys enter the history in whole chunks of {layout.chunk} tokens, got {length}")
    if wide and bits != 2:
        raise ValueError(f"wide heads are stored in a 2-bit history, not a {bits}-bit one")
    wide = check_wide_rows(wide, h)
    wide_channels = check_wide_channels(wide_channels, h, d, wide)
    if wide_channels and bits != 2:
        raise ValueError(f"wide key channels are stored in a 2-bit history, not a {bits}-bit one")
    chunks = length // layout.chunk
    codes = x.new_empty(b, h + len(wide_heads(wide)), length, d * bits // 8, dtype=torch.uint8)
    meta = None
    for head, (block, offset) in enumerate(zip(layout.blocks, layout.offsets)):
        is_wide = bool(wide) and wide[head] >= 0
        if wide_channels and wide_channels[head]:
            q = quantize_wide_channels(x[:, head], block, wide_channels[head], meta_dtype)
        else:
            q = quantize_channels(x[:, head], WIDE_BITS if is_wide else bits, block, meta_dtype, is_wide)  # meta [B, L/block, d, 2]
        q_codes, q_meta = q.codes, q.meta
        if is_wide:
            q_codes, codes[:, wide[head]], q_meta = _split_wide(q.codes, q.meta)
        if meta is None:
            meta = q_meta.new_empty(b, chunks, layout.rows_per_chunk, d, 2)
        codes[:, head] = q_codes
        meta[:, :, offset : offset + layout.chunk // block] = q_meta.reshape(b, chunks, layout.chunk // block, d, 2)
    return QuantizedKeyChunks(codes, meta, bits, layout, wide, wide_channels)


def head_blocks(q: QuantizedKeyChunks, head: int) -> QuantizedBlocks:
    """KV head `head` of `q` as plain channel-wise blocks (`[B, L, ...]`): a view of the codes, the head's meta rows
    in token order."""
    block, offset = q.layout.blocks[head], q.layout.offsets[head]
    per_chunk = q.layout.chunk // block
    meta = q.meta[:, :, offset : offset + per_chunk]
    meta = meta.reshape(meta.shape[0], meta.shape[1] * per_chunk, *meta.shape[3:])
    return QuantizedBlocks(q.codes[:, head], meta, q.bits, block)


def dequantize_key_chunks(q: QuantizedKeyChunks, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Dense keys `[B, H, L, d]` in `dtype` (wide heads: plus their low planes)."""
    heads = []
    for h in range(q.layout.heads):
        blocks = head_blocks(q, h)
        keys = dequantize_wide_channels(blocks, q.wide_channels[h] if q.wide_channels else 0)
        if q.wide_rows and q.wide_rows[h] >= 0:
            keys += dequantize_channels(QuantizedBlocks(q.codes[:, q.wide_rows[h]], _low_meta(blocks.meta), 2, blocks.block))
        heads.append(keys.to(dtype))
    return torch.stack(heads, dim=1)


def dequantize(q: "QuantizedRows | QuantizedBlocks | QuantizedKeyChunks | torch.Tensor",
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Dense values of any granularity (a dense tensor is returned as it is, in `dtype`)."""
    if isinstance(q, torch.Tensor):
        return q.to(dtype)
    if isinstance(q, QuantizedKeyChunks):
        return dequantize_key_chunks(q, dtype)
    if isinstance(q, QuantizedBlocks):
        return dequantize_channels(q, dtype)
    return dequantize_rows(q, dtype)


def fake_quantize_channels(x: torch.Tensor, bits: int, block: int, meta_dtype="float16") -> torch.Tensor:
    """quantize → dequantize channel-wise over blocks of tokens (`x` `[..., L, d]`, L a multiple of `block`)."""
    return dequantize_channels(quantize_channels(x, bits, block, meta_dtype), x.dtype)


def fake_quantize(x: torch.Tensor, bits: int, group_size: int, clip_ratio: float = 1.0, meta_dtype="float16") -> torch.Tensor:
    """clip → quantize → dequantize, returning a tensor like `x` (what the cache will give back for these rows)."""
    return dequantize_rows(quantize_rows(clip_rows(x.float(), clip_ratio), bits, group_size, meta_dtype), x.dtype)
