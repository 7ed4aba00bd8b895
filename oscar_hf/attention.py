"""The registered "oscar" attention: q·R_K against [sink | history | recent | current chunk], output ·R_Vᵀ.

`import oscar_hf` registers it with transformers' `AttentionInterface` (and the standard sdpa mask with
`AttentionMaskInterface`), so `attn_implementation="oscar"` works at load time or via `model.set_attn_implementation`.
A call whose kwargs carry no OSCAR view (sliding-window layers, a model run without an OSCAR cache) is plain sdpa.

Math, per KV head h with GQA group g (query heads h·g .. h·g+g-1):
    q̃ = q·R_K[h];  scores = q̃·[K̃_sink | K̂_hist | K̃_recent | K̃_chunk]ᵀ · scale;  õ = softmax(scores)·Ṽ;  o = õ·R_V[h]ᵀ
computed by `ops.segment_attention` (multi-token passes) or `ops.decode_attention` (single-token steps, over the
layer's whole buffers with the lengths on the device): split-K Triton kernels that read packed INT2 directly and
merge the segments by log-sum-exp on CUDA, their torch twins elsewhere. A first prefill (empty cache) attends only to
itself in full precision and is plain sdpa on the un-rotated states.
"""

from __future__ import annotations

import weakref

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from . import ops
from .cache import ATTENTION_NAME, VIEW_KWARG, ChunkView, DecodeView
from .rotation import rotate

QUERY_BLOCK = 4096  # query tokens per kernel call for long chunks


# The last multi-row mask found causal + padding, as (weak reference, version counter, query start): every layer of a
# forward pass is handed the same mask, which is then checked once. The version counter moves when it is written.
_CHECKED_MASK: list = [None]


def key_padding_mask(attention_mask: torch.Tensor | None, query_start: int = 0) -> torch.Tensor | None:
    """`[B, 1, T, N]` causal + padding mask (bool, or additive float) -> `[B, N]` bool: the keys a row may see at all.

    The last query row sees every earlier position, so its row is the padding mask; causality comes from positions
    inside the ops (query row i at position `query_start` + i). A mask of several rows that is not causal + padding
    (bidirectional, custom) is refused: it would silently become a padding mask (checked in eager code; compiled code
    cannot branch on it)."""
    if attention_mask is None:
        return None
    if attention_mask.dim() != 4:
        raise ValueError(f"the 'oscar' attention takes a 4D attention mask, got {attention_mask.dim()}D")
    allowed = attention_mask if attention_mask.dtype == torch.bool else \
        attention_mask > torch.finfo(attention_mask.dtype).min / 2
    row = allowed[:, 0, -1, :]
    t, n = allowed.shape[2], allowed.shape[3]
    checked = _CHECKED_MASK[0]
    if t > 1 and not torch.compiler.is_compiling() and not (checked is not None and checked[0]() is attention_mask
                      and checked[1:] == (attention_mask._version, query_start)):
        own = query_start + torch.arange(t, device=allowed.device)
        expected = row[:, None, :] & (torch.arange(n, device=allowed.device)[None, None, :] <= own[None, :, None])
        if not torch.equal(allowed[:, 0], expected):
            raise ValueError("the 'oscar' attention reads causal + padding masks only, and this attention mask is not "
                             "one (bidirectional or custom): use attn_implementation='sdpa' for it")
        _CHECKED_MASK[0] = (weakref.ref(attention_mask), attention_mask._version, query_start)
    return row


def segment_attention(view: ChunkView, query: torch.Tensor, attention_mask, scale: float, module, **kwargs):
    """Attention of (un-rotated) `query` `[B, Hq, T, d]` over one layer's stored past and the chunk; `[B, T, Hq, d]`."""
    if view.past_length == 0:
        if attention_mask is not None and attention_mask.shape[-1] > query.shape[2]:
            attention_mask = attention_mask[..., : query.shape[2]]  # a static cache's mask spans max_cache_len keys
        out, _ = sdpa_attention_forward(module, query, view.original_keys, view.original_values, attention_mask,
                                        scaling=scale, **kwargs)
        return out
    layer, seg = view.layer, view.segments
    b, hq, t, d = query.shape
    heads = layer.fmt.heads
    q_rot = rotate(query.reshape(b, heads, hq // heads * t, d), layer.key_rotation).reshape(b, heads, hq // heads, t, d)
    key_mask = key_padding_mask(attention_mask, view.past_length)
    extra_k, extra_v = seg.extra_keys, seg.extra_values
    outs = []
    # A long chunk is processed in blocks of queries, which bounds the kernel's partial-result buffers.
    for t0 in range(0, t, QUERY_BLOCK):
        t1 = min(t0 + QUERY_BLOCK, t)
        seg.extra_keys, seg.extra_values = extra_k[:, :, :t1], extra_v[:, :, :t1]  # what this block can see
        block, _ = ops.segment_attention(q_rot[:, :, :, t0:t1].reshape(b, heads, -1, d), seg, layer.fmt, key_mask,
                                         t1 - t0, view.past_length + t0, scale)
        outs.append(block.reshape(b, heads, hq // heads, t1 - t0, d))
    out_rot = outs[0] if len(outs) == 1 else torch.cat(outs, dim=3)
    out = rotate(out_rot.reshape(b, heads, hq // heads * t, d), layer.value_rotation.transpose(-1, -2))
    return out.reshape(b, hq, t, d).transpose(1, 2).contiguous()


def decode_attention(view: DecodeView, query: torch.Tensor, attention_mask, scale: float) -> torch.Tensor:
    """A single-token step: one op over the layer's buffers with the lengths on the device, capturable in a CUDA
    graph; the output is un-rotated inside it (by R_Vᵀ). `query` `[B, Hq, 1, d]` -> `[B, 1, Hq, d]`."""
    layer = view.layer
    b, hq, t, d = query.shape
    heads = layer.fmt.heads

    def attend(query, mask=None):
        q_rot = rotate(query.reshape(b, heads, hq // heads * t, d), layer.key_rotation)
        return ops.decode_attention(q_rot, layer.decode_buffers(), layer.fmt, mask, layer.plan.lengths, t, scale,
                                    value_rotation=layer.value_rotation, kernel=layer.kernel)

    def store_and_attend(query, keys, values, mask=None):
        layer._store_token(keys, values)
        return attend(query, mask)

    graphed = layer.uses_graphs(query)
    if attention_mask is None:
        mask = ()
    elif graphed:  # in a buffer the graphs read in place, copied once per pass, not once per layer
        mask = (layer.graphs.key_mask(attention_mask, lambda: key_padding_mask(attention_mask)),)
    else:
        mask = (key_padding_mask(attention_mask),)
    if view.pending is None:
        out = layer._decode_call("attend", attend, query, static=(scale,), resident=mask, graphed=graphed)
    else:  # the update left the token to this call: one graph stores it and attends
        out = layer._decode_call("step", store_and_attend, query, *view.pending, static=(scale,), resident=mask,
                                 graphed=graphed)
        view.pending = None
    return out.reshape(b, hq, t, d).transpose(1, 2).contiguous()


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
    view = kwargs.pop(VIEW_KWARG, None)
    if view is None:
        packed = kwargs.get("cu_seq_lens_q")
        if attention_mask is None and packed is not None and packed.shape[0] > 2:
            # sdpa has no notion of packed sequences: without a mask it would attend across them (continuous
            # batching's paged cache, reached past transformers' attention-name check, calls it so)
            raise ValueError("the 'oscar' attention got several packed sequences (cu_seq_lens_q) without an attention "
                             "mask, which sdpa would attend across: continuous batching (generate_batch, transformers "
                             "serve) is not supported by oscar-hf yet")
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    if kwargs.get("softcap") is not None:
        raise ValueError("the OSCAR attention does not support attention-logit soft-capping")
    if kwargs.get("sliding_window") is not None:
        raise ValueError("an OSCAR layer received a sliding-window attention call; this layer should not be OSCAR")
    if query.shape[2] != view.chunk_length or query.shape[0] != view.batch:
        raise RuntimeError(
            f"the 'oscar' attention of layer {getattr(module, 'layer_idx', '?')} got {query.shape[0]}×{query.shape[2]} "
            f"query tokens but its cache update stored {view.batch}×{view.chunk_length}: the cache and the "
            "attention call do not belong together"
        )
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if isinstance(view, DecodeView):
        return decode_attention(view, query, attention_mask, scale), None
    return segment_attention(view, query, attention_mask, scale, module, dropout=dropout), None


def register() -> None:
    """Registers "oscar" with transformers' attention and mask interfaces (idempotent)."""
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION_NAME, oscar_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
