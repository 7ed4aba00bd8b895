"""The registered "oscar" attention: q·R_K against [sink | history | recent | current chunk], output ·R_Vᵀ.

`import oscar_hf` registers it with transformers' `AttentionInterface` (and the standard sdpa mask with
`AttentionMaskInterface`), so `attn_implementation="oscar"` works at load time or via `model.set_attn_implementation`.
For layers that are not OSCAR layers (sliding-window layers, or a model run without an OscarCache) it is plain sdpa.

Math, per KV head h with GQA group g (query heads h·g .. h·g+g-1):
    q̃ = q·R_K[h];  scores = q̃·[K̃_sink | K̂_hist | K̃_recent | K̃_chunk]ᵀ · scale;  õ = softmax(scores)·Ṽ;  o = õ·R_V[h]ᵀ
computed by `ops.segment_attention`: the split-K Triton kernel that reads packed INT2 directly and merges the segments
by log-sum-exp on CUDA, its torch twin elsewhere. A first prefill (empty cache) attends only to itself in full
precision and is plain sdpa on the un-rotated states.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from . import ops
from .cache import ATTENTION_NAME, LayerView, claim_layer, rotate
from .quant import QuantizedKeyChunks, QuantizedRows, dequantize
from .static_cache import DecodeView

QUERY_BLOCK = 4096  # query tokens per kernel call for long chunks


def key_padding_mask(attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """`[B, 1, T, N]` causal+padding mask (bool, or additive float) -> `[B, N]` bool: the keys a row may see at all.

    The last query row sees every earlier position, so its row is exactly the padding mask; causality comes from
    positions inside `ops.segment_attention`.
    """
    if attention_mask is None:
        return None
    row = attention_mask[:, 0, -1, :]
    if row.dtype != torch.bool:
        row = row > torch.finfo(row.dtype).min / 2
    return row


def oscar_segment_attention(
    module, view: LayerView, query: torch.Tensor, attention_mask: torch.Tensor | None, scale: float, **kwargs
) -> torch.Tensor:
    """Attention of (un-rotated) `query` `[B, Hq, T, d]` over one layer's cache; returns `[B, T, Hq, d]`."""
    if view.past_length == 0:
        if attention_mask is not None and attention_mask.shape[-1] > query.shape[2]:
            attention_mask = attention_mask[..., : query.shape[2]]  # a static cache's mask spans max_cache_len keys
        out, _ = sdpa_attention_forward(
            module, query, view.original_keys, view.original_values, attention_mask, scaling=scale, **kwargs
        )
        return out
    b, hq, t, d = query.shape
    heads = view.key_rotation.shape[0]
    groups = hq // heads
    q_rot = rotate(query.reshape(b, heads, groups * t, d), view.key_rotation)  # row g·T + t (a view of query)
    sink_k, sink_v = view.sink_keys, view.sink_values
    hist_k, hist_v = view.history_keys, view.history_values
    key_layout = ((list(hist_k.layout.blocks), hist_k.layout.chunk) if isinstance(hist_k, QuantizedKeyChunks)
                  else ([], 0))
    wide, wide_channels = [], []
    if not isinstance(hist_k, torch.Tensor) and hist_k.bits == 2:
        codes_k, meta_k, codes_v, meta_v = hist_k.codes, hist_k.meta, hist_v.codes, hist_v.meta
        wide = list(hist_k.wide_rows)
        wide_channels = list(getattr(hist_k, "wide_channels", ()))
    else:
        # Other widths: the history joins the sink as one dense segment (positions stay contiguous).
        if query.is_cuda and not isinstance(hist_k, torch.Tensor):
            ops.warn_slow_path(f"{hist_k.bits}-bit histories are dequantized every step (the decode kernel reads 2 bits)")
        sink_k = torch.cat([sink_k, dequantize(hist_k, sink_k.dtype)], dim=2)
        sink_v = torch.cat([sink_v, dequantize(hist_v, sink_v.dtype)], dim=2)
        codes_k = codes_v = sink_k.new_empty(b, heads, 0, d // 4, dtype=torch.uint8)
        meta_k = meta_v = sink_k.new_empty(b, heads, 0, 1, 2, dtype=torch.float16)
        key_layout = ([], 0)
    key_mask = key_padding_mask(attention_mask)
    extra_k, extra_v = view.extra_keys, view.extra_values
    q_rot = q_rot.reshape(b, heads, groups, t, d)
    outs = []
    # A long chunk is processed in blocks of queries, which bounds the kernel's partial-result buffers.
    for t0 in range(0, t, QUERY_BLOCK):
        t1 = min(t0 + QUERY_BLOCK, t)
        n_extra = min(extra_k.shape[2], t1)  # the chunk's own keys a query of this block can see
        block, _ = ops.segment_attention(
            q_rot[:, :, :, t0:t1].reshape(b, heads, groups * (t1 - t0), d), sink_k, sink_v, codes_k, meta_k, codes_v,
            meta_v, view.recent_keys, view.recent_values, extra_k, extra_v, key_mask,
            sink_k.shape[2], codes_k.shape[2], view.recent_keys.shape[2], n_extra, t1 - t0, view.past_length + t0, scale,
            *key_layout, wide, wide_channels,
        )
        outs.append(block.reshape(b, heads, groups, t1 - t0, d))
    out_rot = outs[0] if len(outs) == 1 else torch.cat(outs, dim=3)
    out = rotate(out_rot.reshape(b, heads, groups * t, d), view.value_rotation.transpose(-1, -2)).reshape(b, hq, t, d)
    return out.transpose(1, 2).contiguous()


def oscar_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """`AttentionInterface` entry point. Returns `([B, T, Hq, d], None)` like transformers' sdpa."""
    layer = claim_layer(module, kwargs, query)
    if layer is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    if kwargs.get("softcap") is not None:
        raise ValueError("the OSCAR attention does not support attention-logit soft-capping")
    if kwargs.get("sliding_window") is not None:
        raise ValueError("an OSCAR layer received a sliding-window attention call; this layer should not be OSCAR")
    view = layer.take_view()
    if query.shape[2] != view.chunk_length or query.shape[0] != view.batch:
        raise RuntimeError(
            f"the 'oscar' attention of layer {getattr(module, 'layer_idx', '?')} got {query.shape[0]}×{query.shape[2]} "
            f"query tokens but its cache update stored {view.batch}×{view.chunk_length}: the cache and the "
            "attention call do not belong together"
        )
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if isinstance(view, DecodeView):
        return oscar_decode_attention(view.layer, query, attention_mask, scale), None
    return oscar_segment_attention(module, view, query, attention_mask, scale, dropout=dropout), None


def oscar_decode_attention(layer, query: torch.Tensor, attention_mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """A decode step on a static layer (`static_cache.py`): one op over its fixed buffers with the lengths on the
    device, capturable in a CUDA graph; the output is un-rotated inside it (by R_Vᵀ, in the kernel's merge).
    `query` `[B, Hq, T, d]` -> `[B, T, Hq, d]`."""
    b, hq, t, d = query.shape
    heads = layer.key_rotation.shape[0]
    s, r = layer.config.sink_tokens, layer.plan.ring
    keys, values = layer.history_keys, layer.history_values

    def attend(query, mask=None):
        q_rot = rotate(query.reshape(b, heads, hq // heads * t, d), layer.key_rotation)
        return ops.decode_attention(
            q_rot, layer.sink_keys[:, :, :s], layer.sink_values[:, :, :s], keys.buffers["codes"], keys.buffers["meta"],
            values.buffers["codes"], values.buffers["meta"], layer.ring_keys[:, :, :r], layer.ring_values[:, :, :r],
            mask, layer.plan.lengths, t, scale, *keys.kernel_key_layout,
            value_rotation=layer.value_rotation, wide_rows=keys.wide, wide_channels=keys.wide_channels,
            kernel=layer.kernel,
        )

    mask = key_padding_mask(attention_mask)
    out = layer.decode_call("attend", attend, query, *(() if mask is None else (mask,)), static=(scale,))
    return out.reshape(b, hq, t, d).transpose(1, 2).contiguous()


def register() -> None:
    """Registers "oscar" with transformers' attention and mask interfaces (idempotent)."""
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION_NAME, oscar_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
