"""CUDA graphs for the eager decode step of a static cache.

Without `torch.compile` a decode step is bound by host work (eval/KERNEL_NOTES.md): each OSCAR layer makes several
Triton launches from Python, and Triton binds and specializes every argument of every launch. A `StaticOscarLayer`'s
single-token store and attention read fixed buffers and device-side lengths only, so each can be captured once as a
CUDA graph and replayed.

A graph is keyed by what it captured: the inputs' shapes, dtypes and strides, the non-tensor arguments, and the
addresses of the buffers it reads and writes (a layer whose buffers were replaced, e.g. by a batch change, captures
anew). Under that key a graph reads its inputs in one of two ways:

- direct: where the inputs lay when it was captured. An eager step allocates the same tensors in the same order
  every step, so the caching allocator mostly hands the model's q/k/v the same addresses again; a call whose inputs
  are at a captured graph's addresses replays it with no copy. Up to `DIRECT` address sets are captured per key.
- copied: from its own static copies, which a call fills first (one device copy per input): for every other call.

`OSCAR_HF_EAGER_GRAPHS=0` turns this off; it is off on the CPU, under dynamo (a compiled step is graphed as a whole)
and while someone else is capturing.
"""

from __future__ import annotations

import os
from collections import Counter
from typing import Callable

import torch

DIRECT = 2  # input address sets captured as direct graphs per key, before calls fall back to copying their inputs


def enabled(x: torch.Tensor, kernels: bool) -> bool:
    """Whether an eager call on `x`'s device replays captured graphs (`kernels`: the layer runs the Triton kernels)."""
    return (kernels and x.is_cuda and os.environ.get("OSCAR_HF_EAGER_GRAPHS", "1") != "0"
            and not torch.compiler.is_compiling() and not torch.cuda.is_current_stream_capturing())


class GraphedCall:
    """`fn(*inputs)` captured as a CUDA graph; a call replays it and returns the graph's own output.

    copied=True: the graph reads static copies of `inputs`, which each call fills from its arguments. copied=False:
    it reads the memory `inputs` occupy now, and may be called only with arguments at those very addresses (and
    layouts): `DecodeGraphs.run` checks that. No reference to them is kept, so the allocator may hand that memory
    to the next step's inputs.

    `fn` must give the same result when run twice on equal inputs (it runs once as the warm-up on a side stream,
    which also compiles and loads its kernels, and then once per replay) and must read everything else from
    tensors whose addresses stay fixed. The output is overwritten by the next replay: callers consume it first.
    """

    def __init__(self, fn: Callable, inputs: tuple[torch.Tensor, ...], pool, copied: bool):
        captured = [x.clone() for x in inputs] if copied else list(inputs)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn(*captured)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.output = fn(*captured)
        self.inputs = captured if copied else None

    def __call__(self, *inputs: torch.Tensor):
        if self.inputs is not None:
            for dst, src in zip(self.inputs, inputs):
                dst.copy_(src)
        self.graph.replay()
        return self.output


class DecodeGraphs:
    """The captured decode graphs of one static cache, sharing one memory pool (they replay one after another).

    `stats` counts replays by kind ("direct", "copied") and "captures", for benchmarks."""

    def __init__(self):
        self.calls: dict[tuple, dict] = {}  # key -> {input addresses: direct GraphedCall, None: the copied one}
        self.pool = None
        self.stats: Counter = Counter()

    def run(self, key: tuple, fn: Callable, *inputs: torch.Tensor):
        """`fn(*inputs)` by replaying a graph captured under `key` (captured now if none fits)."""
        graphs = self.calls.setdefault(key, {})
        where = addresses(*inputs)
        call = graphs.get(where)
        if call is None:
            direct = len(graphs) - (None in graphs) < DIRECT
            where = where if direct else None
            call = graphs.get(where)
            if call is None:
                if self.pool is None:
                    self.pool = torch.cuda.graph_pool_handle()
                call = graphs[where] = GraphedCall(fn, inputs, self.pool, copied=not direct)
                self.stats["captures"] += 1
        self.stats["copied" if where is None else "direct"] += 1
        return call(*inputs)

    def clear(self) -> None:
        self.calls.clear()


def signature(*tensors: torch.Tensor | None) -> tuple:
    """What a graph over these tensors depends on: shape, dtype and strides of each (None stays None)."""
    return tuple(None if t is None else (tuple(t.shape), t.dtype, t.stride()) for t in tensors)


def addresses(*tensors: torch.Tensor | None) -> tuple:
    return tuple(None if t is None else t.data_ptr() for t in tensors)
