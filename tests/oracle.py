"""An independent model of what an OSCAR cache holds, written from the storage format's description alone
(docs/storage-format.md, the docstrings of oscar_hf/format.py and oscar_hf/quant.py). It shares no code with the
cache: its quantizer is written here in plain torch (nothing of `oscar_hf.quant`, `oscar_hf.storage`,
`oscar_hf.positions` or `oscar_hf.ops` is imported), it keeps every token of the sequence in full, and it never reads
the cache's formats, buffers, plans or kernels. tests/test_oracle.py and tests/test_cache_state_machine.py compare the
caches with it.

The specification, with sink S, window W, demotion block b and ring R = W + 2b:

- After n tokens the history holds the positions [S, S + h(n)), h(n) = max(0, floor((n − S − W) / b))·b; every
  other position is read from the BF16 sink and window, rotated (k·R_K, v·R_V), exactly. With key means, every key
  is k − μ (subtracted in float32) before anything else.
- Values (and token-wise keys) are quantized token-wise when they arrive, and read from that row once the history
  covers them. Channel-wise keys are quantized when their demotion block enters the history, from what the window
  holds then.
- A forward pass sees its own tokens exactly and earlier tokens as stored after the pass's demotions.
- A crop from n to m tokens makes the history [S, S + h(m)). A position that returns to the window is exact unless a
  position R or more away from it (the same ring slot) was stored after it; then it comes back as the history stores
  it, and counts as stored again.
- A reset forgets everything; a beam reorder (or a batch repeat or selection) applies to every sequence's state.

The quantizer: asymmetric, a (scale, minimum) per group, s = (max − min)/(2^b − 1) and m = min, both rounded to
float16 before the codes c = clamp(round_half_even((x − m)/s), 0, 2^b − 1) are computed; x̂ = c·s + m.
- Token-wise rows (values; the paper's keys) are first clamped to ±τ, τ = sort(|x|)[floor(r·d)] (no clip when
  floor(r·d) = d, nor in a wide head), then quantized per group of `group_size` channels.
- Channel-wise keys: per channel over each block of `key_blocks[h]` tokens of head h.
- A wide (4-bit) head: 4-bit codes whose scale s is bounded by a quarter of the float16 range (the stored scale is
  4·s); c = 4·h + l is read as x̂ = h·(4s) + m + l·s.
- Wide key channels (n of them, in a 2-bit head): channels 0..n−1 at 4 bits as above, channels d−n..d−1 replaced by
  their block mean (summed exactly, divided, rounded to float32 and then to float16, as the kernel computes it), the
  others at 2 bits.

Sliding-window layers (transformers' `DynamicSlidingWindowLayer`, window w) are exact: a pass sees the last w − 1
earlier tokens; the layer keeps those, or, while it records the past for rollbacks, every token since the last crop,
so a crop of r tokens needs the last min(n, w − 1 + r) of them.
"""

from __future__ import annotations

from fractions import Fraction
from math import floor

import torch
from transformers import DynamicCache

F16 = torch.float16
F16_MAX, F16_TINY = torch.finfo(F16).max, torch.finfo(F16).tiny


# --------------------------------------------------------------------------------------------- the spec's quantizer
def fake_quantize(x: torch.Tensor, dim: int, bits: int) -> torch.Tensor:
    """Asymmetric quantize -> dequantize of float32 `x` with one (scale, minimum) over `dim`. 4 bits: a wide head's
    code, stored as two 2-bit planes under the scale 4·s (s bounded so that 4·s stays within float16)."""
    levels = (1 << bits) - 1
    lo, hi = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    top = F16_MAX / 4 if bits == 4 else F16_MAX
    # a group of equal values gets the smallest normal scale (no division by zero); random data never has one
    scale = ((hi - lo) / levels).clamp(min=F16_TINY, max=top).to(F16).float()
    minimum = lo.clamp(-F16_MAX, F16_MAX).to(F16).float()
    codes = torch.round((x - minimum) / scale).clamp(0, levels)
    if bits == 2:
        return codes * scale + minimum
    assert bits == 4
    high, low = torch.div(codes, 4, rounding_mode="floor"), codes % 4
    stored = scale * 4  # the high plane's scale, exact
    return (high * stored + minimum) + low * (stored / 4)


def clip(x: torch.Tensor, ratio: float) -> torch.Tensor:
    """Each row clamped to ±τ, τ = sort(|x|)[floor(r·d)] (r·d in exact arithmetic)."""
    d = x.shape[-1]
    k = floor(Fraction(str(ratio)) * d)
    if k >= d:
        return x
    tau = x.abs().sort(dim=-1).values[..., k : k + 1]
    return torch.minimum(torch.maximum(x, -tau), tau)


def fake_quantize_tokens(x: torch.Tensor, bits: int, group: int, ratio: float) -> torch.Tensor:
    """Token-wise rows `[..., d]`: clip, then one (scale, minimum) per group of `group` channels."""
    d = x.shape[-1]
    rows = clip(x.float(), ratio)
    out = fake_quantize(rows.reshape(*x.shape[:-1], d // group, group), -1, bits)
    return out.reshape(x.shape)


def fake_quantize_key_block(x: torch.Tensor, bits: int, wide_channels: int) -> torch.Tensor:
    """One channel-wise key block `[B, block, d]` of one head: per channel over the block's tokens."""
    x = x.float()
    out = fake_quantize(x, 1, bits)
    n, d = wide_channels, x.shape[-1]
    if n:
        out[..., :n] = fake_quantize(x[..., :n], 1, 4)
        mean = x[..., d - n :].double().sum(1, keepdim=True) / x.shape[1]  # exact for these float32 keys
        out[..., d - n :] = mean.float().clamp(-F16_MAX, F16_MAX).to(F16).float().expand(-1, x.shape[1], -1)
    return out


def rotate(x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """x·R per KV head (`[B, H, n, d]`, `[H, d, d]`), as one batched product (so that the first layer's rotated
    states are the same floats as the cache's)."""
    if x.shape[0] == 1:
        return torch.matmul(x[0], rotation).unsqueeze(0)
    return torch.einsum("bhnd,hde->bhne", x, rotation)


# --------------------------------------------------------------------------------------------- the oracle layers
class Spec:
    """One layer's layout, as a test hands it to the rotation file: sink, window and demotion block, per-head key
    blocks, head bits, wide key channels, clips, group size and key granularity."""

    def __init__(self, heads, head_dim, granularity="channel", blocks=None, head_bits=None, wide_channels=None,
                 key_clip=1.0, value_clip=1.0, group=None, sink=4, window=8, block=16):
        self.heads, self.d, self.granularity = heads, head_dim, granularity
        self.sink, self.window, self.block = sink, window, block
        self.blocks = tuple(blocks or (block,) * heads)
        self.head_bits = tuple(head_bits or (2,) * heads)
        self.wide_channels = tuple(wide_channels or (0,) * heads)
        self.key_clip, self.value_clip, self.group = key_clip, value_clip, group or head_dim

    @property
    def ring(self) -> int:
        return self.window + 2 * self.block

    def history(self, n: int) -> int:
        """h(n): tokens in the history after n."""
        return max(0, (n - self.sink - self.window) // self.block) * self.block


class OracleLayer:
    """Per token: what the BF16 sink/window holds for it (`win_*`, rotated) and what the history holds for it
    (`hist_*`, dequantized; NaN until it was quantized); h, the tokens in the history; and `stored_order`, every
    position in the order it was stored since the last reset (removed ones included)."""

    def __init__(self, key_rotation, value_rotation, key_mean, spec: Spec):
        self.rk, self.rv, self.mean, self.spec = key_rotation, value_rotation, key_mean, spec
        self.reset()

    def reset(self):
        self.win_k = self.win_v = self.hist_k = self.hist_v = None
        self.h = 0
        self.stored_order: list[int] = []

    @property
    def length(self) -> int:
        return 0 if self.win_k is None else self.win_k.shape[2]

    def _tokens(self, x, ratio):
        """Token-wise rows `[B, H, n, d]` of this layer's heads (wide heads at 4 bits, unclipped)."""
        return torch.stack([fake_quantize_tokens(x[:, h], bits, self.spec.group, ratio if bits == 2 else 1.0)
                            for h, bits in enumerate(self.spec.head_bits)], 1)

    def _key_blocks(self, x):
        """Channel-wise key chunks `[B, H, n, d]` (n whole demotion blocks), each head in its own key blocks."""
        out = torch.empty_like(x)
        for h, (block, bits, n) in enumerate(zip(self.spec.blocks, self.spec.head_bits, self.spec.wide_channels)):
            for t in range(0, x.shape[2], block):
                out[:, h, t : t + block] = fake_quantize_key_block(x[:, h, t : t + block], bits, n)
        return out

    def _read(self, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first `tokens` positions as attention reads them now (rotated): sink, history, window."""
        s = self.spec.sink
        hist_end = min(s + self.h, tokens)
        k = torch.cat([self.win_k[:, :, :s], self.hist_k[:, :, s:hist_end], self.win_k[:, :, hist_end:tokens]], 2)
        v = torch.cat([self.win_v[:, :, :s], self.hist_v[:, :, s:hist_end], self.win_v[:, :, hist_end:tokens]], 2)
        return k[:, :, :tokens], v[:, :, :tokens]

    def stored(self):
        """Every stored token as attention reads it, rotated `[B, H, n, d]`."""
        return self._read(self.length)

    def update(self, k, v):
        """Stores a pass's states `[B, H, n, d]`; returns what attention reads, un-rotated: the earlier tokens as
        stored after this pass's demotions, then the pass's own exactly (keys less their mean)."""
        spec = self.spec
        if self.mean is not None:
            k = (k.float() - self.mean[None, :, None, :]).to(k.dtype)
        kr, vr = rotate(k, self.rk), rotate(v, self.rv)
        past, n = self.length, k.shape[2]
        nan = torch.full_like(kr, float("nan"))
        # values (and token-wise keys) are quantized on arrival (sink tokens never are)
        first = max(0, spec.sink - past)
        hv, hk = nan.clone(), nan.clone()
        hv[:, :, first:] = self._tokens(vr[:, :, first:], spec.value_clip)
        if spec.granularity == "token":
            hk[:, :, first:] = self._tokens(kr[:, :, first:], spec.key_clip)
        cat = lambda a, x: x if not past else torch.cat([a, x], 2)  # noqa: E731  (a new sequence: any batch)
        self.win_k, self.win_v = cat(self.win_k, kr), cat(self.win_v, vr)
        self.hist_k, self.hist_v = cat(self.hist_k, hk), cat(self.hist_v, hv)
        self.stored_order += range(past, past + n)
        # channel-wise key blocks that enter the history, from what the window holds
        h1 = spec.history(past + n)
        if spec.granularity == "channel" and h1 > self.h:
            a, b = spec.sink + self.h, spec.sink + h1
            self.hist_k[:, :, a:b] = self._key_blocks(self.win_k[:, :, a:b])
        self.h = h1
        seen_k, seen_v = self._read(past)  # earlier tokens as stored after this pass's demotions
        back_k = torch.einsum("bhnd,hed->bhne", seen_k, self.rk)  # ·R_Kᵀ
        back_v = torch.einsum("bhnd,hed->bhne", seen_v, self.rv)
        return torch.cat([back_k, k], 2), torch.cat([back_v, v], 2)

    def _overwritten(self, p: int) -> bool:
        """Whether a position of p's ring slot (R or more away) was stored after p last was."""
        ring, order = self.spec.ring, self.stored_order
        last = len(order) - 1 - order[::-1].index(p)
        return any(q != p and q >= self.spec.sink and (q - p) % ring == 0 for q in order[last + 1 :])

    def crop(self, remove: int):
        m = self.length - remove
        for name in ("win_k", "win_v", "hist_k", "hist_v"):
            setattr(self, name, getattr(self, name)[:, :, :m].clone())
        self.h = self.spec.history(m)
        for p in range(self.spec.sink + self.h, m):
            if self._overwritten(p):  # back to the window as the history stores it
                assert not (self.hist_k[:, :, p].isnan().any() or self.hist_v[:, :, p].isnan().any()), p
                self.win_k[:, :, p], self.win_v[:, :, p] = self.hist_k[:, :, p], self.hist_v[:, :, p]
                self.stored_order.append(p)

    def map_batch(self, fn):
        """Applies `fn` to the batch of every state (a beam reorder, a repeat, a selection)."""
        for name in ("win_k", "win_v", "hist_k", "hist_v"):
            if getattr(self, name) is not None:
                setattr(self, name, fn(getattr(self, name)))


class OracleSlidingLayer:
    """A sliding-window layer of window w, exact: every token kept; `held`, how many of the newest ones transformers'
    layer keeps (all since the last crop while it records the past)."""

    def __init__(self, window: int, record_past: bool = False):
        self.window, self.record_past = window, record_past
        self.reset()

    def reset(self):
        self.k = self.v = None
        self.held = 0

    @property
    def length(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def update(self, k, v):
        past = self.length
        seen = min(past, self.window - 1)
        out_k = torch.cat([self.k[:, :, past - seen :], k], 2) if past else k
        out_v = torch.cat([self.v[:, :, past - seen :], v], 2) if past else v
        self.k = torch.cat([self.k, k], 2) if past else k
        self.v = torch.cat([self.v, v], 2) if past else v
        self.held = self.held + k.shape[2] if self.record_past else min(self.length, self.window - 1)
        return out_k, out_v

    def can_crop(self, remove: int) -> bool:
        return self.length < self.window or self.held >= min(self.length, self.window - 1 + remove)

    def crop(self, remove: int):
        m = self.length - remove
        self.k, self.v = self.k[:, :, :m], self.v[:, :, :m]
        self.held = min(m, self.window - 1) if self.length + remove >= self.window else m

    def stored(self):
        """The tokens transformers' layer holds now."""
        return self.k[:, :, self.length - self.held :], self.v[:, :, self.length - self.held :]

    def map_batch(self, fn):
        if self.k is not None:
            self.k, self.v = fn(self.k), fn(self.v)


class OracleCache(DynamicCache):
    """The oracle behind transformers' `Cache` interface, so that a model runs on it (full-attention layers only)."""

    def __init__(self, model, rotations, specs):
        super().__init__(config=model.config)
        means = rotations.key_means or {}
        self.oracle = [OracleLayer(rotations.key_rotations[i], rotations.value_rotations[i], means.get(i), specs[i])
                       for i in range(model.config.num_hidden_layers)]

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        super().update(key_states, value_states, layer_idx)  # keeps the lengths transformers asks for
        return self.oracle[layer_idx].update(key_states, value_states)

    def crop(self, tokens_to_remove):
        super().crop(tokens_to_remove)
        for layer in self.oracle:
            layer.crop(-tokens_to_remove)

    def reorder_cache(self, beam_idx):
        super().reorder_cache(beam_idx)
        for layer in self.oracle:
            layer.map_batch(lambda t: t[beam_idx])
