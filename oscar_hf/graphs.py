"""CUDA graphs for the eager decode step of a static cache.

Without `torch.compile` a decode step is bound by host work (eval/KERNEL_NOTES.md): each OSCAR layer makes several
Triton launches from Python, and Triton binds and specializes every argument of every launch. A `StaticOscarLayer`'s
single-token store and attention read fixed buffers and device-side lengths only, so each can be captured once as a
CUDA graph and replayed: the host then copies the step's new tensors into the graph's inputs and launches the graph.

A graph is keyed by what it captured: the inputs' shapes, dtypes and strides, the non-tensor arguments, and the
addresses of the buffers it reads and writes (a layer whose buffers were replaced, e.g. by a batch change, captures
anew). `OSCAR_HF_EAGER_GRAPHS=0` turns this off; it is off on the CPU, under dynamo (a compiled step is graphed as
a whole) and while someone else is capturing.
"""

from __future__ import annotations

import os
from typing import Callable

import torch


def enabled(x: torch.Tensor, kernels: bool) -> bool:
    """Whether an eager call on `x`'s device replays captured graphs (`kernels`: the layer runs the Triton kernels)."""
    return (kernels and x.is_cuda and os.environ.get("OSCAR_HF_EAGER_GRAPHS", "1") != "0"
            and not torch.compiler.is_compiling() and not torch.cuda.is_current_stream_capturing())


class GraphedCall:
    """`fn(*inputs)` captured as a CUDA graph over static copies of `inputs`; a call copies new inputs in and replays.

    `fn` must give the same result when run twice on equal inputs (it runs once as the warm-up on a side stream,
    which also compiles and loads its kernels, and then once per replay) and must read everything else from
    tensors whose addresses stay fixed. The returned tensor is the graph's own output buffer: the next replay
    overwrites it, so callers copy what they keep.
    """

    def __init__(self, fn: Callable, inputs: tuple[torch.Tensor, ...], pool):
        self.inputs = [x.clone() for x in inputs]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn(*self.inputs)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.output = fn(*self.inputs)

    def __call__(self, *inputs: torch.Tensor):
        for dst, src in zip(self.inputs, inputs):
            dst.copy_(src)
        self.graph.replay()
        return self.output


class DecodeGraphs:
    """The captured decode graphs of one static cache, sharing one memory pool (they replay one after another)."""

    def __init__(self):
        self.calls: dict[tuple, GraphedCall] = {}
        self.pool = None

    def run(self, key: tuple, fn: Callable, *inputs: torch.Tensor):
        """`fn(*inputs)` by replaying the graph captured under `key` (captured now if there is none)."""
        call = self.calls.get(key)
        if call is None:
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            call = self.calls[key] = GraphedCall(fn, inputs, self.pool)
        return call(*inputs)

    def clear(self) -> None:
        self.calls.clear()


def signature(*tensors: torch.Tensor | None) -> tuple:
    """What a graph over these tensors depends on: shape, dtype and strides of each (None stays None)."""
    return tuple(None if t is None else (tuple(t.shape), t.dtype, t.stride()) for t in tensors)


def addresses(*tensors: torch.Tensor | None) -> tuple:
    return tuple(None if t is None else t.data_ptr() for t in tensors)
