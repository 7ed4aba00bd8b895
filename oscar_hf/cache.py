"""`OscarCache`: a `transformers.Cache` whose full-attention layers keep keys and values as

    [ sink (first `sink_tokens`, BF16) | history (INT2, packed) | recent window (last `window_tokens`..+block, BF16) ]

all stored rotated (k·R_K, v·R_V). The cache holds state and never does attention math: with
`attn_implementation="oscar"` it hands the registered attention function (`attention.py`) a view of its segments;
with any other attention implementation, `update` returns the history dequantized and un-rotated, so that plain
sdpa/eager attention gives the same result (slowly, like transformers' QuantizedCache).

Semantics shared by both paths: the tokens of the current forward pass attend to each other exactly (full precision,
as a BF16 prefill would) and to earlier tokens as the cache stores them.

Key centering (`OscarConfig.center_keys`, rotations carrying `key_means`): `OscarLayer.update` subtracts the
calibrated key mean μ from the incoming keys before anything else, so every segment (and the current chunk handed to
attention, on either path) holds k − μ. Attention is unchanged: softmax ignores the per-query shift q·μ.
"""

from __future__ import annotations

import threading
import warnings
from dataclasses import dataclass
from typing import Callable

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicSlidingWindowLayer

from .config import OscarConfig
from .models import check_attention_interface, kv_head_shards, text_config
from . import ops
from .quant import KeyBlockLayout, QuantizedKeyChunks, QuantizedRows, wide_rows
from .rotation import rotate  # noqa: F401  (re-exported: the cache and attention apply rotations through it)
from .rotations_io import OscarRotations
from .storage import QuantizedHistory

ATTENTION_NAME = "oscar"


@dataclass
class LayerView:
    """What the attention function needs from one OSCAR layer for one forward pass of `chunk_length` tokens.

    Key/value segments are rotated; positions: sink `[0, ns)`, history `[ns, ns + nh)`, recent `[ns + nh, ...)`,
    then `extra` (when the current chunk is not all in the recent window). Three cases:
    - `past_length == 0`: the chunk only attends to itself: `original_keys/values` hold it un-rotated and the
      attention is plain sdpa (exactly a BF16 prefill); the segments are empty.
    - the chunk is entirely in the recent window (decode, short chunks): the segments are the whole stored cache.
    - otherwise (a long chunk onto a filled cache): the segments are the past only and `extra` is the rotated chunk.

    Attributes:
        key_rotation, value_rotation: `[H, d, d]` in the compute dtype.
        sink_keys, sink_values: `[B, H, ns, d]`.
        history_keys, history_values: packed views (`storage.py`): values `QuantizedRows` (codes `[B, H, nh, d·bits/8]`,
            meta `[B, H, nh, G, 2]`), keys the same or `QuantizedKeyChunks` (channel-wise: meta `[B, nh/chunk, R, d, 2]`),
            or dense `[B, H, nh, d]` tensors when bits == 16.
        recent_keys, recent_values: `[B, H, nr, d]`.
        extra_keys, extra_values: `[B, H, ne, d]` (ne = 0 or chunk_length).
        original_keys, original_values: `[B, H, n, d]` un-rotated chunk (only when past_length == 0).
    """

    key_rotation: torch.Tensor
    value_rotation: torch.Tensor
    sink_keys: torch.Tensor
    sink_values: torch.Tensor
    history_keys: QuantizedRows | QuantizedKeyChunks | torch.Tensor
    history_values: QuantizedRows | torch.Tensor
    recent_keys: torch.Tensor
    recent_values: torch.Tensor
    extra_keys: torch.Tensor
    extra_values: torch.Tensor
    past_length: int
    chunk_length: int
    original_keys: torch.Tensor | None = None
    original_values: torch.Tensor | None = None

    @property
    def batch(self) -> int:
        return self.sink_keys.shape[0]

    @property
    def history_length(self) -> int:
        h = self.history_keys
        return (h if isinstance(h, torch.Tensor) else h.codes).shape[2]


# The handoff between `OscarLayer.update` (fused mode) and the attention function of the same module. transformers
# >= 5.2x hands one kwargs dict to both `cache.update(..., kwargs=kwargs)` and the attention call (`**kwargs`): the
# layer rides in it under VIEW_KWARG, so the attention finds exactly the view its own update made, and a view that
# does not fit the call raises. Older versions pass no such dict: the layer of the latest update then waits in a
# per-thread slot with its `layer_idx`, which the attention function matches against `module.layer_idx` (an entry
# left behind by an interrupted forward pass is recognised by its shape, reported and dropped).
VIEW_KWARG = "oscar_layer"
_pending = threading.local()


def claim_layer(module, kwargs: dict, query: torch.Tensor | None = None) -> "OscarLayer | None":
    """The OSCAR layer whose fused `update` prepared this attention call, or None when the call's layer is not an
    OSCAR layer (sliding-window layers, a model run without OscarCache). Consumed once."""
    layer = kwargs.pop(VIEW_KWARG, None)
    entry = getattr(_pending, "entry", None)
    if layer is not None:
        if entry is not None and entry[1] is layer:
            _pending.entry = None
        return layer
    if entry is None or entry[0] != getattr(module, "layer_idx", None):
        return None
    _pending.entry = None
    layer = entry[1]
    view = layer._view
    if view is None or (query is not None and (query.shape[0], query.shape[2]) != (view.batch, view.chunk_length)):
        warnings.warn("oscar_hf: dropped a cache view left by an interrupted forward pass", RuntimeWarning, stacklevel=3)
        layer._view = None
        return None
    return layer
def check_finite(key_states: torch.Tensor, value_states: torch.Tensor) -> None:
    """Refuses NaN/Inf states: on every multi-token pass, and on every step on the CPU (on a GPU a per-token check
    would cost a synchronisation, and a compiled step cannot branch on it)."""
    if key_states.shape[2] == 1 and (key_states.device.type != "cpu" or torch.compiler.is_compiling()):
        return
    if not (torch.isfinite(key_states).all() and torch.isfinite(value_states).all()):
        raise ValueError(
            "OscarCache received NaN or Inf key/value states: the model produced non-finite activations "
            "(with float16, overflow is a common cause; try bfloat16)"
        )


class BatchOpsMixin:
    """Beam reordering and batch selection for a cache layer whose state is several tensors, through `_map_batch`
    (transformers' own layers reorder only `keys`/`values`; a quantized layer must move every segment)."""

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.is_initialized:
            self._map_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self._map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self._map_batch(lambda t: t[indices.to(t.device) if isinstance(indices, torch.Tensor) else indices])

    def offload(self):
        raise RuntimeError(f"{type(self).__name__} does not support CPU offloading: the cache is already compressed")

    def prefetch(self):
        raise RuntimeError(f"{type(self).__name__} does not support CPU offloading")


class OscarLayer(BatchOpsMixin, CacheLayerMixin):
    """The cache of one full-attention layer: BF16 sink | quantized history | BF16 recent window, all rotated.

    Args:
        key_rotation, value_rotation: `[H, d, d]` orthogonal (float32; cast to the model dtype on first use).
        key_clip, value_clip: clip ratios applied to rows before quantization (1.0 = none).
        config: the `OscarConfig` (bits, group size, sink, window, demotion block, scale dtype).
        max_cache_len: if given, the history is allocated for that many tokens up front (no regrowth).
        key_mean: `[H, d]` key mean subtracted from every incoming key before storage (key centering), or None.
        key_blocks: channel-wise key block of each KV head (`OscarConfig.key_blocks`); None: `config.key_block`.
        head_bits: history bits of each KV head (`OscarConfig.head_bits`: 2, or 4 for the wide heads calibration
            picked; 2-bit histories only); None: `config.bits` everywhere.
        key_wide_channels: wide key channels of each KV head (`OscarConfig.key_wide_channels`; 2-bit channel-wise
            keys, `quant.quantize_wide_channels`: the key rotation sorts each head's channels for them); None: none.
    """

    is_compileable = False
    is_sliding = False
    is_croppable = True

    def __init__(
        self,
        key_rotation: torch.Tensor,
        value_rotation: torch.Tensor,
        key_clip: float,
        value_clip: float,
        config: OscarConfig,
        max_cache_len: int | None = None,
        key_mean: torch.Tensor | None = None,
        key_blocks: tuple[int, ...] | None = None,
        head_bits: tuple[int, ...] | None = None,
        key_wide_channels: tuple[int, ...] | None = None,
    ):
        super().__init__()
        if key_mean is not None and tuple(key_mean.shape) != tuple(key_rotation.shape[:2]):
            raise ValueError(
                f"OscarLayer: key_mean has shape {tuple(key_mean.shape)}, expected {tuple(key_rotation.shape[:2])} "
                "(num_key_value_heads, head_dim)"
            )
        self._key_mean_master = key_mean
        heads = key_rotation.shape[0]
        self.key_layout = (KeyBlockLayout(tuple(key_blocks or (config.key_block,) * heads), config.demotion_block)
                           if config.key_granularity == "channel" and config.bits < 16 else None)
        self.key_mean = None  # [1, H, 1, d] float32 on the model's device, set at lazy initialization
        if head_bits is not None and len(head_bits) != heads:
            raise ValueError(f"OscarLayer: {len(head_bits)} head bits for {heads} KV heads")
        self.wide = wide_rows(head_bits) if head_bits is not None and config.bits == 2 else ()
        if key_wide_channels is not None and len(key_wide_channels) != heads:
            raise ValueError(f"OscarLayer: {len(key_wide_channels)} wide key channel counts for {heads} KV heads")
        self.key_wide_channels = tuple(key_wide_channels or ())
        self.config = config
        self.key_clip, self.value_clip = float(key_clip), float(value_clip)
        self._key_rotation_master = key_rotation
        self._value_rotation_master = value_rotation
        self.max_cache_len = max_cache_len
        self._view: LayerView | None = None
        self._reset_state()

    def _reset_state(self) -> None:
        self.is_initialized = False
        self.record_past = False  # assisted decoding: demotion waits for `crop` (see `activate_past_recording`)
        self._uncropped = False  # an update happened while recording and no crop has followed it yet
        self.keys = self.values = None  # the base class's attributes; this layer keeps its own segments
        self.n_sink = self.n_recent = 0
        d, cfg = self._key_rotation_master.shape[-1], self.config
        group = cfg.group_size or d
        self.history_keys = QuantizedHistory(cfg.bits, cfg.key_granularity, group, self.key_layout, cfg.scale_dtype,
                                             self.key_clip, d, self.wide, self.key_wide_channels)
        self.history_values = QuantizedHistory(cfg.bits, "token", group, None, cfg.scale_dtype, self.value_clip, d,
                                               self.wide)

    def __repr__(self):
        return f"OscarLayer(sink={self.n_sink}, history={self.history_keys.length}, recent={self.n_recent})"

    # ------------------------------------------------------------------ CacheLayerMixin contract
    def _place(self, key_states: torch.Tensor) -> None:
        """Checks the states against the rotations and puts rotations and key mean on their device and dtype."""
        _, heads, _, d = key_states.shape
        expected = tuple(self._key_rotation_master.shape)
        if (heads, d, d) != expected:
            raise ValueError(
                f"OscarLayer got keys with {heads} KV heads of dim {d}, but its rotations are {expected} "
                "(num_key_value_heads, head_dim, head_dim): wrong rotation file for this model?"
            )
        self.device, self.dtype = key_states.device, key_states.dtype
        self.key_rotation = self._key_rotation_master.to(self.device, self.dtype)
        self.value_rotation = self._value_rotation_master.to(self.device, self.dtype)
        if self._key_mean_master is not None:
            self.key_mean = self._key_mean_master.to(self.device, torch.float32)[None, :, None, :]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self._place(key_states)
        batch, heads, _, d = key_states.shape
        cfg = self.config
        self.sink_keys = key_states.new_empty(batch, heads, cfg.sink_tokens, d)
        self.sink_values = value_states.new_empty(batch, heads, cfg.sink_tokens, d)
        recent_capacity = cfg.window_tokens + cfg.demotion_block
        self.recent_keys = key_states.new_empty(batch, heads, recent_capacity, d)
        self.recent_values = value_states.new_empty(batch, heads, recent_capacity, d)
        for history in (self.history_keys, self.history_values):
            history.initialize(key_states)
        if self.max_cache_len is not None:
            # the most the history can hold: everything beyond the sink and window, in whole demotion blocks
            rows = max(self.max_cache_len - cfg.sink_tokens - cfg.window_tokens, 0) // cfg.demotion_block * cfg.demotion_block
            for history in (self.history_keys, self.history_values):
                history.reserve(key_states, rows, bulk=True, extra=0)
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, fused: bool = False,
        layer_idx: int | None = None, attention_kwargs: dict | None = None, **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Stores `key_states`/`value_states` `[B, H, n, d]` (post-RoPE) and returns what attention needs.

        fused=True (attention "oscar"): returns the new states as they are and leaves a `LayerView` for the
        attention function, handed over through `attention_kwargs` (the dict transformers also passes to the
        attention call) or, without it, under `layer_idx`. fused=False (any other attention): returns the full
        history dequantized and un-rotated, followed by the exact new states, `[B, H, past + n, d]`. With a key
        mean, the keys are centered (k − μ) first, the only place where centering happens; the returned keys are
        centered too (same attention, by softmax invariance).
        """
        if fused and self._view is not None:
            # Either the last forward pass failed between update and attention, or the model calls update without
            # the attention function (unsupported model code). Say so; the stale view is dropped.
            warnings.warn("OscarLayer: the previous update's view was never used by an attention call (an interrupted "
                          "forward pass, or model code that calls cache.update outside its attention); dropped",
                          RuntimeWarning, stacklevel=3)
            self.take_view()
        key_states, past_length = self._store(key_states, value_states)
        if fused:
            self._view = self._make_view(past_length, key_states, value_states)
            if attention_kwargs is not None:
                attention_kwargs[VIEW_KWARG] = self
            else:
                _pending.entry = (layer_idx, self)
            return key_states, value_states
        # Plain attention: the stored past, dequantized and un-rotated, then the exact new states.
        past_keys, past_values = self.dequantized_past(self._segments(past_length))
        rt_k, rt_v = self.key_rotation.transpose(-1, -2), self.value_rotation.transpose(-1, -2)
        keys = torch.cat([rotate(past_keys, rt_k), key_states], dim=2)
        values = torch.cat([rotate(past_values, rt_v), value_states], dim=2)
        return keys, values

    def store(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Stores states `[B, H, n, d]` exactly as `update` would, for callers that run no attention afterwards
        (filling a cache from another cache's prefill): nothing is dequantized or handed over."""
        self._store(key_states, value_states)

    def centered(self, keys: torch.Tensor) -> torch.Tensor:
        """`keys` `[B, H, n, d]` minus the layer's key mean (as given without one): subtracted in float32, then back
        to the model dtype (one rounding of the centered key)."""
        if self.key_mean is None:
            return keys
        return (keys.float() - self.key_mean).to(keys.dtype)

    def _store(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Centers, checks and appends new states; returns the (centered) keys and the length before them."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        key_states = self.centered(key_states)
        check_finite(key_states, value_states)
        if self.record_past:
            if self._uncropped:
                # Two updates without a crop between them: assisted decoding (which crops after every verification
                # step) is over, and transformers never turns recording off. Demote what waited, as usual.
                self.record_past = False
                self._demote_overflow()
            self._uncropped = self.record_past
        past_length = self.get_seq_length()
        self._append(key_states, value_states)
        return key_states, past_length

    def take_view(self) -> LayerView:
        """The view left by the last fused update (consumed once); it also leaves the pending-layer table."""
        view, self._view = self._view, None
        if view is None:
            raise RuntimeError("OscarLayer.take_view called without a preceding fused update")
        entry = getattr(_pending, "entry", None)
        if entry is not None and entry[1] is self:
            _pending.entry = None
        return view

    def get_seq_length(self) -> int:
        return self.n_sink + self.history_keys.length + self.n_recent

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def get_max_cache_shape(self) -> int:
        return -1

    def reset(self) -> None:
        self._view = None
        self._reset_state()  # also ends past recording

    def activate_past_recording(self) -> None:
        """Assisted decoding: defer demotion until `crop`, so that a rollback leaves no trace."""
        self.record_past = True

    def crop(self, tokens_to_remove: int) -> None:
        """Removes the `-tokens_to_remove` newest tokens (negative argument, as transformers 5.x)."""
        if tokens_to_remove > 0:
            raise ValueError(
                f"OscarLayer.crop takes a negative number of tokens to remove, got {tokens_to_remove} "
                "(the positive absolute-length form is deprecated in transformers 5.x)"
            )
        self._uncropped = False
        if not self.is_initialized:
            return
        remove = min(-tokens_to_remove, self.get_seq_length())
        take = min(remove, self.n_recent)
        self.n_recent -= take
        remove -= take
        take = min(remove, self.history_keys.length)
        # Tokens already demoted are dropped as they are; with `activate_past_recording` (assisted decoding) the
        # candidates are never demoted before this crop, so the state equals a run that never saw them.
        if take:
            kept = self.history_keys.length - take
            tail_keys = self.history_keys.truncate(kept)
            self.history_values.truncate(kept)
            if tail_keys is not None:
                # A channel-wise key block was cut: its surviving tokens go back to the recent window as stored
                # (the values' rows too, dequantized), to be demoted again with the next block.
                n = tail_keys.shape[2]
                start = self.history_keys.length
                tail_values = self.history_values.dequantize(start, start + n, self.dtype)
                self.history_values.truncate(start)
                self._set_recent(torch.cat([tail_keys.to(self.dtype), self.recent_keys[:, :, : self.n_recent]], 2),
                                 torch.cat([tail_values, self.recent_values[:, :, : self.n_recent]], 2))
        remove -= take
        self.n_sink -= remove
        self._demote_overflow()

    # ------------------------------------------------------------------ segments
    def _append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Routes un-rotated states `[B, H, n, d]`: the first tokens of a sequence to the sink, the rest to the recent
        window; whole blocks of the oldest recent tokens beyond `window_tokens` are demoted into the history. Tokens
        of a long chunk that go straight to the history are rotated inside the fused quantize kernel."""
        cfg, n = self.config, keys.shape[2]
        rk, rv = self.key_rotation, self.value_rotation
        take = min(cfg.sink_tokens - self.n_sink, n) if self.history_keys.length + self.n_recent == 0 else 0
        if take > 0:
            self.sink_keys[:, :, self.n_sink : self.n_sink + take] = rotate(keys[:, :, :take], rk)
            self.sink_values[:, :, self.n_sink : self.n_sink + take] = rotate(values[:, :, :take], rv)
            self.n_sink += take
            keys, values = keys[:, :, take:], values[:, :, take:]
        m = keys.shape[2]
        if m == 0:
            return
        pool = self.n_recent + m
        demote = 0
        if not self.record_past and pool >= cfg.window_tokens + cfg.demotion_block:
            demote = (pool - cfg.window_tokens) // cfg.demotion_block * cfg.demotion_block
        from_recent, from_new = min(demote, self.n_recent), max(demote - self.n_recent, 0)
        bulk = demote > cfg.demotion_block
        if from_recent and from_new:
            # One append: a channel-wise block may span the old window and the new tokens.
            self.history_keys.append(torch.cat([self.recent_keys[:, :, :from_recent], rotate(keys[:, :, :from_new], rk)], 2), bulk)
            self.history_values.append(torch.cat([self.recent_values[:, :, :from_recent], rotate(values[:, :, :from_new], rv)], 2), bulk)
        elif from_recent:
            self.history_keys.append(self.recent_keys[:, :, :from_recent], bulk)
            self.history_values.append(self.recent_values[:, :, :from_recent], bulk)
        elif from_new:
            self.history_keys.append(keys[:, :, :from_new], bulk, rotation=rk)
            self.history_values.append(values[:, :, :from_new], bulk, rotation=rv)
        new_keys = rotate(keys[:, :, from_new:], rk)
        new_values = rotate(values[:, :, from_new:], rv)
        kept = self.n_recent - from_recent
        if from_recent == 0 and kept + new_keys.shape[2] <= self.recent_keys.shape[2]:
            # Decode fast path: write in place.
            self.recent_keys[:, :, kept : kept + new_keys.shape[2]] = new_keys
            self.recent_values[:, :, kept : kept + new_keys.shape[2]] = new_values
            self.n_recent = kept + new_keys.shape[2]
            return
        self._set_recent(
            torch.cat([self.recent_keys[:, :, from_recent : self.n_recent], new_keys], dim=2),
            torch.cat([self.recent_values[:, :, from_recent : self.n_recent], new_values], dim=2),
        )

    def _set_recent(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        n = keys.shape[2]
        capacity = max(self.config.window_tokens + self.config.demotion_block, n)
        if capacity != self.recent_keys.shape[2]:
            self.recent_keys = keys.new_empty(*keys.shape[:2], capacity, keys.shape[3])
            self.recent_values = values.new_empty(*values.shape[:2], capacity, values.shape[3])
        self.recent_keys[:, :, :n] = keys
        self.recent_values[:, :, :n] = values
        self.n_recent = n

    def _demote_overflow(self) -> None:
        """Moves the oldest recent tokens into the history, a whole number of blocks, leaving W..W+block-1."""
        cfg = self.config
        steady = cfg.window_tokens + cfg.demotion_block
        if self.n_recent >= steady:
            n_demote = (self.n_recent - cfg.window_tokens) // cfg.demotion_block * cfg.demotion_block
            bulk = n_demote > cfg.demotion_block
            self.history_keys.append(self.recent_keys[:, :, :n_demote], bulk)
            self.history_values.append(self.recent_values[:, :, :n_demote], bulk)
            start = n_demote
        elif self.recent_keys.shape[2] > steady:
            start = 0  # shrink a buffer that grew while recording the past
        else:
            return
        keep_keys = self.recent_keys[:, :, start : self.n_recent].clone()
        keep_values = self.recent_values[:, :, start : self.n_recent].clone()
        self._set_recent(keep_keys, keep_values)

    def _segments(self, upto: int) -> LayerView:
        """The stored segments restricted to positions < `upto` (no chunk)."""
        ns = min(self.n_sink, upto)
        nh = min(self.history_keys.length, max(upto - self.n_sink, 0))
        nr = min(self.n_recent, max(upto - self.n_sink - self.history_keys.length, 0))
        empty = self.sink_keys[:, :, :0]
        return LayerView(
            key_rotation=self.key_rotation,
            value_rotation=self.value_rotation,
            sink_keys=self.sink_keys[:, :, :ns],
            sink_values=self.sink_values[:, :, :ns],
            history_keys=self.history_keys.packed(0, nh),
            history_values=self.history_values.packed(0, nh),
            recent_keys=self.recent_keys[:, :, :nr],
            recent_values=self.recent_values[:, :, :nr],
            extra_keys=empty,
            extra_values=empty,
            past_length=upto,
            chunk_length=0,
        )

    def _make_view(self, past_length: int, keys: torch.Tensor, values: torch.Tensor) -> LayerView:
        n = keys.shape[2]
        total = self.get_seq_length()
        if past_length == 0:
            view = self._segments(0)
            view.original_keys, view.original_values = keys, values
        elif self.n_recent >= n:
            view = self._segments(total)  # the chunk sits at the end of the recent window
        else:
            view = self._segments(past_length)
            view.extra_keys, view.extra_values = rotate(keys, self.key_rotation), rotate(values, self.value_rotation)
        view.past_length, view.chunk_length = past_length, n
        return view

    def stored_states(self) -> tuple[torch.Tensor, torch.Tensor]:
        """All stored tokens as rotated dense tensors `[B, H, seq_len, d]` (history dequantized), for inspection
        (with key centering the keys are (k − μ)·R)."""
        return self.dequantized_past(self._segments(self.get_seq_length()))

    def dequantized_past(self, view: LayerView) -> tuple[torch.Tensor, torch.Tensor]:
        """The past of `view` as rotated dense tensors `[B, H, past_length, d]` in the model dtype."""
        nh = view.history_length
        hist_k = self.history_keys.dequantize(0, nh, self.dtype)
        hist_v = self.history_values.dequantize(0, nh, self.dtype)
        keys = torch.cat([view.sink_keys, hist_k, view.recent_keys], dim=2)
        values = torch.cat([view.sink_values, hist_v, view.recent_values], dim=2)
        return keys, values

    def _map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.sink_keys, self.sink_values = fn(self.sink_keys), fn(self.sink_values)
        self.recent_keys, self.recent_values = fn(self.recent_keys), fn(self.recent_values)
        self.history_keys.map_batch(fn)
        self.history_values.map_batch(fn)

    # ------------------------------------------------------------------ accounting
    def memory_bytes(self) -> dict[str, int]:
        """Bytes really allocated and bytes holding valid tokens, and the number of K+V elements represented."""
        if not self.is_initialized:
            return {"allocated": 0, "used": 0, "elements": 0, "tokens": 0}
        windows = (self.sink_keys, self.sink_values, self.recent_keys, self.recent_values)
        allocated = sum(t.numel() * t.element_size() for t in windows)
        per_token_window = self.sink_keys[:, :, :1].numel() * self.sink_keys.element_size() * 2
        used = per_token_window * (self.n_sink + self.n_recent)
        for history in (self.history_keys, self.history_values):
            a, u = history.nbytes()
            allocated, used = allocated + a, used + u
        batch, heads, _, d = self.sink_keys.shape
        tokens = self.get_seq_length()
        return {"allocated": allocated, "used": used, "elements": 2 * batch * heads * d * tokens, "tokens": tokens}


class OscarCache(Cache):
    """KV cache storing full-attention layers with OSCAR (BF16 sink | INT2 rotated history | BF16 recent window).

    Usage:
        model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="oscar")
        cache = OscarCache(model, OscarRotations.from_pretrained(name))
        model.generate(**inputs, past_key_values=cache)

    Sliding-window layers (e.g. Gemma 3's local layers) keep transformers' bounded BF16 window. For a compiled,
    CUDA-graph decode step use `StaticOscarCache` (`static_cache.py`): the same storage in fixed buffers.

    Key centering: when `rotations` carry key means (calibrated with `OscarConfig(center_keys=True)`), the OSCAR
    layers subtract them from the keys before storing them; `config.center_keys=True` with rotations that carry no
    means is an error.

    Args:
        model: the model (or its config) the cache is for; rotations are validated against it.
        rotations: calibrated `OscarRotations` (or `OscarRotations.data_free(...)` for baselines).
        config: `OscarConfig`; default: the defaults (2 bits, sink 64, window 256, fitted clips) in the storage layout
            the rotations were calibrated for (`rotations.layout`).
        max_cache_len: optional token count to allocate the history for up front.
        allow_other_weights: accept rotations whose weight fingerprint differs from the model's (a warning instead
            of `RotationFileError`).
    """

    def __init__(
        self,
        model,
        rotations: OscarRotations,
        config: OscarConfig | None = None,
        max_cache_len: int | None = None,
        allow_other_weights: bool = False,
    ):
        model_config = getattr(model, "config", model)
        if hasattr(model, "config"):
            check_attention_interface(model)
        if not isinstance(rotations, OscarRotations):
            raise TypeError(f"OscarCache needs OscarRotations, got {type(rotations).__name__}")
        geometry = rotations.validate_for(model_config)
        if hasattr(model, "named_parameters"):  # rotations calibrated on other weights of the same shapes
            rotations.check_fingerprint(model, strict=not allow_other_weights)
        if config is None:  # the layout the rotations and clips were fitted for, with the file's key channel widths
            config = OscarConfig(**rotations.layout, **({"key_channel_bits": "fitted"} if rotations.key_wide_channels
                                                        else {}))
        else:
            if rotations.key_wide_channels and config.key_channel_bits != "fitted" and config.bits < 16:
                warnings.warn("OscarCache: the rotations sort each head's key channels for wide key channels, which "
                              f"this config does not use (key_channel_bits={config.key_channel_bits!r}): keys are "
                              "stored at 2 bits in every channel of that basis", RuntimeWarning, stacklevel=2)
            differs = {k: (getattr(config, k), v) for k, v in rotations.layout.items() if getattr(config, k) != v}
            if differs and config.bits < 16 and not rotations.metadata.get("method", {}).get("data_free"):
                warnings.warn(
                    "OscarCache: the config's storage layout differs from the one these rotations were calibrated "
                    f"for ({', '.join(f'{k}={a!r} vs {b!r}' for k, (a, b) in differs.items())}): key bases and clips "
                    "were fitted for the file's layout"
                    + ("; the file's per-head key blocks, allocated for its key_block and demotion_block, are not "
                       "used (config.key_block everywhere)" if rotations.key_blocks and
                       ({"key_block", "demotion_block"} & set(differs)) else ""), RuntimeWarning, stacklevel=2)
        config.check_head_dim(geometry.head_dim)
        if config.center_keys and not rotations.center_keys:
            raise ValueError(
                "OscarConfig.center_keys is True but the rotations carry no key means: calibrate with "
                "OscarConfig(center_keys=True) (or `oscar-hf calibrate --center-keys`), or set center_keys=False"
            )
        self._text_config = text_config(model_config)
        self.oscar_config = config
        self.rotations = rotations
        self.geometry = geometry
        # tensor parallelism: each rank's layers hold their own KV heads, with those heads' rotations and key means
        self.kv_head_shards = (kv_head_shards(model, geometry.head_dim, geometry.num_key_value_heads)
                               if hasattr(model, "named_modules") else {})
        super().__init__(layers=self._make_layers(geometry, rotations, config, max_cache_len))

    def _local_heads(self, i: int, per_head):
        """The rows of a per-KV-head tensor `[H, ...]` (or tuple) that layer `i` holds on this rank."""
        if per_head is None or i not in self.kv_head_shards:
            return per_head
        first, count = self.kv_head_shards[i]
        return per_head[first : first + count]

    def _layer_arguments(self, i: int, rotations: OscarRotations, config: OscarConfig) -> tuple:
        """Rotations, clips and config of OSCAR layer `i` (positional arguments of `OscarLayer`)."""
        return (self._local_heads(i, rotations.key_rotations[i]), self._local_heads(i, rotations.value_rotations[i]),
                config.clip_ratio("key", rotations.key_clip(i)), config.clip_ratio("value", rotations.value_clip(i)),
                config)

    def _key_blocks(self, i: int, rotations: OscarRotations, config: OscarConfig) -> tuple[int, ...]:
        """The channel-wise key block of each KV head of layer `i` on this rank (`OscarConfig.key_blocks`). A file's
        allocation was made for its own key_block budget and demotion chunk: a config asking for another budget gets
        its key_block everywhere (what it asked for), not the file's blocks."""
        heads = self._local_heads(i, rotations.key_rotations[i]).shape[0]
        same_budget = all(rotations.layout.get(k) == getattr(config, k) for k in ("key_block", "demotion_block"))
        return config.key_blocks(heads, self._local_heads(i, rotations.key_block(i)) if same_budget else None)

    def _head_bits(self, i: int, rotations: OscarRotations, config: OscarConfig) -> tuple[int, ...] | None:
        """The history bits of each KV head of layer `i` on this rank (the file's wide heads; `OscarConfig.head_bits`)."""
        heads = self._local_heads(i, rotations.key_rotations[i]).shape[0]
        return config.head_bits(heads, self._local_heads(i, rotations.head_bit(i)))

    def _key_wide_channels(self, i: int, rotations: OscarRotations, config: OscarConfig) -> tuple[int, ...] | None:
        """The wide key channels of each KV head of layer `i` on this rank (the file's; `OscarConfig.key_wide_channels`)."""
        heads = self._local_heads(i, rotations.key_rotations[i]).shape[0]
        return config.key_wide_channels(heads, self._local_heads(i, rotations.key_wide_channel(i)))

    def _make_layers(self, geometry, rotations: OscarRotations, config: OscarConfig, max_cache_len: int | None):
        layers: list[CacheLayerMixin] = []
        for i, kind in enumerate(geometry.plan):
            if kind == "oscar":
                layers.append(OscarLayer(*self._layer_arguments(i, rotations, config), max_cache_len,
                                         key_mean=self._local_heads(i, rotations.key_mean(i)),
                                         key_blocks=self._key_blocks(i, rotations, config),
                                         head_bits=self._head_bits(i, rotations, config),
                                         key_wide_channels=self._key_wide_channels(i, rotations, config)))
            else:
                layers.append(DynamicSlidingWindowLayer(sliding_window=geometry.sliding_windows[i]))
        return layers

    @property
    def fused_attention(self) -> bool:
        """True when the model runs the registered "oscar" attention (reads packed segments directly)."""
        return getattr(self._text_config, "_attn_implementation", None) == ATTENTION_NAME

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        layer = self.layers[layer_idx]
        if isinstance(layer, OscarLayer):
            # transformers >= 5.2x: `kwargs=` is the very dict the attention call receives as **kwargs.
            attention_kwargs = kwargs.get("kwargs")
            return layer.update(key_states, value_states, fused=self.fused_attention, layer_idx=layer_idx,
                                attention_kwargs=attention_kwargs if isinstance(attention_kwargs, dict) else None)
        return layer.update(key_states, value_states, *args, **kwargs)

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return self.get_max_length(layer_idx)

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(
                f"OscarCache.crop takes a negative number of tokens to remove, got {tokens_to_remove}"
            )
        super().crop(tokens_to_remove)

    def memory_report(self) -> dict:
        """Bytes really allocated by the cache and bits per stored K/V element, against a BF16 `DynamicCache`.

        `bits_per_element` covers the OSCAR layers (sink + history + recent, metadata and spare capacity included);
        `compression` compares all layers (sliding windows included) with what a BF16 DynamicCache would hold.
        """
        allocated = used = elements = 0
        sliding_bytes = 0
        tokens = int(self.get_seq_length(self.geometry.oscar_layers[0]))  # a device tensor for StaticOscarCache
        for layer in self.layers:
            if isinstance(layer, OscarLayer):
                m = layer.memory_bytes()
                allocated, used, elements = allocated + m["allocated"], used + m["used"], elements + m["elements"]
            elif layer.is_initialized and layer.keys is not None:
                sliding_bytes += sum(t.numel() * t.element_size() for t in (layer.keys, layer.values))
        bf16_bytes = 2 * elements + sliding_bytes
        total = allocated + sliding_bytes
        return {
            "tokens": tokens,
            "oscar_layers": len(self.geometry.oscar_layers),
            "sliding_layers": len(self.layers) - len(self.geometry.oscar_layers),
            "oscar_allocated_bytes": allocated,
            "oscar_used_bytes": used,
            "oscar_elements": elements,
            "bits_per_element": 8 * allocated / elements if elements else float("nan"),
            "bits_per_element_used": 8 * used / elements if elements else float("nan"),
            "sliding_bytes": sliding_bytes,
            "total_allocated_bytes": total,
            "bf16_equivalent_bytes": bf16_bytes,
            "compression": bf16_bytes / total if total else float("nan"),
        }
