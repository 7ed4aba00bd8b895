"""`StaticOscarCache`: the OSCAR cache with fixed buffers, for `torch.compile` and CUDA graphs.

`model.generate` compiles the decode step when the cache says `is_compileable` (as it does for `StaticCache`). That
needs a step with no host synchronisation, no shape or address change and no Python branch on the sequence length.
This cache stores exactly what `OscarCache` stores (same quantizer, same `storage.QuantizedHistory` format, same
sink / history / recent-window split, hence the same attention results), in buffers allocated once for
`max_cache_len` tokens, per OSCAR layer (S sink tokens, W window, b demotion block, R = W + 2b):

    sink     `[B, H, S + 1, d]`  positions [0, S) (rotated);   slot S: scratch
    history  capacity C rows, whole blocks (QuantizedHistory); row j = position S + j
    ring     `[B, H, R + 1, d]`  position p >= S at slot (p − S) mod R (rotated);   slot R: scratch

The stored state is a function of the token count L alone, as in `OscarLayer` (which demotes whole blocks once the
window holds W + b tokens):

    n_sink = min(L, S),   n_hist = max(0, ⌊(L − S − W) / b⌋)·b,   recent = positions [S + n_hist, L) (in the ring)

so a decode step is branch-free: the new token goes to its sink or ring slot (`ops.rotate_store_token`; the torch
twin sends the other write to a scratch slot); its value (and a token-wise key) is quantized straight into its history row, which attention reads only once
n_hist covers it; and a channel-wise key block is quantized from the ring on the step that completes it. The history
writes take their first row on the device (`ops.quantize_pack_at`): a negative row (a sink token's, or a step that
completes no key block) writes nothing, and the kernel exits at once. R = W + 2b leaves room for `crop` to roll
back up to b + 1 tokens exactly (assisted decoding).

The lengths live on the device in one `DecodePlan` per cache, advanced once per forward pass by the first OSCAR
layer (FlashInfer's plan once, run per layer); the attention reads them from there (`ops.decode_attention`).
Multi-token chunks (prefill, a question after a stored document) run eagerly, with one host synchronisation, and
attend like `OscarLayer`'s chunks do (`LayerView`). Without `torch.compile`, a CUDA decode step replays each layer's
store and attention as CUDA graphs captured on first use (`graphs.py`): an eager step is bound by its host work.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from transformers.cache_utils import StaticSlidingWindowLayer

from . import graphs, ops
from .cache import VIEW_KWARG, LayerView, OscarCache, OscarLayer, _pending, check_finite, rotate
from .graphs import DecodeGraphs

try:  # transformers' own helper: not tracing (mark_static_address is not allowed while dynamo traces)
    from transformers.utils import is_torchdynamo_compiling
except ImportError:  # pragma: no cover
    is_torchdynamo_compiling = torch.compiler.is_compiling


def history_rows(length: int, sink: int, window: int, block: int) -> int:
    """Tokens in the quantized history when `length` tokens are stored (the formula both caches follow)."""
    return max(0, (length - sink - window) // block) * block


class DecodePlan:
    """Token counts of one static cache, on the device, shared by its OSCAR layers.

    Attributes:
        length: int64 scalar, tokens stored after the current forward pass (L).
        start: int64 scalar, tokens stored before it (the position of its first token).
        lengths: int32 `[5]` for the attention: (n_sink, n_hist, n_recent, ring_lo, q_start).
        write_rows: int64 `[2]`, a single-token pass's history writes, the same in every layer: (the token's history
            row, or −1 for a sink token; the first row of the channel-wise key block it completes, or −1).
        host_start: `start` as a Python int, set only for multi-token passes (which synchronise once).
    """

    def __init__(self, sink: int, window: int, block: int, max_cache_len: int):
        self.sink, self.window, self.block, self.max_cache_len = sink, window, block, max_cache_len
        self.ring = window + 2 * block
        self.length = torch.zeros((), dtype=torch.int64)
        self.start = torch.zeros((), dtype=torch.int64)
        self.lengths = torch.zeros(5, dtype=torch.int32)
        self.write_rows = torch.full((2,), -1, dtype=torch.int64)
        self.host_start: int | None = None
        self.device = None

    def _tensors(self) -> tuple[torch.Tensor, ...]:
        return self.length, self.start, self.lengths, self.write_rows

    def initialize(self, device) -> None:
        if self.device is not None:
            return
        self.length, self.start, self.lengths, self.write_rows = (t.to(device) for t in self._tensors())
        self.device = device
        if not is_torchdynamo_compiling():
            for t in self._tensors():
                torch._dynamo.mark_static_address(t)

    def advance(self, tokens: int) -> None:
        """A forward pass of `tokens` tokens begins (in place: a captured graph replays it). Not graphed in an
        eager step: it is not idempotent (`graphs.GraphedCall` runs its function once more as the warm-up)."""
        self.host_start = int(self.length) if tokens > 1 else None  # the chunk path needs it on the host anyway
        if self.host_start is not None and self.host_start + tokens > self.max_cache_len:
            raise ValueError(f"StaticOscarCache holds {self.max_cache_len} tokens (max_cache_len); this pass would "
                             f"store {self.host_start + tokens}")
        self.start.copy_(self.length)
        self.length.add_(tokens)
        # a device-side check (capturable, no synchronisation): writing past the buffers must fail loudly
        torch._assert_async(self.length <= self.max_cache_len,
                            f"StaticOscarCache is full: it holds max_cache_len={self.max_cache_len} tokens; "
                            "create it with a larger max_cache_len (prompt + new tokens)")
        s, w, b = self.sink, self.window, self.block
        n_sink = self.length.clamp(max=s)
        n_hist = torch.div(self.length - s - w, b, rounding_mode="floor").clamp(min=0) * b
        n_recent = (self.length - s - n_hist).clamp(min=0)
        self.lengths.copy_(torch.stack([n_sink, n_hist, n_recent, n_hist % self.ring, self.start]).to(torch.int32))
        if tokens == 1:  # planned once here rather than in each layer (fewer kernels in a compiled step)
            pos = self.start
            # a key block completes when this token brings the window to W + b: rows [k·b, (k+1)·b), still in the ring
            excess = self.length - s - w
            k = torch.div(excess, b, rounding_mode="floor") - 1
            due = (k >= 0) & (excess % b == 0)
            self.write_rows.copy_(torch.stack([torch.where(pos < s, -1, pos - s), torch.where(due, k * b, -1)]))

    def set_length(self, length: int) -> None:
        self.length.fill_(length)
        self.start.fill_(length)
        self.host_start = None


@dataclass
class DecodeView:
    """What the attention needs for a single-token step on a static layer: the layer (its fixed buffers and plan)."""

    layer: "StaticOscarLayer"
    chunk_length: int
    batch: int


class StaticOscarLayer(OscarLayer):
    """An OSCAR layer in fixed buffers (module docstring). Same constructor as `OscarLayer` plus the shared `plan`;
    `max_cache_len` is required. Needs the "oscar" attention and 2-bit histories."""

    is_compileable = True

    def __init__(self, *args, plan: DecodePlan, max_cache_len: int, graphs: DecodeGraphs | None = None, **kwargs):
        self.plan = plan
        self.graphs = graphs if graphs is not None else DecodeGraphs()
        self._graph_buffers = None  # what this layer's graphs captured: its buffers' addresses (decode_call)
        super().__init__(*args, max_cache_len=max_cache_len, **kwargs)
        if self.config.bits != 2:
            raise ValueError(f"StaticOscarCache stores 2-bit histories (the decode kernel's), not {self.config.bits}")

    def __repr__(self):
        return f"StaticOscarLayer(max_cache_len={self.max_cache_len}, ring={self.plan.ring})"

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self._place(key_states)
        batch, heads, _, d = key_states.shape
        cfg, plan = self.config, self.plan
        plan.initialize(key_states.device)
        s, r, b = cfg.sink_tokens, plan.ring, cfg.demotion_block
        self.sink_keys = key_states.new_zeros(batch, heads, s + 1, d)
        self.sink_values = value_states.new_zeros(batch, heads, s + 1, d)
        self.ring_keys = key_states.new_zeros(batch, heads, r + 1, d)
        self.ring_values = value_states.new_zeros(batch, heads, r + 1, d)
        self.recent_keys = self.recent_values = None
        self.is_initialized = True
        # every position beyond the sink has a history row (values are quantized on arrival)
        capacity = max(-(-max(self.max_cache_len - s, 0) // b) * b, b)
        kernel = ops.use_kernels(key_states, ops.attention_layout_problem(
            d, d // (cfg.group_size or d), 0 if self.history_keys.channelwise else d // (cfg.group_size or d),
            self.history_keys.kernel_key_layout[0], bool(self.wide)))
        for history in (self.history_keys, self.history_values):
            history.allocate_static(key_states, capacity)
            history.kernel = kernel
        self.kernel = kernel
        self._graph_buffers = None
        if not is_torchdynamo_compiling():
            for t in self._buffers() + self._constants():
                torch._dynamo.mark_static_address(t)

    # ------------------------------------------------------------------ update
    def update(self, key_states, value_states, *args, fused: bool = False, layer_idx: int | None = None,
               attention_kwargs: dict | None = None, **kwargs):
        """Stores `[B, H, n, d]` states and hands the attention its view (see `OscarLayer.update`); the plan has
        already advanced by n (`StaticOscarCache.update`). A single token's keys are returned as given, not
        centered (the "oscar" attention, the only one this cache supports, reads the stored states)."""
        if not fused:
            raise ValueError("StaticOscarCache needs attn_implementation=\"oscar\" (model.set_attn_implementation("
                             "\"oscar\")): its buffers are read by the OSCAR decode kernel only")
        if self._view is not None:
            warnings.warn("StaticOscarLayer: the previous update's view was never used by an attention call; dropped",
                          RuntimeWarning, stacklevel=3)
            self._view = None
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        check_finite(key_states, value_states)
        if key_states.shape[2] == 1:
            # centered inside the store (one graph); the keys returned stay as given: the attention reads the cache
            self.decode_call("store", self._store_token, key_states, value_states)
            view = DecodeView(self, 1, key_states.shape[0])
        else:
            key_states = self.centered(key_states)
            view = self._store_chunk(key_states, value_states)
        self._view = view
        if attention_kwargs is not None:
            attention_kwargs[VIEW_KWARG] = self
        else:
            _pending.entry = (layer_idx, self)
        return key_states, value_states

    def store(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Stores a chunk as `update` would, without preparing an attention view (filling a cache from another's
        prefill). The shared plan must have advanced by this chunk first (`StaticOscarCache.plan.advance(n)`)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.plan.host_start is None:
            raise RuntimeError("StaticOscarLayer.store: advance the cache's plan by the chunk first (plan.advance(n), n > 1)")
        key_states = self.centered(key_states)
        check_finite(key_states, value_states)
        self._store_chunk(key_states, value_states, view=False)

    def _store_token(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """One token, on the device only: fixed shapes, no branch, no synchronisation."""
        plan, r = self.plan, self.plan.ring
        keys = self.centered(keys)
        # rotated into its sink or ring slot in one launch (oscar::rotate_store_token)
        rk, rv = ops.rotate_store_token(keys, values, self.key_rotation, self.value_rotation, self.sink_keys,
                                        self.sink_values, self.ring_keys, self.ring_values, plan.start,
                                        self.config.sink_tokens, r,
                                        kernel=self.kernel).unbind(0)
        row, key_block = plan.write_rows[0:1], plan.write_rows[1:2]  # -1: nothing to write (DecodePlan.advance)
        self.history_values.write_rows_at(rv, row)
        if not self.history_keys.channelwise:
            self.history_keys.write_rows_at(rk, row)
            return
        # the key block this token completes, quantized from the ring in place (history row j is at slot j mod R);
        # on the other 127 steps of 128 the write is skipped on the device
        self.history_keys.write_chunks_at(self.ring_keys, key_block, ring=r)

    def decode_call(self, name: str, fn, *inputs: torch.Tensor, static: tuple = ()):
        """`fn(*inputs)`, a single-token step's store or attention: in an eager CUDA call replayed as a CUDA graph
        (`graphs.py`; it depends on `inputs`' layouts, the `static` arguments and this layer's buffer addresses),
        else called. A tensor result from a graph is the graph's output buffer, valid until this layer's next
        decode step replays it (the attention's caller, the model's o_proj, consumes it at once)."""
        if not graphs.enabled(inputs[0], self.kernel):
            return fn(*inputs)
        if self._graph_buffers is None:  # reset wherever the buffers are replaced (initialization, batch changes)
            self._graph_buffers = (id(self), graphs.addresses(*self._buffers(), *self._constants(),
                                                              *self.plan._tensors()))
        return self.graphs.run((self._graph_buffers, name, static, graphs.signature(*inputs)), fn, *inputs)

    def _store_chunk(self, keys: torch.Tensor, values: torch.Tensor, view: bool = True) -> LayerView | None:
        """Several tokens (eager; one host synchronisation per pass, in `DecodePlan.advance`). Returns the attention
        view, built before the ring slots of the past are overwritten: the chunk attends to the past as stored and to
        itself exactly, as in `OscarLayer`."""
        cfg, plan = self.config, self.plan
        s, w, b, r = cfg.sink_tokens, cfg.window_tokens, cfg.demotion_block, plan.ring
        l0 = plan.host_start
        n = keys.shape[2]
        l1 = l0 + n
        device = keys.device
        rk, rv = rotate(keys, self.key_rotation), rotate(values, self.value_rotation)
        nh0, nh1 = history_rows(l0, s, w, b), history_rows(l1, s, w, b)
        view = self._chunk_view(l0, nh1, keys, values, rk, rv) if view else None
        # sink
        ns = max(0, min(s, l1) - l0)
        self.sink_keys[:, :, l0 : l0 + ns] = rk[:, :, :ns]
        self.sink_values[:, :, l0 : l0 + ns] = rv[:, :, :ns]
        # history rows of every new token beyond the sink (values, token-wise keys)
        first = max(l0, s)
        if l1 > first:
            row = torch.full((1,), first - s, dtype=torch.int64, device=device)
            self.history_values.write_rows_at(rv[:, :, first - l0 :], row)
            if not self.history_keys.channelwise:
                self.history_keys.write_rows_at(rk[:, :, first - l0 :], row)
        # channel-wise key blocks completed by this chunk: positions [s + nh0, s + nh1), from the ring and the chunk
        if self.history_keys.channelwise and nh1 > nh0:
            lo = s + nh0
            split = max(lo, min(l0, s + nh1))  # [lo, split) are past tokens, in the ring
            old = self.ring_keys.index_select(2, (torch.arange(lo, split, device=device) - s) % r)
            dense = torch.cat([old, rk[:, :, max(lo, l0) - l0 : max(s + nh1 - l0, 0)]], dim=2)
            self.history_keys.write_chunks_at(dense, torch.full((1,), nh0, dtype=torch.int64, device=device))
        # ring: the newest tokens beyond the sink (at most R of them matter)
        ring_first = max(first, l1 - r)
        if l1 > ring_first:
            slots = (torch.arange(ring_first, l1, device=device) - s) % r
            self.ring_keys.index_copy_(2, slots, rk[:, :, ring_first - l0 :])
            self.ring_values.index_copy_(2, slots, rv[:, :, ring_first - l0 :])
        return view

    def _chunk_view(self, l0: int, nh1: int, keys, values, rk, rv) -> LayerView:
        """The view `OscarLayer._make_view` would give: past = sink | history (as stored after this chunk, up to
        the past's end) | the rest of the past from the ring; then the chunk itself, exact."""
        s, r = self.config.sink_tokens, self.plan.ring
        nh_view = max(0, min(nh1, l0 - s))
        recent = torch.arange(s + nh_view, max(l0, s + nh_view), device=rk.device)
        view = LayerView(
            key_rotation=self.key_rotation, value_rotation=self.value_rotation,
            sink_keys=self.sink_keys[:, :, : min(l0, s)], sink_values=self.sink_values[:, :, : min(l0, s)],
            history_keys=self.history_keys.packed(0, nh_view), history_values=self.history_values.packed(0, nh_view),
            recent_keys=self.ring_keys.index_select(2, (recent - s) % r),
            recent_values=self.ring_values.index_select(2, (recent - s) % r),
            extra_keys=rk, extra_values=rv, past_length=l0, chunk_length=keys.shape[2],
        )
        if l0 == 0:
            view.extra_keys = view.extra_values = rk[:, :, :0]
            view.original_keys, view.original_values = keys, values
        return view

    # ------------------------------------------------------------------ CacheLayerMixin contract
    def get_seq_length(self):
        return self.plan.length if self.is_initialized else 0

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.max_cache_len, 0

    def get_max_length(self) -> int:
        return self.max_cache_len

    def get_max_cache_shape(self) -> int:
        return self.max_cache_len

    def reset(self) -> None:
        self.plan.set_length(0)
        self._view = None

    def crop(self, tokens_to_remove: int) -> None:
        raise RuntimeError("the layers of a StaticOscarCache share one length: crop the cache (cache.crop), not a layer")

    def activate_past_recording(self) -> None:
        pass  # the ring keeps the recent past exactly; crop says how far back it can go

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam reordering in place (the buffers keep their addresses)."""
        if self.is_initialized:
            for t in self._buffers():
                t.copy_(t.index_select(0, beam_idx.to(t.device)))

    def _buffers(self) -> list[torch.Tensor]:
        return [self.sink_keys, self.sink_values, self.ring_keys, self.ring_values,
                *self.history_keys.buffers.values(), *self.history_values.buffers.values()]

    def _constants(self) -> list[torch.Tensor]:
        """Tensors the decode step reads but never writes. Marked static like the buffers: a CUDA graph would
        otherwise copy every one of them into its input pool on every replay (measured on the H200 before this:
        0.7 ms of host time per step in `torch._foreach_copy_` for the 36 layers' rotations)."""
        return [t for t in (self.key_rotation, self.value_rotation, self.key_mean) if t is not None]

    def _map_batch(self, fn) -> None:
        """Batch expansion or selection (`batch_repeat_interleave`, `batch_select_indices`): new buffers of the new
        batch size, marked static again (a compiled step then recompiles for them, as for any new shape)."""
        self.sink_keys, self.sink_values = fn(self.sink_keys), fn(self.sink_values)
        self.ring_keys, self.ring_values = fn(self.ring_keys), fn(self.ring_values)
        self.history_keys.map_batch(fn)
        self.history_values.map_batch(fn)
        self.graphs.clear()  # captured over the old buffers
        self._graph_buffers = None
        if not is_torchdynamo_compiling():
            for t in self._buffers():
                torch._dynamo.mark_static_address(t)

    def stored_states(self) -> tuple[torch.Tensor, torch.Tensor]:
        """All stored tokens as rotated dense tensors `[B, H, L, d]` (history dequantized), for inspection."""
        length = int(self.plan.length)
        cfg = self.config
        s = cfg.sink_tokens
        nh = history_rows(length, s, cfg.window_tokens, cfg.demotion_block)
        recent = (torch.arange(s + nh, max(length, s + nh), device=self.device) - s) % self.plan.ring
        parts_k = [self.sink_keys[:, :, : min(length, s)], self.history_keys.dequantize(0, nh, self.dtype),
                   self.ring_keys.index_select(2, recent)]
        parts_v = [self.sink_values[:, :, : min(length, s)], self.history_values.dequantize(0, nh, self.dtype),
                   self.ring_values.index_select(2, recent)]
        return torch.cat(parts_k, 2), torch.cat(parts_v, 2)

    def memory_bytes(self) -> dict[str, int]:
        if not self.is_initialized:
            return {"allocated": 0, "used": 0, "elements": 0, "tokens": 0}
        allocated = sum(t.numel() * t.element_size() for t in self._buffers())
        batch, heads, _, d = self.sink_keys.shape
        tokens = int(self.plan.length)
        return {"allocated": allocated, "used": allocated, "elements": 2 * batch * heads * d * tokens, "tokens": tokens}


class StaticOscarCache(OscarCache):
    """`OscarCache` in fixed buffers for `max_cache_len` tokens: `is_compileable`, so `model.generate` compiles its
    decode step and replays it as a CUDA graph, as it does for `StaticCache`.

    Usage:
        model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="oscar")
        cache = StaticOscarCache(model, OscarRotations.from_pretrained(name), max_cache_len=32768)
        model.generate(**inputs, past_key_values=cache, max_new_tokens=256)

    Same arguments as `OscarCache` (`max_cache_len` required); stores the same thing and attends the same way.
    Sliding-window layers use transformers' `StaticSlidingWindowLayer`. Needs the "oscar" attention and 2 bits.
    """

    def __init__(self, model, rotations, config=None, max_cache_len: int | None = None, allow_other_weights: bool = False):
        if not isinstance(max_cache_len, int) or isinstance(max_cache_len, bool) or max_cache_len < 1:
            raise ValueError(f"StaticOscarCache needs max_cache_len, a positive number of tokens (got {max_cache_len!r})")
        self._static_max_len = max_cache_len
        super().__init__(model, rotations, config, max_cache_len=max_cache_len, allow_other_weights=allow_other_weights)
        if not self.fused_attention and hasattr(model, "config"):
            raise ValueError("StaticOscarCache needs attn_implementation=\"oscar\": load the model with it or call "
                             "model.set_attn_implementation(\"oscar\")")
        self.first_oscar_layer = self.geometry.oscar_layers[0]

    def _make_layers(self, geometry, rotations, config, max_cache_len):
        c = config
        self.plan = DecodePlan(c.sink_tokens, c.window_tokens, c.demotion_block, max_cache_len)
        self.graphs = DecodeGraphs()  # the eager decode's CUDA graphs, one memory pool for all layers
        layers = []
        for i, kind in enumerate(geometry.plan):
            if kind == "oscar":
                layers.append(StaticOscarLayer(*self._layer_arguments(i, rotations, config), plan=self.plan,
                                               graphs=self.graphs,
                                               max_cache_len=max_cache_len,
                                               key_mean=self._local_heads(i, rotations.key_mean(i)),
                                               key_blocks=self._key_blocks(i, rotations, config),
                                               head_bits=self._head_bits(i, rotations, config),
                                               key_wide_channels=self._key_wide_channels(i, rotations, config)))
            else:
                layers.append(StaticSlidingWindowLayer(max_cache_len=max_cache_len,
                                                       sliding_window=geometry.sliding_windows[i]))
        return layers

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        if layer_idx == self.first_oscar_layer:
            self.plan.advance(key_states.shape[2])
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def get_seq_length(self, layer_idx: int = 0):
        return self.plan.length if self.layers[self.first_oscar_layer].is_initialized else 0

    def crop(self, tokens_to_remove: int) -> None:
        """Removes the `-tokens_to_remove` newest tokens (negative argument, as transformers 5.x), exactly: the
        state becomes that of a run which never saw them, as far back as the BF16 ring still holds the recent window
        of the shorter sequence (assisted decoding crops a few tokens); further back is refused."""
        if tokens_to_remove > 0:
            raise ValueError(f"StaticOscarCache.crop takes a negative number of tokens to remove, got {tokens_to_remove}")
        if not self.layers[self.first_oscar_layer].is_initialized:
            return
        length = int(self.plan.length)
        keep = max(0, length + tokens_to_remove)
        c, ring = self.oscar_config, self.plan.ring
        # the recent window of the shorter sequence (attended to, and quantized into key blocks as they complete)
        # must lie in ring slots the removed tokens did not overwrite: always so for up to demotion_block + 1 tokens
        s = c.sink_tokens
        if keep > s and s + history_rows(keep, s, c.window_tokens, c.demotion_block) < length - ring:
            raise ValueError(f"StaticOscarCache cannot crop {length} tokens back to {keep}: its BF16 ring holds the "
                             f"last {ring} tokens, which must cover the shorter sequence's recent window")
        self.plan.set_length(keep)
        for layer in self.layers:
            if not isinstance(layer, StaticOscarLayer):
                layer.crop(tokens_to_remove)
