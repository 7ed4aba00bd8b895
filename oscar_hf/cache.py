"""`OscarCache` and `StaticOscarCache`: `transformers.Cache`s whose full-attention layers store keys and values as

    [ sink (first `sink_tokens`, BF16) | history (2-bit, packed) | recent window (BF16) ]

all rotated (k·R_K, v·R_V). Both caches are the same `OscarLayer`s over one `positions.PositionPlan`: the dynamic
one grows its history as tokens arrive; the static one allocates it once for `max_cache_len` tokens, so that
`model.generate` compiles its decode step and replays it as a CUDA graph (as it does for transformers' `StaticCache`).
They store the same bytes and attend the same way.

A layer holds state and never does attention math. With `attn_implementation="oscar"`, `update` hands the
registered attention function (`attention.py`) what to read, through the kwargs dict transformers gives both the
cache update and the attention call; with any other attention, `update` returns the stored past dequantized and
un-rotated, so that sdpa/eager attention gives the same result (slowly, like transformers' `QuantizedCache`).

The tokens of one forward pass attend to each other exactly (full precision, as a BF16 prefill would) and to earlier
tokens as the cache stores them. With key means in the rotations (`CalibrationConfig.center_keys`), every key is
stored as k − μ: attention is unchanged, since softmax ignores the per-query shift q·μ.
"""

from __future__ import annotations

import operator
import sys
import warnings
from dataclasses import dataclass
from typing import Callable

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicSlidingWindowLayer, StaticSlidingWindowLayer

from . import graphs, ops
from .config import OscarConfig
from .format import LayerFormat, resolve
from .models import attention_without_cache_kwargs, check_attention_interface, kv_head_shards, text_config
from .ops import DecodeBuffers, Segments
from .positions import PositionPlan
from .quant import dequantize
from .rotation import rotate
from .rotations_io import OscarRotations
from .storage import LayerStorage

ATTENTION_NAME = "oscar"
# The key under which a layer's update hands the attention call what to read: transformers (>= 5.24) passes one
# kwargs dict to both `cache.update(..., kwargs=kwargs)` and the attention function (`**kwargs`).
VIEW_KWARG = "oscar_view"
_INITIAL_ROWS = 1024  # first history capacity of a growable layer


@dataclass
class ChunkView:
    """What the attention reads for a pass of `chunk_length` tokens after `past_length` stored ones.

    `past_length == 0`: the chunk attends only to itself: `original_keys/values` `[B, H, n, d]` hold it un-rotated
    (the attention is plain sdpa, exactly a BF16 prefill). Otherwise `segments` hold the past as stored (rotated)
    and the chunk itself as `extra`, exact."""

    layer: "OscarLayer"
    past_length: int
    chunk_length: int
    batch: int
    segments: Segments | None = None
    original_keys: torch.Tensor | None = None
    original_values: torch.Tensor | None = None


@dataclass
class DecodeView:
    """A single-token step: the attention reads the layer's whole buffers with the lengths on the device.

    `pending`: the step's keys and values `[B, H, 1, d]` when the update left storing them to the attention call
    (eager steps), so that an eager CUDA step replays one graph per layer (store, then attend) instead of two."""

    layer: "OscarLayer"
    chunk_length: int
    batch: int
    pending: tuple[torch.Tensor, torch.Tensor] | None = None


def check_finite(key_states: torch.Tensor, value_states: torch.Tensor, layer: int, first: bool) -> None:
    """Refuses NaN/Inf states: on every eager multi-token pass, and on every eager step on the CPU (on a GPU a
    per-token check would cost a synchronisation, and compiled code cannot branch on it). Checked before the pass is
    counted: refused at the `first` OSCAR layer, the cache is as it was; at a later one, earlier layers hold the
    pass."""
    if torch.compiler.is_compiling() or (key_states.shape[2] == 1 and key_states.device.type != "cpu"):
        return
    if not (torch.isfinite(key_states).all() and torch.isfinite(value_states).all()):
        raise ValueError(
            f"OscarCache received NaN or Inf key/value states at layer {layer}: the model produced non-finite "
            "activations (with float16, overflow is a common cause; try bfloat16)"
            + ("" if first else "; earlier layers stored this pass: reset() the cache"))


def _outside_compiled_code(fn: Callable, reason: str) -> Callable:
    """`fn`, which torch.compile never traces: a compiled caller runs it eagerly (fullgraph=True: refused, with
    `reason`)."""
    try:
        return torch.compiler.disable(fn, reason=reason)
    except TypeError:  # torch < 2.8 takes no reason
        return torch.compiler.disable(fn)


class OscarLayer(CacheLayerMixin):
    """The cache of one full-attention layer: BF16 sink | quantized history | BF16 recent window, all rotated.

    Args:
        fmt: what this layer stores (`format.LayerFormat`).
        key_rotation, value_rotation: `[H, d, d]` orthogonal (float32; cast to the model dtype on first use).
        key_mean: `[H, d]` key mean subtracted from every incoming key before storage, or None.
        plan: the cache's shared `PositionPlan` (advanced by the cache before the first OSCAR layer's update).
        decode_graphs: the cache's eager decode CUDA graphs (`graphs.py`).
    """

    is_compileable = False
    is_sliding = False
    is_croppable = True

    def __init__(self, fmt: LayerFormat, key_rotation: torch.Tensor, value_rotation: torch.Tensor,
                 key_mean: torch.Tensor | None, plan: PositionPlan, decode_graphs: graphs.DecodeGraphs):
        super().__init__()
        heads, d = fmt.heads, fmt.head_dim
        for name, t, shape in (("key_rotation", key_rotation, (heads, d, d)), ("value_rotation", value_rotation,
                                                                               (heads, d, d)), ("key_mean", key_mean, (heads, d))):
            if t is not None and tuple(t.shape) != shape:
                raise ValueError(f"OscarLayer: {name} has shape {tuple(t.shape)}, expected {shape} for {heads} KV "
                                 f"heads of dim {d}")
        self.fmt, self.plan, self.graphs = fmt, plan, decode_graphs
        self._masters = (key_rotation, value_rotation, key_mean)
        self.storage = LayerStorage(fmt, plan.sink, plan.ring)
        self.key_rotation = self.value_rotation = self.key_mean = None
        self.kernel = False
        self._graph_key = None

    def __repr__(self):
        return f"{type(self).__name__}(heads={self.fmt.heads}, bits={self.fmt.bits}, capacity={self.storage.capacity})"

    # ------------------------------------------------------------------ buffers
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Rotations on the states' device and dtype, and zero-filled buffers for the states' batch."""
        _, heads, _, d = key_states.shape
        if (heads, d) != (self.fmt.heads, self.fmt.head_dim):
            raise ValueError(f"OscarLayer got keys with {heads} KV heads of dim {d}, but its rotations are for "
                             f"{self.fmt.heads} heads of dim {self.fmt.head_dim}: wrong rotation file for this model?")
        self.device, self.dtype = key_states.device, key_states.dtype
        key_rotation, value_rotation, key_mean = self._masters
        self.key_rotation = key_rotation.to(self.device, self.dtype)
        self.value_rotation = value_rotation.to(self.device, self.dtype)
        self.key_mean = None if key_mean is None else key_mean.to(self.device, torch.float32)[None, :, None, :]
        self.plan.initialize(self.device)
        fixed, block = self.plan.max_length, self.plan.block
        capacity = -(-max(fixed - self.plan.sink, 1) // block) * block if fixed is not None else _INITIAL_ROWS
        self.storage.allocate(key_states, capacity)
        self.kernel = ops.use_kernels(key_states, self.fmt)
        if self.kernel:
            ops.make_kernel_tables(self.fmt, self.device)
        for history in (self.storage.keys, self.storage.values):
            history.kernel = self.kernel
        self._graph_key = None
        self.is_initialized = True
        if self.is_compileable and not torch.compiler.is_compiling():
            for t in self.storage.buffers() + self._constants():
                torch._dynamo.mark_static_address(t)

    def _constants(self) -> list[torch.Tensor]:
        """Tensors a decode step reads but never writes, marked static like the buffers: a CUDA graph would otherwise
        copy each into its input pool on every replay."""
        return [t for t in (self.key_rotation, self.value_rotation, self.key_mean) if t is not None]

    @property
    def batch_size(self) -> int:
        return self.storage.sink_keys.shape[0] if self.is_initialized else 0

    # ------------------------------------------------------------------ update
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, fused: bool = False,
               attention_kwargs: dict | None = None, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """Stores `key_states`/`value_states` `[B, H, n, d]` (post-RoPE) and returns what attention needs.

        fused (attention "oscar", and `attention_kwargs`, the dict transformers also passes to the attention call):
        returns the new states as they are and puts a view for the attention call into `attention_kwargs`.
        Otherwise: returns the stored past dequantized and un-rotated, followed by the exact new states,
        `[B, H, past + n, d]` (keys centered, if the cache centers them: the same attention)."""
        fused = fused and attention_kwargs is not None
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[2]
        if n == 1:
            if not self.is_compileable:
                self._reserve(self.plan.host_length)
            view = DecodeView(self, 1, key_states.shape[0])
            if fused and not torch.compiler.is_compiling():
                view.pending = (key_states, value_states)  # the attention call stores them (one graph on CUDA)
            else:
                self._decode_call("store", self._store_token, key_states, value_states)
        else:
            key_states = self.centered(key_states)
            self._reserve(self.plan.host_length)
            view = self._store_chunk(key_states, value_states, view=True)
        if fused:
            attention_kwargs[VIEW_KWARG] = view
            return key_states, value_states
        return self._dequantized_with(view, key_states, value_states)

    def store(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Stores a chunk as `update` would, preparing nothing for an attention call (filling a cache from another
        cache's prefill: `OscarCache.store`)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._reserve(self.plan.host_length)
        self._store_chunk(self.centered(key_states), value_states, view=False)

    def centered(self, keys: torch.Tensor) -> torch.Tensor:
        """`keys` minus the layer's key mean (subtracted in float32, then one rounding to the model dtype)."""
        if self.key_mean is None:
            return keys
        return (keys.float() - self.key_mean).to(keys.dtype)

    def _reserve(self, length: int | None) -> None:
        """History rows for `length` tokens (growable layers; a fixed one was allocated for max_cache_len)."""
        if length is not None and length - self.plan.sink > self.storage.capacity:
            self.storage.grow(length - self.plan.sink)
            self.graphs.drop(self._graph_key)  # this layer's graphs captured its old buffers; the others' stay
            self._graph_key = None

    def _store_token(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """One token, rotated into its sink or ring slot on the device (fixed shapes, no branch, no synchronisation:
        what a compiled step or a captured graph replays), then into the history rows it brings."""
        plan, st = self.plan, self.storage
        rk, rv = ops.rotate_store_token(self.centered(keys), values, self.key_rotation, self.value_rotation,
                                        st.sink_keys, st.sink_values, st.ring_keys, st.ring_values, plan.start,
                                        plan.sink, plan.ring, kernel=self.kernel).unbind(0)
        # the token's history row and the first row of the key block it completes (-1: none), as ints where the host
        # knows them (eager, on the twins: only the writes that are due run), else on the device (branch-free writes)
        row, key_block = plan.token_rows(host=not (self.kernel or torch.compiler.is_compiling()))
        st.values.write_at(rv, row)
        if self.fmt.keys.channelwise:
            st.keys.write_at(st.ring_keys, key_block, ring=plan.ring)  # quantized from the ring in place
        else:
            st.keys.write_at(rk, row)

    def _store_chunk(self, keys: torch.Tensor, values: torch.Tensor, view: bool) -> ChunkView | None:
        """Several tokens, with the positions on the host. Returns the attention view, made before the ring slots of
        the past are overwritten: the chunk attends to the past as stored and to itself exactly."""
        plan, st = self.plan, self.storage
        s, r = plan.sink, plan.ring
        l0, n = plan.host_start, keys.shape[2]
        l1 = l0 + n
        rk, rv = rotate(keys, self.key_rotation), rotate(values, self.value_rotation)
        nh0, nh1 = plan.history_rows(l0), plan.history_rows(l1)
        out = self._chunk_view(l0, nh1, keys, values, rk, rv) if view else None
        ns = max(0, min(s, l1) - l0)
        st.sink_keys[:, :, l0 : l0 + ns] = rk[:, :, :ns]
        st.sink_values[:, :, l0 : l0 + ns] = rv[:, :, :ns]
        # every token beyond the sink has a history row: values (and token-wise keys) are quantized on arrival
        first = max(l0, s)
        if l1 > first:
            st.values.write(rv[:, :, first - l0 :], first - s)
            if not self.fmt.keys.channelwise:
                st.keys.write(rk[:, :, first - l0 :], first - s)
        # channel-wise key blocks completed by this chunk: positions [s + nh0, s + nh1), from the ring and the chunk
        if self.fmt.keys.channelwise and nh1 > nh0:
            lo = s + nh0
            split = max(lo, min(l0, s + nh1))  # [lo, split) are past tokens, in the ring
            old = st.ring_keys.index_select(2, plan.slots(lo, split, keys.device))
            st.keys.write(torch.cat([old, rk[:, :, max(lo, l0) - l0 : max(s + nh1 - l0, 0)]], dim=2), nh0)
        # ring: the newest tokens beyond the sink (at most R of them matter)
        ring_first = max(first, l1 - r)
        if l1 > ring_first:
            slots = plan.slots(ring_first, l1, keys.device)
            st.ring_keys.index_copy_(2, slots, rk[:, :, ring_first - l0 :])
            st.ring_values.index_copy_(2, slots, rv[:, :, ring_first - l0 :])
        return out

    def _chunk_view(self, l0: int, nh1: int, keys, values, rk, rv) -> ChunkView:
        """Past = sink | history (as stored after this chunk, up to the past's end) | the rest of the past, from the
        ring; then the chunk itself, exact."""
        view = ChunkView(self, l0, keys.shape[2], keys.shape[0])
        if l0 == 0:
            view.original_keys, view.original_values = keys, values
            return view
        st, s = self.storage, self.plan.sink
        nh = max(0, min(nh1, l0 - s))
        slots = self.plan.slots(s + nh, max(l0, s + nh), rk.device)
        view.segments = Segments(st.sink_keys[:, :, : min(l0, s)], st.sink_values[:, :, : min(l0, s)],
                                 st.keys.packed(0, nh), st.values.packed(0, nh), st.ring_keys.index_select(2, slots),
                                 st.ring_values.index_select(2, slots), rk, rv)
        return view

    def _dequantized_with(self, view, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The non-fused return: the past as the fused attention would read it, dequantized and un-rotated, then the
        exact new states (a decode step's key centered, as the stored one is)."""
        if isinstance(view, DecodeView):  # the past as the decode step reads it: the stored state, less this token
            past_keys, past_values = (t[:, :, :-1] for t in self.stored_states())
            keys = self.centered(keys)
        elif view.segments is None:
            return keys, values
        else:
            seg = view.segments
            past_keys = torch.cat([seg.sink_keys, dequantize(seg.history_keys, self.dtype), seg.recent_keys], 2)
            past_values = torch.cat([seg.sink_values, dequantize(seg.history_values, self.dtype), seg.recent_values], 2)
        rt_k, rt_v = self.key_rotation.transpose(-1, -2), self.value_rotation.transpose(-1, -2)
        return (torch.cat([rotate(past_keys, rt_k), keys], dim=2), torch.cat([rotate(past_values, rt_v), values], dim=2))

    def decode_buffers(self) -> DecodeBuffers:
        st, s, r = self.storage, self.plan.sink, self.plan.ring
        return DecodeBuffers(st.sink_keys[:, :, :s], st.sink_values[:, :, :s], st.keys.codes, st.keys.meta,
                             st.values.codes, st.values.meta, st.ring_keys[:, :, :r], st.ring_values[:, :, :r])

    def uses_graphs(self, x: torch.Tensor) -> bool:
        """Whether this layer's single-token steps on `x` replay CUDA graphs (eager, on CUDA, with the kernels)."""
        return graphs.enabled(x, self.kernel)

    def _decode_call(self, name: str, fn: Callable, *inputs: torch.Tensor, static: tuple = (),
                     resident: tuple[torch.Tensor, ...] = (), graphed: bool | None = None):
        """`fn(*inputs, *resident)`, a single-token step's store and/or attention: in an eager CUDA step replayed as a
        CUDA graph (`graphs.py`; keyed by the inputs' layouts, the `static` arguments, this layer's buffer addresses
        and `resident`'s, which it reads in place), else called. `graphed`: `uses_graphs(inputs[0])`, where the
        caller has it already. A tensor result from a graph is the graph's output buffer, valid until this layer's
        next decode step replays it (the attention's caller, the model's o_proj, consumes it at once)."""
        if not (self.uses_graphs(inputs[0]) if graphed is None else graphed):
            return fn(*inputs, *resident)
        if self._graph_key is None:  # reset wherever the buffers are replaced (initialization, growth, batch changes)
            self._graph_key = (id(self), graphs.addresses(*self.storage.buffers(), *self._constants(),
                                                          *self.plan.tensors()))
        return self.graphs.run((self._graph_key, name, static, graphs.signature(*inputs)), fn, *inputs,
                               resident=resident)

    # ------------------------------------------------------------------ reading
    def stored_states(self, length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The first `length` stored tokens (default: all) as rotated dense tensors `[B, H, length, d]` in the model
        dtype, the history dequantized (with key means, the keys are (k − μ)·R)."""
        plan, st = self.plan, self.storage
        length = plan.current_length() if length is None else length
        s = plan.sink
        nh = plan.history_rows(length)
        slots = plan.slots(s + nh, max(length, s + nh), self.device)
        keys = torch.cat([st.sink_keys[:, :, : min(length, s)], st.keys.dequantize(0, nh, self.dtype),
                          st.ring_keys.index_select(2, slots)], 2)
        values = torch.cat([st.sink_values[:, :, : min(length, s)], st.values.dequantize(0, nh, self.dtype),
                            st.ring_values.index_select(2, slots)], 2)
        return keys, values

    # ------------------------------------------------------------------ CacheLayerMixin contract
    def get_seq_length(self):
        if not self.is_initialized:
            return 0
        return self.plan.length if self.is_compileable else self.plan.current_length()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # A static cache's decode steps keep one mask shape (compiled steps, CUDA graphs). An eager multi-token pass
        # gets a mask over the keys it sees, as a dynamic cache's: a fresh prefill without padding then gets none at
        # all, and sdpa its causal flash kernel instead of a materialized [T, max_cache_len] mask.
        if self.is_compileable and (query_length == 1 or torch.compiler.is_compiling() or self.plan.host_length is None):
            return self.plan.max_length, 0
        return (self.plan.current_length() if self.is_initialized else 0) + query_length, 0

    def get_max_length(self) -> int:
        return -1 if self.plan.max_length is None else self.plan.max_length

    def get_max_cache_shape(self) -> int:
        return self.get_max_length()

    def reset(self) -> None:
        pass  # the cache resets its plan; the buffers are overwritten as tokens arrive

    def restore_window(self, positions: list[int]) -> None:
        """Writes `positions` (ascending, recent again after a crop, their ring slots overwritten by later tokens)
        back into their ring slots from the history, as it stores them."""
        if not positions or not self.is_initialized:
            return
        plan, st = self.plan, self.storage
        rows = torch.tensor(positions, device=self.device) - plan.sink
        lo, hi = positions[0] - plan.sink, positions[-1] - plan.sink + 1
        k0 = lo // st.keys.fmt.chunk * st.keys.fmt.chunk  # channel-wise keys dequantize from a chunk's first row
        keys = st.keys.dequantize(k0, hi, self.dtype).index_select(2, rows - k0)
        values = st.values.dequantize(lo, hi, self.dtype).index_select(2, rows - lo)
        slots = rows % plan.ring
        st.ring_keys.index_copy_(2, slots, keys)
        st.ring_values.index_copy_(2, slots, values)

    def crop(self, tokens_to_remove: int) -> None:
        raise RuntimeError("the OSCAR layers of a cache share one length: crop the cache (cache.crop), not a layer")

    def activate_past_recording(self) -> None:
        pass  # the ring keeps the recent past exactly; the cache's crop says how far back that reaches

    def _map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        if self.is_initialized:
            self.storage.map_batch(fn)
            self.graphs.clear()
            self._graph_key = None
            if self.is_compileable and not torch.compiler.is_compiling():
                for t in self.storage.buffers():
                    torch._dynamo.mark_static_address(t)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam reordering in place (the buffers keep their addresses)."""
        if self.is_initialized:
            self.storage.copy_batch_(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_batch(lambda t: t[indices.to(t.device) if isinstance(indices, torch.Tensor) else indices])

    def offload(self):
        raise RuntimeError(f"{type(self).__name__} does not support CPU offloading: the cache is already compressed")

    def prefetch(self):
        raise RuntimeError(f"{type(self).__name__} does not support CPU offloading")

    # ------------------------------------------------------------------ accounting
    def memory_bytes(self) -> dict[str, int]:
        """Bytes allocated and bytes holding stored tokens, and the K+V elements those tokens represent."""
        if not self.is_initialized:
            return {"allocated": 0, "used": 0, "elements": 0, "tokens": 0}
        st, plan = self.storage, self.plan
        tokens = plan.current_length()
        n_sink, n_hist, n_recent = plan.counts(tokens)
        windows = (st.sink_keys, st.sink_values, st.ring_keys, st.ring_values)
        allocated = sum(t.numel() * t.element_size() for t in windows) + st.keys.nbytes() + st.values.nbytes()
        per_token = st.sink_keys[:, :, :1].numel() * st.sink_keys.element_size() * 2
        used = per_token * (n_sink + n_recent) + st.keys.nbytes(n_hist) + st.values.nbytes(n_hist)
        batch, heads, _, d = st.sink_keys.shape
        return {"allocated": allocated, "used": used, "elements": 2 * batch * heads * d * tokens, "tokens": tokens}


class StaticOscarLayer(OscarLayer):
    """An `OscarLayer` whose buffers are allocated once for the cache's `max_cache_len` and never move: what a
    compiled decode step (and its CUDA graph) needs."""

    is_compileable = True


class OscarCache(Cache):
    """KV cache storing full-attention layers with OSCAR (BF16 sink | 2-bit rotated history | BF16 recent window).

    Usage:
        model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="oscar")
        cache = OscarCache(model, OscarRotations.from_pretrained(model))
        model.generate(**inputs, cache=cache)

    Sliding-window layers (e.g. Gemma 3's local layers) keep transformers' bounded BF16 window. `StaticOscarCache`
    stores the same in fixed buffers, for a compiled, CUDA-graph decode step.

    Args:
        model: the model (or its config) the cache is for; rotations are validated against it.
        rotations: calibrated `OscarRotations` (or `OscarRotations.data_free(...)` for baselines).
        config: what to store (`OscarConfig`); default: the defaults in the storage layout the rotations were
            calibrated for (`rotations.layout`), without clips if the rotations carry none (data-free rotations).
        max_cache_len: the most tokens the cache holds (allocated up front; more is an error). None: unbounded.
        allow_other_weights: accept rotations whose weight fingerprint differs from the model's (a warning instead
            of `RotationFileError`).
    """

    layer_class = OscarLayer
    sliding_layer_class = DynamicSlidingWindowLayer
    needs_fused_attention = False  # whether only the "oscar" attention can read it (it also dequantizes for others)

    def __init__(self, model, rotations: OscarRotations, config: OscarConfig | None = None,
                 max_cache_len: int | None = None, allow_other_weights: bool = False):
        model_config = getattr(model, "config", model)
        if hasattr(model, "config"):
            check_attention_interface(model)
        if not isinstance(rotations, OscarRotations):
            raise TypeError(f"{type(self).__name__} needs OscarRotations, got {type(rotations).__name__}")
        if config is not None and not isinstance(config, OscarConfig):
            raise TypeError(f"{type(self).__name__}: config must be an OscarConfig (or None), got {type(config).__name__}"
                            + (" (OscarConfig.from_dict makes one from a dict)" if isinstance(config, dict) else ""))
        if max_cache_len is not None and (isinstance(max_cache_len, bool) or not isinstance(max_cache_len, int)
                                          or max_cache_len < 1):
            raise ValueError(f"max_cache_len must be a positive number of tokens, got {max_cache_len!r}")
        geometry = rotations.validate_for(model_config)
        if hasattr(model, "named_parameters"):  # rotations calibrated on other weights of the same shapes
            rotations.check_fingerprint(model, strict=not allow_other_weights)
        if config is None:  # the layout the rotations and clips were fitted for (no clip where none was fitted)
            config = OscarConfig(**{k: v for k, v in rotations.layout.items() if k != "key_block_allocation"},
                                 key_clip="fitted" if rotations.key_clips else "none",
                                 value_clip="fitted" if rotations.value_clips else "none")
        else:
            _warn_layout_differs(config, rotations)
        config.check_head_dim(geometry.head_dim)
        self._text_config = text_config(model_config)
        self.oscar_config, self.rotations, self.geometry = config, rotations, geometry
        # tensor parallelism: each rank's layers hold their own KV heads, with those heads' rotations and key means
        self.kv_head_shards = (kv_head_shards(model, geometry.head_dim, geometry.num_key_value_heads)
                               if hasattr(model, "named_modules") else {})
        self.formats = resolve(config, rotations, geometry, self.kv_head_shards)
        self.plan = PositionPlan(config.sink_tokens, config.window_tokens, config.demotion_block, max_cache_len)
        self.graphs = graphs.DecodeGraphs()  # the eager decode steps' CUDA graphs, one memory pool for all layers
        self.first_oscar_layer = geometry.oscar_layers[0]
        super().__init__(layers=[self._make_layer(i, kind, max_cache_len) for i, kind in enumerate(geometry.plan)])

    def _make_layer(self, i: int, kind: str, max_cache_len: int | None) -> CacheLayerMixin:
        if kind != "oscar":
            window = self.geometry.sliding_windows[i]
            if self.sliding_layer_class is StaticSlidingWindowLayer:
                return StaticSlidingWindowLayer(max_cache_len=max_cache_len, sliding_window=window)
            return DynamicSlidingWindowLayer(sliding_window=window)
        fmt, r = self.formats[i], self.rotations
        heads = slice(fmt.first_head, fmt.first_head + fmt.heads)
        mean = r.key_mean(i)
        return self.layer_class(fmt, r.key_rotations[i][heads], r.value_rotations[i][heads],
                                None if mean is None else mean[heads], self.plan, self.graphs)

    @property
    def fused_attention(self) -> bool:
        """True when the model runs the registered "oscar" attention (reads packed segments directly)."""
        return getattr(self._text_config, "_attn_implementation", None) == ATTENTION_NAME

    @property
    def _is_user_defined(self) -> bool:
        return getattr(self, "_user_defined", False)

    @_is_user_defined.setter
    def _is_user_defined(self, value: bool) -> None:
        """`generate` marks a cache it was given, once per call, before any step runs: the moment to check, on the
        host, that the call fits the cache (a device-side overflow inside a CUDA graph would end the process's CUDA
        context), to read the token count on the host, and to allocate a static cache's buffers outside any compiled
        code. transformers keeps the call's cache size, batch size and model in the caller's locals
        (`max_cache_length`, `batch_size`, `self`)."""
        self._user_defined = value
        caller = sys._getframe(1).f_locals
        if self.layers[self.first_oscar_layer].is_initialized:
            self.plan.current_length()  # the host learns L (compiled steps keep it on the device) for the prefill
        elif self.layer_class.is_compileable:
            self._allocate_for_generate(caller.get("self"), caller.get("batch_size"), caller.get("generation_config"))
        needed = caller.get("max_cache_length")
        if self.plan.max_length is not None and isinstance(needed, int) and needed > self.plan.max_length:
            raise ValueError(f"{type(self).__name__} holds max_cache_len={self.plan.max_length} tokens, but this "
                             f"generate call may store {needed} (prompt + max_new_tokens): create it with a larger "
                             "max_cache_len")

    def _allocate_for_generate(self, model, batch_size, generation_config) -> None:
        """Every layer's buffers for the batch `generate` will run (expanded for beams and returned sequences),
        on the model's one device, before its first pass: allocated inside a compiled forward
        (`model.forward = torch.compile(...)`), they would be outputs of its CUDA graph, overwritten by the next
        replay. Nothing where the model spans several devices (the first update allocates each layer's)."""
        if not isinstance(batch_size, int) or not hasattr(model, "device") or not hasattr(model, "dtype") or \
                len(set(getattr(model, "hf_device_map", {}).values())) > 1:
            return
        expand = max(getattr(generation_config, "num_beams", 1) or 1,
                     getattr(generation_config, "num_return_sequences", 1) or 1)
        geometry = self.geometry
        for i, layer in enumerate(self.layers):
            heads = self.kv_head_shards.get(i, (0, geometry.num_key_value_heads))[1]
            empty = torch.zeros(batch_size * expand, heads, 0, geometry.head_dim, dtype=model.dtype,
                                device=model.device)
            if not layer.is_initialized and layer.supports_early_init:
                layer.lazy_initialization(empty, empty)

    def _begin_pass(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int) -> None:
        """At the first layer of a forward pass: a pass that would overflow max_cache_len is refused before any layer
        is written, and a new batch size after `reset` re-initialises every layer; at the first OSCAR layer: the plan
        advances by the pass's tokens."""
        if not 0 <= layer_idx < len(self.layers):
            raise ValueError(f"{type(self).__name__} has {len(self.layers)} layers, for the model it was built for; "
                             f"got layer {layer_idx}: build a cache for the model that uses it")
        if isinstance(self.layers[layer_idx], OscarLayer):
            check_finite(key_states, value_states, layer_idx, first=layer_idx == self.first_oscar_layer)
        if torch.compiler.is_compiling():
            if key_states.is_cuda and not self.layers[layer_idx].is_initialized:
                raise ValueError(f"a compiled forward would allocate the {type(self).__name__}'s buffers inside its "
                                 "CUDA graphs, which overwrite them: run it through model.generate (which allocates "
                                 "them first) or call cache.early_initialization(batch_size, num_heads, head_dim, "
                                 "dtype, device) before it")
            if not self.layer_class.is_compileable:  # its growth happens on the host, which a compiled pass skips
                raise ValueError(f"{type(self).__name__} cannot be traced by torch.compile (its history grows on the "
                                 "host): a compiled forward takes StaticOscarCache(model, rotations, max_cache_len=...)")
            if key_states.shape[2] > 1 and self.plan.host_length is None:
                raise ValueError(f"a multi-token pass of a compiled forward needs the {type(self).__name__}'s token "
                                 "count on the host, which compiled decode steps keep on the device: run it through "
                                 "model.generate (which reads the count first) or reset() the cache")
        if layer_idx == 0:
            tokens, limit = key_states.shape[2], self.plan.max_length
            # (not under compile: there the length lives on the device, and generate checked the call on the host)
            if limit is not None and not torch.compiler.is_compiling() and (
                    tokens > 1 or self.plan.host_length is not None):
                length = self.plan.current_length()
                if length + tokens > limit:
                    raise ValueError(f"the cache holds max_cache_len={limit} tokens; this pass would store "
                                     f"{length + tokens}: create it with a larger max_cache_len")
            batch = next((l.batch_size if isinstance(l, OscarLayer) else l.keys.shape[0] for l in self.layers
                          if l.is_initialized and (isinstance(l, OscarLayer) or l.keys is not None)), None)
            if batch is not None and batch != key_states.shape[0]:
                if self.plan.host_length != 0:
                    raise ValueError(f"this cache holds a batch of {batch} sequences, not {key_states.shape[0]}: "
                                     "reset() it (or make a new one) for another batch")
                for layer in self.layers:
                    layer.is_initialized = False
        if layer_idx == self.first_oscar_layer:
            self.plan.advance(key_states.shape[2])

    def _update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        attention_kwargs = kwargs.get("kwargs")  # transformers >= 5.24: the dict the attention call receives
        attention_kwargs = attention_kwargs if isinstance(attention_kwargs, dict) else None
        fused = self.fused_attention
        if self.needs_fused_attention and not fused and attention_kwargs is not None:
            # another attention's mask covers max_cache_len positions and the keys only those stored: it would fail
            # deep inside torch
            raise ValueError(f"{type(self).__name__} needs attn_implementation=\"oscar\", but the model now runs "
                             f"{getattr(self._text_config, '_attn_implementation', None)!r}: call "
                             "model.set_attn_implementation(\"oscar\") or use OscarCache")
        self._begin_pass(key_states, value_states, layer_idx)
        layer = self.layers[layer_idx]
        if isinstance(layer, OscarLayer):
            return layer.update(key_states, value_states, fused=fused, attention_kwargs=attention_kwargs)
        return layer.update(key_states, value_states, *args, **kwargs)

    # A compiled forward (`model.forward = torch.compile(model.forward)`) runs a growable cache's update eagerly (a graph
    # break: its history grows on the host); under fullgraph=True that is an error naming the reason.
    update = _outside_compiled_code(_update, "OscarCache grows its history on the host: a compiled forward takes "
                                             "StaticOscarCache(model, rotations, max_cache_len=...)")

    def store(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int) -> None:
        """Stores states `[B, H, n, d]` into layer `layer_idx` exactly as `update` would, for callers that run no
        attention afterwards (filling a cache from another cache's prefill, layer by layer)."""
        self._begin_pass(key_states, value_states, layer_idx)
        layer = self.layers[layer_idx]
        if isinstance(layer, OscarLayer):
            layer.store(key_states, value_states)
        else:
            layer.update(key_states, value_states)

    def get_seq_length(self, layer_idx: int = 0):
        return self.layers[self.first_oscar_layer].get_seq_length()

    def crop(self, tokens_to_remove: int) -> None:
        """Removes the `-tokens_to_remove` newest tokens (negative argument, as transformers 5.x). The state becomes
        that of a cache never given them, except for recent tokens whose ring slots later tokens overwrote (a token
        R = window_tokens + 2·demotion_block or more positions later was stored after it): those come back to the
        BF16 window as the history stored them. There are none while the sequence stays within demotion_block + 1
        tokens of the longest it has been since the last reset (assisted decoding). Sliding-window layers must
        support the rollback."""
        try:
            tokens_to_remove = operator.index(tokens_to_remove)
        except TypeError:
            raise TypeError(f"{type(self).__name__}.crop takes a whole number of tokens, got {tokens_to_remove!r}") from None
        if tokens_to_remove > 0:
            raise ValueError(f"{type(self).__name__}.crop takes a negative number of tokens to remove, got "
                             f"{tokens_to_remove} (the positive absolute-length form is deprecated in transformers 5.x)")
        if tokens_to_remove == 0 or not self.layers[self.first_oscar_layer].is_initialized:
            return
        stuck = [i for i, l in enumerate(self.layers) if not isinstance(l, OscarLayer) and not l.is_croppable]
        if stuck:
            raise ValueError(f"{type(self).__name__} cannot crop: its sliding-window layers {stuck} no longer hold the "
                             "tokens a rollback needs (transformers' static sliding windows keep only the window)")
        for i, layer in enumerate(self.layers):
            if isinstance(layer, DynamicSlidingWindowLayer) and layer.is_initialized and layer.keys is not None:
                # transformers' layer keeps its last w − 1 tokens, or every token since the last crop while it records
                # the past; a crop of r needs w − 1 + r of them, else it silently keeps fewer
                held, seen, window = layer.keys.shape[-2], layer.get_seq_length(), layer.sliding_window
                if seen >= window and held < min(seen, window - 1 + -tokens_to_remove):
                    raise ValueError(f"{type(self).__name__} cannot remove {-tokens_to_remove} tokens: sliding-window "
                                     f"layer {i} holds only its last {held} (crop after each forward pass, as "
                                     "assisted decoding does)")
        length = self.plan.current_length()
        keep = max(0, length + tokens_to_remove)
        for layer in self.layers:  # sliding layers first: they may refuse, and then nothing has changed
            if not isinstance(layer, OscarLayer):
                layer.crop(tokens_to_remove)
        lost = self.plan.rollback(keep)
        for layer in self.layers:
            if isinstance(layer, OscarLayer):
                layer.restore_window(lost)

    def reset(self) -> None:
        super().reset()
        self.plan.reset()

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._check_batch_change("batch_repeat_interleave")
        super().batch_repeat_interleave(repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._check_batch_change("batch_select_indices")
        super().batch_select_indices(indices)

    def _check_batch_change(self, name: str) -> None:
        """Refuses a batch change that some layer cannot make, before any layer changes."""
        stuck = [i for i, layer in enumerate(self.layers) if not hasattr(layer, name)]
        if stuck:
            raise ValueError(f"{type(self).__name__} cannot change its batch size: its sliding-window layers {stuck} "
                             f"({type(self.layers[stuck[0]]).__name__}) have no {name}; use OscarCache")

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return self.get_max_length(layer_idx)

    def memory_report(self) -> dict:
        """Bytes really allocated by the cache and bits per stored K/V element, against a BF16 `DynamicCache`.

        `bits_per_element` covers the OSCAR layers (sink + history + ring, metadata and spare capacity included);
        `bits_per_element_used` only the bytes holding tokens; `compression` compares all layers (sliding windows
        included) with what a BF16 DynamicCache would hold.
        """
        allocated = used = elements = 0
        sliding_bytes = 0
        for layer in self.layers:
            if isinstance(layer, OscarLayer):
                m = layer.memory_bytes()
                allocated, used, elements = allocated + m["allocated"], used + m["used"], elements + m["elements"]
            elif layer.is_initialized and layer.keys is not None:
                sliding_bytes += sum(t.numel() * t.element_size() for t in (layer.keys, layer.values))
        bf16_bytes = 2 * elements + sliding_bytes
        total = allocated + sliding_bytes
        oscar = len(self.geometry.oscar_layers)
        return {
            "tokens": self.plan.current_length() if self.layers[self.first_oscar_layer].is_initialized else 0,
            "oscar_layers": oscar,
            "sliding_layers": len(self.layers) - oscar,
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


class StaticOscarCache(OscarCache):
    """`OscarCache` in fixed buffers for `max_cache_len` tokens: `is_compileable`, so `model.generate` compiles its
    decode step and replays it as a CUDA graph, as it does for `StaticCache` (on a CUDA device; elsewhere it runs
    eagerly, and is no faster than `OscarCache`).

    Usage:
        model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="oscar")
        cache = StaticOscarCache(model, OscarRotations.from_pretrained(model), max_cache_len=32768)
        model.generate(**inputs, cache=cache, max_new_tokens=256)

    Same arguments as `OscarCache`, `max_cache_len` required. Sliding-window layers use transformers'
    `StaticSlidingWindowLayer`. Needs the "oscar" attention.
    """

    layer_class = StaticOscarLayer
    sliding_layer_class = StaticSlidingWindowLayer
    needs_fused_attention = True
    update = OscarCache._update  # traced by a compiled forward or decode step

    def __init__(self, model, rotations, config=None, max_cache_len: int | None = None,
                 allow_other_weights: bool = False):
        if max_cache_len is None:
            raise ValueError("StaticOscarCache needs max_cache_len, a positive number of tokens")
        super().__init__(model, rotations, config, max_cache_len=max_cache_len, allow_other_weights=allow_other_weights)
        if self.needs_fused_attention and not self.fused_attention and hasattr(model, "config"):
            raise ValueError("StaticOscarCache needs attn_implementation=\"oscar\": load the model with it or call "
                             "model.set_attn_implementation(\"oscar\")")
        attention = attention_without_cache_kwargs(model) if hasattr(model, "named_modules") else None
        if attention is not None:
            raise ValueError(f"StaticOscarCache needs an attention that hands cache.update its kwargs, and {attention} "
                             "does not (the \"oscar\" attention would get no stored history): use OscarCache, which "
                             "returns the history dequantized to this model's attention")


def _warn_layout_differs(config: OscarConfig, rotations: OscarRotations) -> None:
    """Warns when a config's storage layout is not the one the rotations (key bases, clips, per-head key blocks) were
    calibrated for."""
    differs = {k: (getattr(config, k), v) for k, v in rotations.layout.items()
               if k != "key_block_allocation" and getattr(config, k) != v}
    if differs and config.bits < 16 and not rotations.metadata.get("method", {}).get("data_free"):
        warnings.warn(
            "OscarCache: the config's storage layout differs from the one these rotations were calibrated for ("
            + ", ".join(f"{k}={a!r} vs {b!r}" for k, (a, b) in differs.items()) + "): key bases and clips were fitted "
            "for the file's layout"
            + ("; the file's per-head key blocks, allocated for its key_block and demotion_block, are not used "
               "(config.key_block everywhere)" if rotations.key_blocks and {"key_block", "demotion_block"} & set(differs)
               else ""), RuntimeWarning, stacklevel=3)
