"""The registered "oscar" attention: q·R_K against [sink | history | recent | current chunk], output ·R_Vᵀ.

`import oscar_hf` registers it with transformers' `AttentionInterface` (and the standard sdpa mask with
`AttentionMaskInterface`), so `attn_implementation="oscar"` works at load time or via `model.set_attn_implementation`.
For layers that are not OSCAR layers (sliding-window layers, or a model run without an OscarCache) it is plain sdpa.

Math, per KV head h with GQA group g (query heads h·g .. h·g+g-1):
    q̃ = q·R_K[h];  scores = q̃·[K̃_sink | K̂_hist | K̃_recent | K̃_chunk]ᵀ · scale;  õ = softmax(scores)·Ṽ;  o = õ·R_V[h]ᵀ
Decode steps (few queries) compute one partial (output, log-sum-exp) per segment and merge them by log-sum-exp — the
torch twin of the split-K kernel. Longer chunks (prefill) dequantize the history and run one sdpa call.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from .cache import ATTENTION_NAME, LayerView, claim_layer, rotate
from .quant import QuantizedRows, dequantize_rows

# Queries per forward pass up to which the segment-wise (decode) path is used.
DECODE_MAX_QUERIES = 16


def merge_attention_states(outputs: list[torch.Tensor], lses: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Merges partial attention results over disjoint key sets.

    Args:
        outputs: each `[..., T, d]` float32, softmax-normalised within its own key set.
        lses: each `[..., T]` float32 log-sum-exp of its scores (-inf where the key set is empty or fully masked).

    Returns:
        `(output, lse)` of attention over the union; rows with no visible key get output 0 and lse -inf.
    """
    lse = torch.stack(lses)  # [S, ..., T]
    top = lse.amax(0)
    safe_top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    weights = torch.exp(lse - safe_top)  # exp(-inf) = 0 for empty partials
    total = weights.sum(0)
    out = sum(w.unsqueeze(-1) * o for w, o in zip(weights, outputs))
    out = out / total.clamp(min=torch.finfo(total.dtype).tiny).unsqueeze(-1)
    return out, safe_top + torch.log(total)


def partial_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of grouped queries over one key segment, with its log-sum-exp.

    Args:
        query: `[B, H, g·T, d]` (query heads grouped under their KV head).
        keys, values: `[B, H, n, d]`.
        mask: bool `[B, 1 or H, g·T, n]` (True = attend) or None.

    Returns:
        output `[B, H, g·T, d]` float32 and lse `[B, H, g·T]` float32.
    """
    scores = torch.matmul(query.float(), keys.float().transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)).unsqueeze(-1))
    return torch.matmul(probs, values.float()), lse


def _dense(rows: QuantizedRows | torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return rows.to(dtype) if isinstance(rows, torch.Tensor) else dequantize_rows(rows, dtype)


def _grouped(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """`[B, Hq, T, d]` -> `[B, H, g·T, d]` (the g query heads of each KV head stacked)."""
    b, hq, t, d = x.shape
    return x.reshape(b, kv_heads, (hq // kv_heads) * t, d)


def _grouped_mask(mask: torch.Tensor | None, kv_heads: int, groups: int) -> torch.Tensor | None:
    """`[B, 1, T, n]` bool -> `[B, 1, g·T, n]` matching `_grouped` queries."""
    if mask is None:
        return None
    b, h, t, n = mask.shape
    if h != 1:
        raise ValueError("the OSCAR attention expects a head-independent mask [B, 1, T, kv]")
    return mask.unsqueeze(2).expand(b, 1, groups, t, n).reshape(b, 1, groups * t, n)


def _segment_mask(mask, start, end, groups, kv_heads):
    return None if mask is None else _grouped_mask(mask[..., start:end], kv_heads, groups)


def oscar_segment_attention(
    view: LayerView, query: torch.Tensor, attention_mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """Attention of (un-rotated) `query` `[B, Hq, T, d]` over one layer's segments; returns `[B, Hq, T, d]`.

    `attention_mask`: bool `[B, 1, T, past_length + T]` (True = attend) as built by transformers' sdpa mask, or
    None for a causal pass with no padding.
    """
    b, hq, t, d = query.shape
    kv_heads = view.key_rotation.shape[0]
    groups = hq // kv_heads
    dtype = query.dtype
    q_rot = rotate(query.reshape(b, kv_heads, groups, t, d), view.key_rotation.unsqueeze(1)).reshape(b, hq, t, d)
    if attention_mask is not None and attention_mask.dtype != torch.bool:
        attention_mask = attention_mask > torch.finfo(attention_mask.dtype).min / 2  # additive float mask
    past = view.past_length
    if attention_mask is None and t > 1:
        causal = torch.ones(t, t, dtype=torch.bool, device=query.device).tril()
        attention_mask = torch.cat([torch.ones(t, past, dtype=torch.bool, device=query.device), causal], dim=1)
        attention_mask = attention_mask.expand(b, 1, t, past + t)

    if t <= DECODE_MAX_QUERIES:
        q = _grouped(q_rot, kv_heads)
        ns, nh = view.sink_keys.shape[2], view.history_length
        segments = [
            (view.sink_keys, view.sink_values, 0),
            (_dense(view.history_keys, dtype), _dense(view.history_values, dtype), ns),
            (view.recent_keys, view.recent_values, ns + nh),
            (view.chunk_keys, view.chunk_values, past),
        ]
        outs, lses = [], []
        for keys, values, start in segments:
            n = keys.shape[2]
            if n == 0:
                continue
            o, lse = partial_attention(q, keys, values, scale, _segment_mask(attention_mask, start, start + n, groups, kv_heads))
            outs.append(o)
            lses.append(lse)
        out, _ = merge_attention_states(outs, lses)
        out_rot = out.reshape(b, hq, t, d).to(dtype)
    else:
        keys = torch.cat([view.sink_keys, _dense(view.history_keys, dtype), view.recent_keys, view.chunk_keys], dim=2)
        values = torch.cat(
            [view.sink_values, _dense(view.history_values, dtype), view.recent_values, view.chunk_values], dim=2
        )
        keys = keys.repeat_interleave(groups, dim=1) if groups > 1 else keys
        values = values.repeat_interleave(groups, dim=1) if groups > 1 else values
        out_rot = torch.nn.functional.scaled_dot_product_attention(q_rot, keys, values, attn_mask=attention_mask, scale=scale)
        # Rows with no visible key (left padding) come out NaN from sdpa; they are ignored downstream, zero them.
        out_rot = torch.nan_to_num(out_rot, nan=0.0)
    vt = view.value_rotation.transpose(-1, -2).unsqueeze(1)
    return rotate(out_rot.reshape(b, kv_heads, groups, t, d), vt).reshape(b, hq, t, d)


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
    layer = claim_layer(key)
    if layer is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    if kwargs.get("softcap") is not None:
        raise ValueError("the OSCAR attention does not support attention-logit soft-capping")
    if kwargs.get("sliding_window") is not None:
        raise ValueError("an OSCAR layer received a sliding-window attention call; this layer should not be OSCAR")
    view = layer.take_view()
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = oscar_segment_attention(view, query, attention_mask, scale)
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Registers "oscar" with transformers' attention and mask interfaces (idempotent)."""
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION_NAME, oscar_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
