"""CUDA graphs for the eager decode step of an OSCAR cache (static or dynamic).

Without `torch.compile` a decode step is bound by host work (docs/research-log.md, "Eager decode and CUDA graphs"):
each OSCAR layer makes several Triton launches from Python, and Triton binds and specializes every argument of every
launch. A layer's single-token step, storing the token and attending (`attention.decode_attention`), reads fixed
buffers and device-side lengths only, so it can be captured once as one CUDA graph and replayed.

A graph is keyed by what it captured: the inputs' shapes, dtypes and strides, the non-tensor arguments, and the
addresses of the buffers it reads and writes (a layer whose buffers were replaced, e.g. by a batch change, captures
anew). It reads its inputs from its own static copies, which a call fills first (one `_foreach_copy_`). (Graphs
that read the inputs where they lay at capture, for calls whose q/k/v come back at those addresses, were dropped:
through `generate` no call ever did, and each cost a capture per layer; docs/research-log.md, "Eager decode and
CUDA graphs".)

`OSCAR_HF_EAGER_GRAPHS=0` turns this off; it is off on the CPU, under dynamo (a compiled step is graphed as a whole)
and while someone else is capturing.
"""

from __future__ import annotations

import os
from collections import Counter
from typing import Callable

import torch


def enabled(x: torch.Tensor, kernels: bool) -> bool:
    """Whether an eager call on `x`'s device replays captured graphs (`kernels`: the layer runs the Triton kernels)."""
    return (kernels and x.is_cuda and os.environ.get("OSCAR_HF_EAGER_GRAPHS", "1") != "0"
            and not torch.compiler.is_compiling() and not torch.cuda.is_current_stream_capturing())


class GraphedCall:
    """`fn(*inputs, *resident)` captured as a CUDA graph; a call replays it and returns the graph's own output.

    The graph reads static copies of `inputs`, which each call fills from its arguments (same layouts).
    `resident` tensors are read where they lie: buffers whose address is part of the graph's key.

    `fn` must give the same result when run twice on equal inputs (it runs once as the warm-up on a side stream,
    which also compiles and loads its kernels, and then once per replay) and must read everything else from
    tensors whose addresses stay fixed. The output is overwritten by the next replay: callers consume it first.
    """

    def __init__(self, fn: Callable, inputs: tuple[torch.Tensor, ...], resident: tuple[torch.Tensor, ...], pool,
                 stream):
        captured = [x.clone() for x in inputs]
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn(*captured, *resident)
            self.graph = torch.cuda.CUDAGraph()
            # capture_begin/end rather than `torch.cuda.graph`, which first synchronizes the device and empties the
            # allocator's cache: milliseconds per capture, and a new cache captures every layer in its first steps
            self.graph.capture_begin(pool)
            try:
                self.output = fn(*captured, *resident)
            finally:
                self.graph.capture_end()
        torch.cuda.current_stream().wait_stream(stream)
        self.inputs = captured

    def __call__(self, *inputs: torch.Tensor):
        torch._foreach_copy_(self.inputs, list(inputs))  # one launch where the inputs share a dtype
        self.graph.replay()
        return self.output


class DecodeGraphs:
    """The captured decode graphs of one cache, sharing one memory pool (they replay one after another), and the
    key mask they read in place.

    `stats` counts "replays" and "captures", for benchmarks."""

    def __init__(self):
        self.calls: dict[tuple, GraphedCall] = {}
        self.pool = None
        self.stream = None  # every capture and its warm-up run on this side stream, into `pool`
        self.stats: Counter = Counter()
        self._mask: torch.Tensor | None = None  # [B, capacity] bool
        self._mask_source: tuple | None = None  # (the attention mask it holds, its version)

    def run(self, key: tuple, fn: Callable, *inputs: torch.Tensor, resident: tuple[torch.Tensor, ...] = ()):
        """`fn(*inputs, *resident)` by replaying a graph captured under `key` and the layouts and addresses of
        `resident` (captured now if none fits)."""
        full = (key, signature(*resident), addresses(*resident))
        call = self.calls.get(full)
        if call is None:
            if self.stream is None:
                self.stream = torch.cuda.Stream()
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            call = self.calls[full] = GraphedCall(fn, inputs, resident, self.pool, self.stream)
            self.stats["captures"] += 1
        self.stats["replays"] += 1
        return call(*inputs)

    def key_mask(self, attention_mask: torch.Tensor, row: Callable[[], torch.Tensor]) -> torch.Tensor:
        """The keys each sequence may see, `row()` `[B, N]` bool, in a buffer `[B, C]` (C >= N) that keeps its address
        while it fits, so that a graph reads it in place: copied once per `attention_mask` (every layer of a pass
        gets the same one), and reallocated, at least twice as long, when a longer mask or another batch comes."""
        source = (attention_mask, attention_mask._version)
        if self._mask_source is not None and self._mask_source[0] is source[0] and self._mask_source[1] == source[1]:
            return self._mask
        keys = row()
        b, n = keys.shape
        if self._mask is None or self._mask.shape[0] != b or self._mask.shape[1] < n:
            grown = 2 * self._mask.shape[1] if self._mask is not None and self._mask.shape[0] == b else 0
            self._mask = torch.zeros(b, max(n, grown), dtype=torch.bool, device=keys.device)
        self._mask[:, :n].copy_(keys)
        self._mask_source = source
        return self._mask

    def clear(self) -> None:
        self.drop(None, every=True)

    def drop(self, owner, every: bool = False) -> None:
        """Drops the graphs whose key begins with `owner` (one layer's, captured over buffers it replaced), or all.
        Once none is left, the next capture takes a new memory pool: the allocator refuses captures into a pool whose
        graphs are all gone while blocks of it (a graph's output) are still alive."""
        for full in [full for full in self.calls if every or full[0][0] == owner]:
            del self.calls[full]
        if not self.calls:
            self.pool = None


def signature(*tensors: torch.Tensor | None) -> tuple:
    """What a graph over these tensors depends on: shape, dtype and strides of each (None stays None)."""
    return tuple(None if t is None else (tuple(t.shape), t.dtype, t.stride()) for t in tensors)


def addresses(*tensors: torch.Tensor | None) -> tuple:
    return tuple(None if t is None else t.data_ptr() for t in tensors)
