"""The Triton kernels as torch custom ops, with fake (meta) implementations so that `torch.compile` can trace them:
- `oscar::quantize_pack(x, rotation, clip_ratio, codes, meta, start, key_blocks, key_chunk, wide_rows)`: fused rotate -> clip ->
  quantize -> pack, token-wise (`key_chunk` 0, `key_blocks` empty) or channel-wise with KV head h over blocks of
  `key_blocks[h]` tokens in chunks of `key_chunk` (meta `[B, n_chunks, R, d, 2]`, `oscar_hf.format.StreamFormat`),
  mutating `codes`/`meta` (prefill into the history, and the decode-time demotion of recent-window tokens);
- `oscar::quantize_pack_at(x, clip_ratio, codes, meta, start, key_blocks, key_chunk, ring, wide_rows)`: the same without the
  rotation, the first row `start` read on the device (int64 tensor; negative: nothing written), channel-wise rows
  optionally read in place from a ring of `ring` slots: a static cache's decode step;
- `oscar::segment_attention(q, ...)`: split-K attention over [BF16 sink | packed INT2 history | BF16 recent | extra],
  merged by log-sum-exp; keys token-wise or channel-wise (`key_blocks`, `key_chunk` as above). Returns `(out, lse)`.
- `oscar::decode_attention(q, ..., lengths, ...)`: the same kernel over a static cache's fixed buffers, lengths read
  on the device, fixed grid: what a CUDA graph of the decode step replays; the output un-rotated by R_Vᵀ when
  `value_rotation` is given (in the merge). Returns `out`.
- `oscar::rotate_store_token(keys, values, key_rotation, value_rotation, sink_k, sink_v, ring_k, ring_v, position,
  sink_tokens, ring)`: a static cache's decode-step store (one token rotated into its sink or ring slot, the
  position read on the device). Returns the rotated `[2, B, H, 1, d]`.
Every op takes `wide_rows` (`oscar_hf.quant.wide_rows`: wide heads at 4 bits, their low planes in the codes' rows after
the H KV heads; empty: none) and, but `rotate_store_token`, `wide_channels` (channel-wise keys: each KV head's wide key
channels, `oscar_hf.quant.quantize_wide_channels`; empty: none).
Their pure-torch twins with the same signatures are `oscar_hf.ops.quantize_pack_reference`,
`oscar_hf.ops.quantize_pack_at_reference`,
`oscar_hf.ops.segment_attention_reference`, `oscar_hf.ops.decode_attention_reference` and
`oscar_hf.ops.rotate_store_token_reference`; `oscar_hf.ops` picks.
"""

from __future__ import annotations

from typing import Optional

import torch

from .attention import decode_attention_triton, segment_attention_triton
from .quantize import quantize_pack_triton
from .store import rotate_store_token_triton

__all__ = ["EAGER", "decode_attention", "quantize_pack", "quantize_pack_at", "rotate_store_token", "segment_attention"]


@torch.library.custom_op("oscar::quantize_pack", mutates_args=("codes", "meta"))
def quantize_pack(
    x: torch.Tensor, rotation: Optional[torch.Tensor], clip_ratio: float, codes: torch.Tensor, meta: torch.Tensor,
    start: int, key_blocks: list[int], key_chunk: int, wide_rows: list[int], wide_channels: list[int],
) -> None:
    quantize_pack_triton(x, rotation, clip_ratio, codes, meta, start, key_blocks, key_chunk, wide_rows=wide_rows,
                         wide_channels=wide_channels)


@quantize_pack.register_fake
def _(x, rotation, clip_ratio, codes, meta, start, key_blocks, key_chunk, wide_rows, wide_channels) -> None:
    return None


def _quantize_pack_at(
    x: torch.Tensor, clip_ratio: float, codes: torch.Tensor, meta: torch.Tensor, start: torch.Tensor,
    key_blocks: list[int], key_chunk: int, ring: int, wide_rows: list[int], wide_channels: list[int],
) -> None:
    quantize_pack_triton(x, None, clip_ratio, codes, meta, start, key_blocks, key_chunk, ring=ring, wide_rows=wide_rows,
                         wide_channels=wide_channels)


quantize_pack_at = torch.library.custom_op("oscar::quantize_pack_at", _quantize_pack_at, mutates_args=("codes", "meta"))


@quantize_pack_at.register_fake
def _(x, clip_ratio, codes, meta, start, key_blocks, key_chunk, ring, wide_rows, wide_channels) -> None:
    return None


@torch.library.custom_op("oscar::segment_attention", mutates_args=())
def segment_attention(
    q: torch.Tensor,
    sink_k: torch.Tensor, sink_v: torch.Tensor,
    hist_codes_k: torch.Tensor, hist_meta_k: torch.Tensor, hist_codes_v: torch.Tensor, hist_meta_v: torch.Tensor,
    recent_k: torch.Tensor, recent_v: torch.Tensor,
    extra_k: torch.Tensor, extra_v: torch.Tensor,
    key_mask: Optional[torch.Tensor],
    n_sink: int, n_hist: int, n_recent: int, n_extra: int,
    queries_per_group: int, query_start: int, scale: float, key_blocks: list[int], key_chunk: int, wide_rows: list[int],
    wide_channels: list[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    return segment_attention_triton(
        q, sink_k, sink_v, hist_codes_k, hist_meta_k, hist_codes_v, hist_meta_v, recent_k, recent_v, extra_k, extra_v,
        key_mask, n_sink, n_hist, n_recent, n_extra, queries_per_group, query_start, scale, key_blocks, key_chunk,
        wide_rows, wide_channels=wide_channels,
    )


@segment_attention.register_fake
def _(q, sink_k, sink_v, hist_codes_k, hist_meta_k, hist_codes_v, hist_meta_v, recent_k, recent_v, extra_k, extra_v,
      key_mask, n_sink, n_hist, n_recent, n_extra, queries_per_group, query_start, scale, key_blocks, key_chunk,
      wide_rows, wide_channels):
    # contiguous, as the kernel writes them (empty_like would copy a permuted q's strides)
    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=torch.float32)


def _decode_attention(
    q: torch.Tensor,
    sink_k: torch.Tensor, sink_v: torch.Tensor,
    hist_codes_k: torch.Tensor, hist_meta_k: torch.Tensor, hist_codes_v: torch.Tensor, hist_meta_v: torch.Tensor,
    ring_k: torch.Tensor, ring_v: torch.Tensor,
    key_mask: Optional[torch.Tensor], lengths: torch.Tensor,
    queries_per_group: int, scale: float, key_blocks: list[int], key_chunk: int, wide_rows: list[int],
    wide_channels: list[int], value_rotation: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    return decode_attention_triton(q, sink_k, sink_v, hist_codes_k, hist_meta_k, hist_codes_v, hist_meta_v, ring_k,
                                   ring_v, key_mask, lengths, queries_per_group, scale, key_blocks, key_chunk,
                                   value_rotation=value_rotation, wide_rows=wide_rows, wide_channels=wide_channels)


decode_attention = torch.library.custom_op("oscar::decode_attention", _decode_attention, mutates_args=())


@decode_attention.register_fake
def _(q, sink_k, sink_v, hist_codes_k, hist_meta_k, hist_codes_v, hist_meta_v, ring_k, ring_v, key_mask, lengths,
      queries_per_group, scale, key_blocks, key_chunk, wide_rows, wide_channels, value_rotation=None):
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)


@torch.library.custom_op("oscar::rotate_store_token", mutates_args=("sink_k", "sink_v", "ring_k", "ring_v"))
def rotate_store_token(
    keys: torch.Tensor, values: torch.Tensor, key_rotation: torch.Tensor, value_rotation: torch.Tensor,
    sink_k: torch.Tensor, sink_v: torch.Tensor, ring_k: torch.Tensor, ring_v: torch.Tensor, position: torch.Tensor,
    sink_tokens: int, ring: int,
) -> torch.Tensor:
    return rotate_store_token_triton(keys, values, key_rotation, value_rotation, sink_k, sink_v, ring_k, ring_v,
                                     position, sink_tokens, ring)


@rotate_store_token.register_fake
def _(keys, values, key_rotation, value_rotation, sink_k, sink_v, ring_k, ring_v, position, sink_tokens, ring):
    return keys.new_empty((2, *keys.shape))


# The same launchers without the dispatcher, same signatures, for calls outside a compiled region (`oscar_hf.ops`
# picks): in an eager decode step on the H200 the custom-op wrappers (autograd and ADInplaceOrView redispatch,
# version bumps, the aliasing check) cost more host time than the Triton launches they wrap (0.3-0.65 ms per call
# under cProfile, eval/results/gpu/profile_oscar-*eager_before.txt); dynamo needs the ops and their fakes, eager
# code does not.
EAGER = {
    "quantize_pack": quantize_pack_triton,
    "quantize_pack_at": _quantize_pack_at,
    "segment_attention": segment_attention_triton,
    "decode_attention": _decode_attention,
    "rotate_store_token": rotate_store_token_triton,
}
