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

`quantize(x, fmt)` / `dequantize(packed)` apply these to one history stream as `format.StreamFormat` describes it
(per-head key blocks, 4-bit wide heads as two 2-bit planes, wide key channels): the torch twin of the kernels' writes
and reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import DTYPES
from .format import WIDE_BITS, StreamFormat


# --------------------------------------------------------------------------------------------- packing
def _pack_planar_u8(codes: torch.Tensor, bits: int) -> torch.Tensor:
    per_byte = 8 // bits
    d = codes.shape[-1]
    if d % per_byte:
        raise ValueError(f"cannot pack {d} codes of {bits} bits into whole bytes")
    # byte j = Σ_p c[j + p·d/k]·2^(bits·p), summed in float32 (exact: at most 255): a product and a sum over the planes
    # rather than a shift and an or per plane, fewer operations for the one row a decode step writes
    weights = torch.tensor([float(1 << (bits * p)) for p in range(per_byte)], device=codes.device)[:, None]
    return (codes.unflatten(-1, (per_byte, d // per_byte)) * weights).sum(-2).to(torch.uint8)


def _unpack_planar_u8(packed: torch.Tensor, bits: int) -> torch.Tensor:
    per_byte = 8 // bits
    if per_byte > 1 and _whole_words(packed):
        return _unpack_words(packed, bits)
    mask = (1 << bits) - 1
    planes = [(packed >> (bits * p)) & mask for p in range(per_byte)]
    return torch.cat(planes, dim=-1)


def _whole_words(packed: torch.Tensor) -> bool:
    """Whether `_unpack_words` reads `packed`: on the CPU, eager (dtype views stay out of compiled graphs), rows of a
    multiple of 16 bytes that an int64 view can cover."""
    return (packed.device.type == "cpu" and not torch.compiler.is_compiling() and packed.shape[-1] % 16 == 0
            and packed.numel() > 0 and packed.stride(-1) == 1 and packed.storage_offset() % 8 == 0
            and all(s % 8 == 0 for s in packed.stride()[:-1]))


def _unpack_words(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """`_unpack_planar_u8` eight bytes at a time: each plane is a shift and a mask of the rows as int64 words (the mask
    keeps within each byte, so no bit crosses into the next code), and the planes are interleaved per row as 16-byte
    complex128 elements. Byte-wise shifts and a concatenation along the row take several times longer: torch's
    elementwise loops pay per row, and a packed row is a few bytes."""
    words = packed.view(torch.int64)
    shifts = torch.arange(0, 8, bits, device=packed.device).view(-1, *(1,) * words.dim())
    planes = (words >> shifts).bitwise_and_(int.from_bytes(bytes([(1 << bits) - 1]) * 8, "little"))
    rows = planes.view(torch.complex128).movedim(0, -2).contiguous()  # [..., 8 / bits, row_bytes / 16]
    return rows.view(torch.uint8).reshape(*packed.shape[:-1], packed.shape[-1] * 8 // bits)


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


# --------------------------------------------------------------------------------------------- token-wise
@dataclass
class QuantizedRows:
    """Packed rows: `codes` `[..., d·bits/8]` uint8 and `meta` `[..., d/group_size, 2]` (scale, minimum)."""

    codes: torch.Tensor
    meta: torch.Tensor
    bits: int
    group_size: int


def quantize_rows(x: torch.Tensor, bits: int, group_size: int, meta_dtype: str | torch.dtype = "float16",
                  wide: bool = False) -> QuantizedRows:
    """Token-wise asymmetric quantization of `x` `[..., d]` (float) into packed codes and (scale, minimum) pairs.
    `wide`: 4-bit codes of a wide head, whose stored scale is 4·s: s is kept within a quarter of the dtype's range."""
    if isinstance(meta_dtype, str):
        meta_dtype = DTYPES[meta_dtype]
    d = x.shape[-1]
    if d % group_size:
        raise ValueError(f"group_size {group_size} does not divide the row length {d}")
    levels = (1 << bits) - 1
    xg = x.float().reshape(*x.shape[:-1], d // group_size, group_size)
    lo, hi = torch.aminmax(xg, dim=-1)
    finfo = torch.finfo(meta_dtype)
    top = finfo.max / 4 if wide else finfo.max
    scale = ((hi - lo) / levels).clamp(min=finfo.tiny, max=top).to(meta_dtype)
    minimum = lo.clamp(min=finfo.min, max=finfo.max).to(meta_dtype)
    meta = torch.stack([scale, minimum], dim=-1)
    s, m = meta[..., None, :].float().unbind(-1)  # the stored values, [..., G, 1]
    codes = torch.round((xg - m) / s).clamp_(0, levels).to(torch.uint8).reshape(x.shape)
    return QuantizedRows(pack_codes(codes, bits), meta, bits, group_size)


def dequantize_rows(q: QuantizedRows, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x̂ = code·scale + minimum, as `[..., d]` in `dtype`."""
    codes = unpack_codes(q.codes, q.bits)
    d = codes.shape[-1]
    scale, minimum = _split_meta(q.meta[..., None, :])  # [..., G, 1]
    out = codes.float().unflatten(-1, (d // q.group_size, q.group_size)).mul_(scale).add_(minimum)
    return out.flatten(-2).to(dtype)


def _split_meta(meta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, minimum) of `meta` `[..., 2]` as separate contiguous float32 tensors: a strided operand would slow
    down every broadcast product over the codes."""
    scale, minimum = meta.float().unbind(-1)
    return scale.contiguous(), minimum.contiguous()


# --------------------------------------------------------------------------------------------- channel-wise
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
    q = quantize_rows(columns, bits, block, meta_dtype, wide)
    codes = unpack_codes(q.codes, bits).reshape(columns.shape).transpose(-1, -2).reshape(x.shape)
    return codes, q.meta.squeeze(-2)


def dequantize_channels(q: QuantizedBlocks, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x̂ = code·scale + minimum per channel and block, as `[..., L, d]` in `dtype`. L need not fill the last block
    (a view that ends inside one): meta covers ceil(L / block) blocks."""
    codes = unpack_codes(q.codes, q.bits)
    length = codes.shape[-2]
    blocks = -(-length // q.block)
    if blocks * q.block > length:  # whole blocks, so that each block's meta broadcasts over its tokens
        codes = torch.nn.functional.pad(codes, (0, 0, 0, blocks * q.block - length))
    scale, minimum = _split_meta(q.meta[..., :blocks, None, :, :])  # [..., blocks, 1, d]
    out = codes.float().unflatten(-2, (blocks, q.block)).mul_(scale).add_(minimum)
    return out.flatten(-3, -2)[..., :length, :].to(dtype)


def quantize_wide_channels(x: torch.Tensor, block: int, n: int, meta_dtype: str | torch.dtype = "float16") -> QuantizedBlocks:
    """One head's 2-bit channel-wise keys `x` `[..., L, d]` with n wide channels (`format.py`): channels 0..n−1 at
    4 bits (high planes in their slots, low planes in the last n slots), channels d−n..d−1 their block means, the
    rest at 2 bits."""
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
        _read_wide_channels(keys, q, n)
    return keys


def _read_wide_channels(keys: torch.Tensor, q: QuantizedBlocks, n: int) -> None:
    """`keys`, `q` dequantized as plain 2-bit channels, become `dequantize_wide_channels(q, n)` in place."""
    d = keys.shape[-1]
    low = unpack_2bit_u8(q.codes)[..., d - n :].float()  # the last n slots' codes: low planes
    meta = q.meta.float().repeat_interleave(q.block, dim=-3)[..., : keys.shape[-2], d - n :, :]  # [..., L, n, 2]
    keys[..., :n] += low * meta[..., 0]
    keys[..., d - n :] = meta[..., 1]


# --------------------------------------------------------------------------------------------- wide heads
def _split_wide(packed4: torch.Tensor, meta4: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """4-bit packed codes and their (scale, minimum) -> (high plane, low plane) as packed 2-bit codes, and the meta
    with the high plane's scale 4·s (exact: a power of two)."""
    codes = unpack_4bit_u8(packed4)
    meta = meta4.clone()
    meta[..., 0] = meta4[..., 0] * 4
    return pack_2bit_u8(codes >> 2), pack_2bit_u8(codes & 3), meta


def _low_meta(meta: torch.Tensor) -> torch.Tensor:
    """The (scale, minimum) a wide head's low plane is read with: a quarter of the stored scale, no minimum."""
    scale = meta[..., 0].float() / 4
    return torch.stack([scale, torch.zeros_like(scale)], dim=-1)


# --------------------------------------------------------------------------------------------- one history stream
@dataclass
class Packed:
    """Rows of one history stream as `fmt` stores them: `codes` `[B, H + U, n, row_bytes]` uint8 and `meta`
    (token-wise `[B, H, n, G, 2]`; channel-wise `[B, ceil(n/chunk), R, d, 2]`, starting on a chunk boundary, n may
    end inside a chunk), or, for 16-bit streams, the dense rows `[B, H, n, d]` in `codes` and `meta` None."""

    codes: torch.Tensor
    meta: torch.Tensor | None
    fmt: StreamFormat

    @property
    def length(self) -> int:
        return self.codes.shape[2]


def quantize(x: torch.Tensor, fmt: StreamFormat) -> Packed:
    """Rows `x` `[B, H, n, d]` (rotated) in `fmt`'s format (channel-wise: n a multiple of the chunk). Token-wise
    rows of 2-bit heads are clipped at `fmt.clip` first; a wide head's rows are not clipped."""
    if fmt.dense:
        return Packed(x, None, fmt)
    b, h, n, d = x.shape
    if h != fmt.heads or d != fmt.head_dim:
        raise ValueError(f"rows of {h} KV heads of dim {d} for a stream of {fmt.heads} heads of dim {fmt.head_dim}")
    wide = fmt.wide_heads
    if not fmt.channelwise:
        q = quantize_rows(clip_rows(x.float(), fmt.clip), fmt.bits, fmt.group_size, fmt.scale_dtype)
        if not wide:
            return Packed(q.codes, q.meta, fmt)
        # The clip trades outliers for a finer 2-bit grid; at 4 bits it costs more than it saves: wide rows unclipped.
        q4 = quantize_rows(x[:, list(wide)].float(), WIDE_BITS, fmt.group_size, fmt.scale_dtype, wide=True)
        high, low, q.meta[:, list(wide)] = _split_wide(q4.codes, q4.meta)
        codes = torch.cat([q.codes, low], dim=1)
        codes[:, list(wide)] = high
        return Packed(codes, q.meta, fmt)
    if n % fmt.chunk:
        raise ValueError(f"keys enter the history in whole chunks of {fmt.chunk} tokens, got {n}")
    chunks = n // fmt.chunk
    codes = x.new_empty(b, fmt.code_rows, n, fmt.row_bytes, dtype=torch.uint8)
    meta = None
    for head, (block, offset) in enumerate(zip(fmt.blocks, fmt.offsets)):
        is_wide = bool(fmt.wide_rows) and fmt.wide_rows[head] >= 0
        if fmt.wide_channels and fmt.wide_channels[head]:
            q = quantize_wide_channels(x[:, head], block, fmt.wide_channels[head], fmt.scale_dtype)
        else:
            q = quantize_channels(x[:, head], WIDE_BITS if is_wide else fmt.bits, block, fmt.scale_dtype, is_wide)
        q_codes, q_meta = q.codes, q.meta  # meta [B, n/block, d, 2]
        if is_wide:
            q_codes, codes[:, fmt.wide_rows[head]], q_meta = _split_wide(q.codes, q.meta)
        if meta is None:
            meta = q_meta.new_empty(b, chunks, fmt.rows_per_chunk, d, 2)
        codes[:, head] = q_codes
        meta[:, :, offset : offset + fmt.chunk // block] = q_meta.reshape(b, chunks, fmt.chunk // block, d, 2)
    return Packed(codes, meta, fmt)


def head_blocks(p: Packed, head: int) -> QuantizedBlocks:
    """KV head `head` of channel-wise `p` as plain blocks (`[B, n, ...]`): a view of the codes, the head's metadata
    rows in token order."""
    fmt = p.fmt
    block, offset = fmt.blocks[head], fmt.offsets[head]
    per_chunk = fmt.chunk // block
    meta = p.meta[:, :, offset : offset + per_chunk]
    meta = meta.reshape(meta.shape[0], meta.shape[1] * per_chunk, *meta.shape[3:])
    return QuantizedBlocks(p.codes[:, head], meta, fmt.bits, block)


def dequantize(p: Packed | torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Dense rows `[B, H, n, d]` in `dtype` (wide heads with their low planes; a tensor is returned as it is)."""
    if isinstance(p, torch.Tensor):
        return p.to(dtype)
    fmt = p.fmt
    if fmt.dense:
        return p.codes.to(dtype)
    wide = fmt.wide_rows
    if fmt.channelwise:
        if len(set(fmt.blocks)) == 1:  # one key block: every head's metadata rows in token order, read at once
            meta = p.meta.unflatten(2, (fmt.heads, -1)).movedim(2, 1).flatten(2, 3)  # [B, H, n/block, d, 2]
            keys = dequantize_channels(QuantizedBlocks(p.codes[:, : fmt.heads], meta, fmt.bits, fmt.blocks[0]))
        else:
            keys = torch.stack([dequantize_channels(head_blocks(p, h)) for h in range(fmt.heads)], dim=1)
        for h in range(fmt.heads):
            if fmt.wide_channels and fmt.wide_channels[h]:
                _read_wide_channels(keys[:, h], head_blocks(p, h), fmt.wide_channels[h])
            if wide and wide[h] >= 0:
                blocks = head_blocks(p, h)
                keys[:, h] += dequantize_channels(QuantizedBlocks(p.codes[:, wide[h]], _low_meta(blocks.meta), 2,
                                                                  blocks.block))
        return keys.to(dtype)
    out = dequantize_rows(QuantizedRows(p.codes[:, : fmt.heads], p.meta, fmt.bits, fmt.group_size))
    for h in fmt.wide_heads:
        out[:, h] += dequantize_rows(QuantizedRows(p.codes[:, wide[h]], _low_meta(p.meta[:, h]), 2, fmt.group_size))
    return out.to(dtype)


# --------------------------------------------------------------------------------------------- round trips
def fake_quantize_channels(x: torch.Tensor, bits: int, block: int, meta_dtype="float16") -> torch.Tensor:
    """quantize → dequantize channel-wise over blocks of tokens (`x` `[..., L, d]`, L a multiple of `block`)."""
    return dequantize_channels(quantize_channels(x, bits, block, meta_dtype), x.dtype)


def fake_quantize(x: torch.Tensor, bits: int, group_size: int, clip_ratio: float = 1.0, meta_dtype="float16") -> torch.Tensor:
    """clip → quantize → dequantize, returning a tensor like `x` (what the cache will give back for these rows)."""
    return dequantize_rows(quantize_rows(clip_rows(x.float(), clip_ratio), bits, group_size, meta_dtype), x.dtype)
