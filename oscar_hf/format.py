"""The storage format: what one OSCAR layer stores, described once per layer as a frozen `LayerFormat`.

`resolve(config, rotations, geometry, shards)` turns an `OscarConfig`, a rotation file's per-head refinements and
the model's geometry (and tensor-parallel sharding) into one `LayerFormat` per full-attention layer, validated here
and nowhere else. Storage (`storage.py`), the torch twins (`quant.py`, `ops.py`) and the kernels (through
`ops.py`, which flattens it into the custom ops' arguments) all read it.

Per layer, on this rank (H = the KV heads held here, d = head_dim, B = batch, L = history rows):

    sink    [B, H, S, d]      BF16 (model dtype), rotated: positions [0, S)
    ring    [B, H, R, d]      BF16, rotated: the recent window, position p at slot (p - S) mod R   (`positions.py`)
    history one `StreamFormat` each for keys and values: packed codes and metadata, row j = position S + j

A history stream (`StreamFormat`), `bits` < 16:
- codes `[B, H + U, L, d·bits/8]` uint8, one packed row per token (planar packing, `quant.py`);
- token-wise metadata `[B, H, L, d/group_size, 2]`: (scale, minimum) per group of channels of each token (values
  always; keys with `key_granularity="token"`);
- channel-wise metadata `[B, L/chunk, R, d, 2]`: (scale, minimum) per channel of each block of tokens. Tokens enter
  in chunks of `chunk` (the demotion block); head h splits each chunk into blocks of `blocks[h]` tokens, and all
  heads' blocks of one chunk share one slab of R = Σ_h chunk/blocks[h] rows, head h owning rows
  offsets[h] .. offsets[h] + chunk/blocks[h] − 1. Token t of head h has its metadata at (t // chunk,
  offsets[h] + (t % chunk) // blocks[h]).
- `bits` == 16: one dense buffer `[B, H, L, d]` in the model dtype.

Wide heads (`wide_rows`; 2-bit streams, both keys and values): a head that retrieves by content keeps a 4-bit history
inside the 2-bit layout. Its 4-bit code c = 4·h + l is stored as two 2-bit planes under the head's one (scale,
minimum): the high plane h in the head's own codes row, the low plane l in extra row `wide_rows[head]` = H + j (the
j-th wide head; −1 for the others; U wide heads add U rows), and the stored scale is the high plane's, S = 4·s (s the
4-bit step rounded to the scale dtype first, so S is exact): x̂ = h·S + m + l·S/4.

Wide key channels (`wide_channels`; 2-bit channel-wise keys of non-wide heads): head h with n = wide_channels[h]
stores channels 0..n−1 at 4 bits and channels d−n..d−1 at 0 bits, the rest at 2 (the head's key rotation orders its
channels so: [4-bit | 2-bit | 0-bit], `wide_channel_permutation`). In each block, 4-bit channel j keeps its high plane
in its own slot under (4·s_j, m_j) and its low plane in slot d − n + j, whose own channel keeps only its block mean μ:
that slot's metadata is (s_j, μ). So x̂_j = h_j·4s_j + m_j + l_j·s_j and x̂_{d−n+j} = μ, in the same bytes and metadata
as 2 bits everywhere. A score is q·k̂ = Σ_c (q_π(c)·scale_c)·code_c + Σ_c q_c·min_c, with π = `paired_channels(d, n)`:
slot c holds the code of channel π(c).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from .config import OscarConfig, codes_per_byte

WIDE_BITS = 4  # the history bits of a wide head, and of a wide key channel
GRANULARITIES = ("token", "channel")


# --------------------------------------------------------------------------------------------- per-head layouts
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


def paired_channels(d: int, n: int, device=None) -> torch.Tensor:
    """π `[d]` int64 with n wide key channels: slot c holds the code of channel π(c) — c itself, except the last n
    slots, which hold the low planes of channels 0..n−1."""
    slots = torch.arange(d, device=device)
    return torch.where(slots >= d - n, slots - (d - n), slots)


def wide_channel_permutation(widths: torch.Tensor) -> tuple[int, torch.Tensor]:
    """`(n, P [d, d] float64)` from per-channel key widths `[d]` in {0, 2, WIDE_BITS}: n 4-bit channels each paired
    with a 0-bit one (unpaired 0-bit channels, when fewer 4-bit ones were given, are stored at 2 bits: the bytes are
    there), and the permutation whose columns order the channels [4-bit | 2-bit | 0-bit], each group in channel order,
    so that k·P stores them as this format expects."""
    four = (widths == WIDE_BITS).nonzero().flatten()
    zero = (widths == 0).nonzero().flatten()
    n = min(len(four), len(zero))
    four, zero = four[:n], zero[len(zero) - n :]
    paired = set(four.tolist()) | set(zero.tolist())
    middle = [c for c in range(widths.shape[0]) if c not in paired]
    order = four.tolist() + middle + zero.tolist()
    perm = torch.zeros(widths.shape[0], widths.shape[0], dtype=torch.float64)
    perm[order, torch.arange(widths.shape[0])] = 1.0
    return n, perm


def check_head_layout(heads: int, head_dim: int, chunk: int, key_blocks=None, head_bits=None,
                      wide_channels=None) -> None:
    """Validates one layer's per-head refinements (any may be None): `heads` entries each; key blocks dividing
    `chunk`; head bits 2 or WIDE_BITS; wide key channel counts in [0, head_dim/2] and 0 for the wide heads.
    Raises `ValueError` naming what is wrong."""
    if key_blocks is not None:
        blocks = [int(b) for b in key_blocks]
        if len(blocks) != heads or any(b < 1 or chunk % b for b in blocks):
            raise ValueError(f"key blocks {blocks}: expected {heads} blocks (one per KV head) that divide the "
                             f"demotion block of {chunk} tokens")
    if head_bits is not None:
        bits = [int(b) for b in head_bits]
        if len(bits) != heads or any(b not in (2, WIDE_BITS) for b in bits):
            raise ValueError(f"head bits {bits}: expected {heads} values (one per KV head), each 2 or {WIDE_BITS}")
    if wide_channels is not None:
        counts = [int(n) for n in wide_channels]
        wide = [int(b) == WIDE_BITS for b in head_bits] if head_bits is not None else [False] * heads
        if len(counts) != heads or any(not 0 <= n <= head_dim // 2 or (n and w) for n, w in zip(counts, wide)):
            raise ValueError(f"wide key channels {counts}: expected {heads} counts (one per KV head) in "
                             f"[0, {head_dim // 2}] (head_dim / 2), 0 for the wide heads")


# --------------------------------------------------------------------------------------------- the format
@dataclass(frozen=True)
class StreamFormat:
    """How one stream (the keys, or the values) of one layer's history is stored on this rank (module docstring).

    Attributes:
        heads: KV heads held here (H). head_dim: d.
        bits: code width (2, 3, 4, 8; 16: not quantized, stored dense).
        granularity: `"token"` or `"channel"` (16 bits: `"token"`).
        group_size: channels per token-wise (scale, minimum) pair.
        blocks: channel-wise: tokens per key block, per head; `()` otherwise.
        chunk: tokens that enter the history together: the demotion block (channel-wise), 1 (token-wise).
        wide_rows: per head, the codes row of its low plane (H + j) or −1; `()`: no wide head.
        wide_channels: per head, its wide key channels n; `()`: none.
        clip: clip ratio of token-wise rows (1.0: none).
        scale_dtype: dtype name of the scales and minima.
    """

    heads: int
    head_dim: int
    bits: int
    granularity: str = "token"
    group_size: int = 0
    blocks: tuple[int, ...] = ()
    chunk: int = 1
    wide_rows: tuple[int, ...] = ()
    wide_channels: tuple[int, ...] = ()
    clip: float = 1.0
    scale_dtype: str = "float16"

    def __post_init__(self):
        set_ = object.__setattr__
        set_(self, "group_size", int(self.group_size or self.head_dim))
        for name in ("blocks", "wide_rows", "wide_channels"):
            set_(self, name, tuple(int(x) for x in getattr(self, name)))
        if self.bits == 16:
            set_(self, "granularity", "token")
        if self.granularity not in GRANULARITIES:
            raise ValueError(f"stream granularity must be one of {GRANULARITIES}, got {self.granularity!r}")
        if self.head_dim % self.group_size:
            raise ValueError(f"group_size {self.group_size} does not divide head_dim {self.head_dim}")
        if self.channelwise:
            check_head_layout(self.heads, self.head_dim, self.chunk, key_blocks=self.blocks)
        elif self.blocks or self.chunk != 1:
            raise ValueError("key blocks and chunks are a layout of channel-wise streams")
        if self.wide_rows:
            if self.bits != 2:
                raise ValueError(f"wide heads are stored in a 2-bit history, not a {self.bits}-bit one")
            if self.wide_rows != wide_rows([WIDE_BITS if r >= 0 else 2 for r in self.wide_rows]) or \
                    len(self.wide_rows) != self.heads:
                raise ValueError(f"wide rows {list(self.wide_rows)} do not number the low planes of {self.heads} KV "
                                 "heads in order (H + j for the j-th wide head, -1 otherwise)")
        if any(self.wide_channels):
            if self.bits != 2 or not self.channelwise:
                raise ValueError(f"wide key channels need a 2-bit channel-wise history, not a {self.bits}-bit "
                                 f"{self.granularity}-wise one")
            bits = [WIDE_BITS if r >= 0 else 2 for r in self.wide_rows] if self.wide_rows else None
            check_head_layout(self.heads, self.head_dim, self.chunk, head_bits=bits, wide_channels=self.wide_channels)
        else:
            set_(self, "wide_channels", ())

    @property
    def channelwise(self) -> bool:
        return self.granularity == "channel"

    @property
    def dense(self) -> bool:
        return self.bits == 16

    @property
    def wide_heads(self) -> tuple[int, ...]:
        """The heads stored at WIDE_BITS."""
        return tuple(h for h, r in enumerate(self.wide_rows) if r >= 0)

    @property
    def code_rows(self) -> int:
        """H + U: the codes' head rows (the wide heads' low planes after the H heads)."""
        return self.heads + len(self.wide_heads)

    @property
    def row_bytes(self) -> int:
        """Bytes of one packed token row of one head."""
        return self.head_dim * self.bits // 8

    @property
    def groups(self) -> int:
        """Token-wise (scale, minimum) pairs per row."""
        return self.head_dim // self.group_size

    @property
    def offsets(self) -> tuple[int, ...]:
        """Channel-wise: the first metadata row of each head within a chunk."""
        out, row = [], 0
        for b in self.blocks:
            out.append(row)
            row += self.chunk // b
        return tuple(out)

    @property
    def rows_per_chunk(self) -> int:
        """Channel-wise: R, metadata rows per chunk, all heads together."""
        return sum(self.chunk // b for b in self.blocks)

    @property
    def meta_dtype(self) -> torch.dtype:
        from .config import DTYPES

        return DTYPES[self.scale_dtype]

    def bits_per_element(self) -> float:
        """Average stored bits per element: codes (wide heads at WIDE_BITS) plus the metadata."""
        if self.dense:
            return 16.0
        meta_bits = 32 if self.scale_dtype == "float32" else 16
        codes = (self.bits * self.heads + 2 * len(self.wide_heads)) / self.heads
        if self.channelwise:
            return codes + 2 * meta_bits * self.rows_per_chunk / (self.chunk * self.heads)
        return codes + 2 * meta_bits / self.group_size

    def select(self, first: int, count: int) -> "StreamFormat":
        """The format of heads [first, first + count) of this stream (head slicing)."""
        heads = range(first, first + count)
        bits = [WIDE_BITS if self.wide_rows and self.wide_rows[h] >= 0 else 2 for h in heads]
        return StreamFormat(count, self.head_dim, self.bits, self.granularity, self.group_size,
                            tuple(self.blocks[h] for h in heads) if self.blocks else (), self.chunk,
                            wide_rows(bits) if self.wide_rows else (),
                            tuple(self.wide_channels[h] for h in heads) if self.wide_channels else (),
                            self.clip, self.scale_dtype)


@dataclass(frozen=True)
class LayerFormat:
    """What one OSCAR layer stores on this rank: its two history streams, and which of the model's KV heads these
    are (tensor parallelism holds `heads` KV heads from `first_head` on)."""

    keys: StreamFormat
    values: StreamFormat
    first_head: int = 0

    def __post_init__(self):
        k, v = self.keys, self.values
        if (k.heads, k.head_dim, k.bits, k.wide_rows) != (v.heads, v.head_dim, v.bits, v.wide_rows):
            raise ValueError("the key and value streams of a layer must share heads, head_dim, bits and wide heads")
        if v.channelwise or v.wide_channels:
            raise ValueError("values are stored token-wise, without wide key channels")

    @property
    def heads(self) -> int:
        return self.keys.heads

    @property
    def head_dim(self) -> int:
        return self.keys.head_dim

    @property
    def bits(self) -> int:
        return self.keys.bits

    def bits_per_element(self) -> float:
        """History bits per element, keys and values averaged."""
        return (self.keys.bits_per_element() + self.values.bits_per_element()) / 2

    def kernel_problem(self) -> str | None:
        """Why the INT2 attention kernel cannot read this layout, or None (`kernel_layout_problem`)."""
        if self.bits != 2:
            return f"the INT2 attention kernel reads 2-bit histories, not {self.bits}-bit ones"
        k = self.keys
        return kernel_layout_problem(self.head_dim, self.values.groups, None if k.channelwise else k.groups, k.blocks,
                                     bool(k.wide_rows))


def kernel_layout_problem(head_dim: int, value_groups: int, key_groups: int | None, key_blocks=(),
                          wide: bool = False) -> str | None:
    """Why the INT2 attention kernel cannot read a 2-bit layout, or None. It applies one scale per quarter plane of
    the packed bytes (1, 2 or 4 token-wise groups per row; `key_groups` None: channel-wise keys), tiles keys by
    16..128 tokens (every channel-wise key block a power of two >= 16 or a multiple of 128), needs a power-of-two
    head_dim >= 64, and reads wide heads with channel-wise keys and one value group per row."""
    if wide and (key_groups is not None or value_groups != 1):
        return "the INT2 decode kernel reads wide heads with channel-wise keys and one value group per row only"
    if head_dim < 64 or head_dim & (head_dim - 1):
        return f"the INT2 decode kernel needs a power-of-two head_dim >= 64, got {head_dim}"
    for name, groups in (("value", value_groups), ("key", key_groups)):
        if groups is not None and groups not in (1, 2, 4):
            return (f"the INT2 decode kernel reads 1, 2 or 4 quantization groups per {name} row, not {groups} "
                    f"(group_size {head_dim // max(groups, 1)} at head_dim {head_dim})")
    for block in key_blocks:
        if block % 16 or (block & (block - 1) and block % 128):
            return (f"the INT2 decode kernel needs channel-wise key blocks that are powers of two >= 16 or "
                    f"multiples of 128, got {block}")
    return None


def layer_format(config: OscarConfig, heads: int, head_dim: int, key_clip: float = 1.0, value_clip: float = 1.0,
                 key_blocks=None, head_bits=None, wide_channels=None, first_head: int = 0) -> LayerFormat:
    """The `LayerFormat` of `config`'s layout for `heads` KV heads, with the per-head refinements given (None: none;
    key blocks default to key_block everywhere)."""
    config.check_head_dim(head_dim)
    rows = wide_rows(head_bits) if head_bits is not None else ()
    common = dict(heads=heads, head_dim=head_dim, bits=config.bits, group_size=config.group_size or head_dim,
                  wide_rows=rows, scale_dtype=config.scale_dtype)
    if config.key_granularity == "channel" and config.bits < 16:
        per_byte = codes_per_byte(config.bits)
        if key_blocks is not None and any(int(b) % per_byte for b in key_blocks):
            raise ValueError(f"key blocks {[int(b) for b in key_blocks]}: at {config.bits} bits each must be a multiple "
                             f"of {per_byte} tokens (channel-wise key codes are packed along the block)")
        keys = StreamFormat(granularity="channel", blocks=tuple(key_blocks or (config.key_block,) * heads),
                            chunk=config.demotion_block, wide_channels=tuple(wide_channels or ()), **common)
    else:
        keys = StreamFormat(clip=key_clip, **common)
    return LayerFormat(keys, StreamFormat(clip=value_clip, **common), first_head)


def resolve(config: OscarConfig, rotations, geometry, shards: dict[int, tuple[int, int]] | None = None,
            warn: bool = True) -> dict[int, LayerFormat]:
    """`{layer: LayerFormat}` for the full-attention layers of a model of `geometry`, storing `config`'s layout with
    the per-head refinements of `rotations` (an `OscarRotations`) that this layout can hold, for the KV heads each
    layer holds on this rank (`shards`: `{layer: (first head, count)}` under tensor parallelism).

    A file's key blocks were allocated for its own key_block and demotion_block: a config asking for others gets its
    key_block everywhere. Refinements the layout cannot hold (wide heads of a layout that is not 2-bit, channel-wise
    with one value group; wide key channels of one that is not 2-bit channel-wise) are not used, with a warning."""
    shards = shards or {}
    same_blocks = all(rotations.layout.get(k) == getattr(config, k) for k in ("key_block", "demotion_block"))
    unused = []
    if rotations.head_bits and any(b != 2 for bits in rotations.head_bits.values() for b in bits) \
            and not config.wide_layout:
        unused.append("4-bit wide heads")
    if rotations.key_wide_channels and any(n for c in rotations.key_wide_channels.values() for n in c) \
            and not config.wide_channel_layout:
        unused.append("wide key channels")
    if unused and warn:
        warnings.warn(f"the rotation file's {' and '.join(unused)} are not stored by this layout (bits={config.bits}, "
                      f"key_granularity={config.key_granularity!r}, group_size={config.group_size})",
                      RuntimeWarning, stacklevel=3)
    out = {}
    heads_total, d = geometry.num_key_value_heads, geometry.head_dim
    for layer in geometry.oscar_layers:
        first, count = shards.get(layer, (0, heads_total))

        def local(per_head, usable: bool = True):
            return None if per_head is None or not usable else tuple(per_head)[first : first + count]

        out[layer] = layer_format(
            config, count, d,
            key_clip=config.clip_ratio("key", rotations.key_clip(layer)),
            value_clip=config.clip_ratio("value", rotations.value_clip(layer)),
            key_blocks=local(rotations.key_block(layer), same_blocks),
            head_bits=local(rotations.head_bit(layer), config.wide_layout),
            wide_channels=local(rotations.key_wide_channel(layer), config.wide_channel_layout),
            first_head=first,
        )
    return out
