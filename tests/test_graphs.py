"""`graphs.py` on the CPU: `GraphedCall` and `DecodeGraphs` over a test double of CUDA graphs.

A CUDA graph records the kernels launched between `capture_begin` and `capture_end` with the addresses they read and
write, and `replay` launches them again on those same addresses; capturing runs nothing. `FakeCUDAGraph` does the same
with the aten ops a capture dispatches: it records each op with the very tensors it was called with (its static
inputs, the resident buffers and the outputs it allocated), undoes the capture's writes and poisons what it allocated
(a capture computes nothing), and a replay re-runs the ops in order, writing each fresh result into the tensor the
capture allocated. A host read during capture fails, as a synchronisation does on CUDA. So a graph that is handed new
inputs without copying them into its static ones replays the first call's inputs here as it would on a GPU
(tests/test_gpu_state.py runs real graphs there).
"""

from __future__ import annotations

import contextlib
import types

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from conftest import VOCAB, tiny_model
from oscar_hf import OscarCache, OscarConfig, OscarRotations, cache as cache_module, graphs, ops, positions, storage

# what a CUDA capture cannot do: read a device value on the host
_HOST_READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default,
               torch.ops.aten.masked_select.default, torch.ops.aten.equal.default, torch.ops.aten.is_nonzero.default}


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _mutated(func, args, kwargs) -> list[torch.Tensor]:
    """The tensors an op writes, by its schema (in-place and out= arguments)."""
    written = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        written += [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]
    return written


def _poison(t: torch.Tensor) -> None:
    if t.dtype.is_floating_point or t.dtype.is_complex:
        t.fill_(float("nan"))
    elif t.dtype == torch.bool:
        t.fill_(True)
    else:
        t.fill_(torch.iinfo(t.dtype).max)


class _Recorder(TorchDispatchMode):
    def __init__(self, graph: "FakeCUDAGraph"):
        super().__init__()
        self.graph = graph

    def __torch_dispatch__(self, func, _types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _HOST_READS:
            raise RuntimeError(f"{func}: operation not permitted when stream is capturing")
        for t in _mutated(func, args, kwargs):  # what the capture writes, to be undone at its end
            if not any(t is seen for seen, _ in self.graph.undo):
                self.graph.undo.append((t, t.clone()))
        out = func(*args, **kwargs)
        inputs = {_storage(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        # outputs that alias an input (views, in-place results) are refreshed by re-running the op; the others are
        # buffers the capture allocated, which a replay writes
        fresh = [isinstance(t, torch.Tensor) and t.numel() > 0 and _storage(t) not in inputs for t in tree_leaves(out)]
        self.graph.ops.append((func, args, kwargs, out, fresh))
        return out


class FakeCUDAGraph:
    """`torch.cuda.CUDAGraph`'s capture and replay over the aten ops a capture dispatches (module docstring)."""

    capturing = 0  # captures in progress (`torch.cuda.is_current_stream_capturing`)

    def __init__(self):
        self.ops, self.undo, self.recorder, self.replays = [], [], None, 0

    def capture_begin(self, pool=None):
        assert self.recorder is None and not self.ops, "a graph is captured once"
        self.recorder = _Recorder(self)
        self.recorder.__enter__()
        FakeCUDAGraph.capturing += 1

    def capture_end(self):
        self.recorder.__exit__(None, None, None)
        FakeCUDAGraph.capturing -= 1
        with torch.no_grad():
            for t, before in reversed(self.undo):  # a capture launches nothing: its writes never happened
                t.copy_(before)
            for _, _, _, out, fresh in self.ops:  # ... and what it allocated holds garbage until a replay
                for t, new in zip(tree_leaves(out), fresh):
                    if new:
                        _poison(t)
        self.undo = []

    def replay(self):
        self.replays += 1
        with torch.no_grad():
            for func, args, kwargs, out, fresh in self.ops:
                result = func(*args, **kwargs)
                for t, r, new in zip(tree_leaves(out), tree_leaves(result), fresh):
                    if new:
                        t.copy_(r)


class _FakeStream:
    def wait_stream(self, stream):
        pass


@pytest.fixture
def fake_cuda_graphs(monkeypatch):
    """CUDA graphs, streams and pools as `graphs.py` uses them, on the CPU (FakeCUDAGraph)."""
    made = []

    def new_graph():
        made.append(FakeCUDAGraph())
        return made[-1]

    monkeypatch.setattr(torch.cuda, "CUDAGraph", new_graph)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: object())
    monkeypatch.setattr(torch.cuda, "Stream", _FakeStream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: _FakeStream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: FakeCUDAGraph.capturing > 0)
    return made


def _store_and_sum(x, y, buffer, position):
    """A decode step in miniature: writes x·y at a device-side row of a resident buffer (as the store does), and
    reads the whole buffer (as the attention does)."""
    buffer.index_copy_(0, position, (x * y).unsqueeze(0))
    return buffer.sum(0) + x


def test_the_double_replays_captured_kernels_like_a_cuda_graph(fake_cuda_graphs):
    x, buffer, position = torch.randn(4), torch.zeros(3, 4), torch.tensor([1])
    graph = torch.cuda.CUDAGraph()
    graph.capture_begin()
    out = _store_and_sum(x, x, buffer, position)
    graph.capture_end()
    assert torch.equal(buffer, torch.zeros(3, 4)) and out.isnan().all()  # capturing ran nothing
    graph.replay()
    assert torch.equal(buffer[1], x * x) and torch.equal(out, (x * x) + x)
    x.copy_(torch.randn(4))  # the graph reads its inputs where they lay at capture
    position.fill_(2)
    graph.replay()
    assert torch.equal(buffer[2], x * x) and torch.equal(out, buffer.sum(0) + x)
    graph = torch.cuda.CUDAGraph()
    graph.capture_begin()
    with pytest.raises(RuntimeError, match="capturing"):
        int(position)  # a host read
    graph.capture_end()


def test_graphed_call_replays_each_calls_inputs_like_direct_calls(fake_cuda_graphs):
    """Fresh inputs at new addresses every call (as generate hands each step new q/k/v): each replay gives fn's result
    on them, and writes the resident buffer as fn would."""
    torch.manual_seed(0)
    dg = graphs.DecodeGraphs()
    buffer, position = torch.zeros(6, 5), torch.zeros(1, dtype=torch.long)
    twin_buffer = buffer.clone()
    outs = []
    for step in range(6):
        x, y = torch.randn(5), torch.randn(5)
        position.fill_(step)  # advanced in place, as the position plan is
        got = dg.run(("step",), _store_and_sum, x, y, resident=(buffer, position))
        want = _store_and_sum(x, y, twin_buffer, position)
        assert torch.equal(got, want), step
        assert torch.equal(buffer, twin_buffer), step
        outs.append(got)
    assert all(o is outs[0] for o in outs)  # the graph's own output, overwritten by each replay
    assert dg.stats == {"captures": 1, "replays": 6} and len(fake_cuda_graphs) == 1


def test_graphs_are_keyed_by_key_resident_layouts_and_addresses(fake_cuda_graphs):
    dg = graphs.DecodeGraphs()
    x = torch.randn(5)
    first, second = torch.zeros(6, 5), torch.zeros(6, 5)
    position = torch.zeros(1, dtype=torch.long)
    run = lambda key, buffer: dg.run(key, _store_and_sum, x, x, resident=(buffer, position))  # noqa: E731
    for _ in range(3):
        run("a", first)
    assert dg.stats["captures"] == 1
    run("a", second)  # the same layouts at another address (a grown or reallocated buffer): captured anew
    assert dg.stats["captures"] == 2 and torch.equal(second[0], x * x)
    run("a", torch.zeros(6, 5).t().contiguous().t())  # other strides
    run("b", first)  # another key (the caller's: layer, step kind, input layouts)
    assert dg.stats["captures"] == 4
    run("a", first)
    assert dg.stats["captures"] == 4 and len(dg.calls) == 4
    dg.drop("b")  # one layer's buffers grew: its graphs go, the others' stay
    assert len(dg.calls) == 3 and all(full[0] == "a" for full in dg.calls)
    run("a", first)
    assert dg.stats["captures"] == 4
    pool = dg.pool
    dg.clear()  # e.g. after a batch change: every graph captured over the old buffers goes
    assert not dg.calls and dg.pool is None  # the next capture takes a new pool
    run("a", first)
    assert dg.stats == {"captures": 5, "replays": 9} and dg.pool is not None and dg.pool != pool


def test_key_mask_keeps_its_address_while_it_fits_and_is_refilled_per_mask():
    dg = graphs.DecodeGraphs()
    calls = []

    def key_mask(mask):
        def row():
            calls.append(1)
            return mask[:, 0, -1, :]
        return dg.key_mask(mask, row)

    def mask(b, n, padding=0):
        m = torch.ones(b, 1, 1, n, dtype=torch.bool)
        m[-1, ..., :padding] = False
        return m

    m = mask(2, 5, padding=2)
    buf = key_mask(m)
    assert buf.shape[0] == 2 and buf.shape[1] >= 5 and torch.equal(buf[:, :5], m[:, 0, -1])
    assert key_mask(m) is buf and len(calls) == 1  # every layer of a pass: copied once
    m[0, ..., 1] = False  # written in place: its version moved
    assert key_mask(m).data_ptr() == buf.data_ptr() and torch.equal(buf[:, :5], m[:, 0, -1]) and len(calls) == 2
    capacity, address = buf.shape[1], buf.data_ptr()
    for n in range(6, capacity + 1):  # the next passes' masks, a key longer each: same buffer, refilled
        m = mask(2, n, padding=3)
        assert key_mask(m).data_ptr() == address and torch.equal(buf[:, :n], m[:, 0, -1])
    m = mask(2, capacity + 1, padding=1)  # longer than the buffer: a new one, at least twice as long
    grown = key_mask(m)
    assert grown.data_ptr() != address and grown.shape[1] >= 2 * capacity
    assert torch.equal(grown[:, : capacity + 1], m[:, 0, -1]) and not grown[:, capacity + 1 :].any()
    m = mask(3, 4)  # another batch
    other = key_mask(m)
    assert other.shape[0] == 3 and torch.equal(other[:, :4], m[:, 0, -1])


def test_enabled_only_for_eager_kernel_steps_on_cuda(monkeypatch, fake_cuda_graphs):
    cuda = types.SimpleNamespace(is_cuda=True)  # stands in for a CUDA tensor (enabled reads .is_cuda)
    monkeypatch.delenv("OSCAR_HF_EAGER_GRAPHS", raising=False)
    assert graphs.enabled(cuda, True)
    assert not graphs.enabled(torch.zeros(1), True)  # the CPU
    assert not graphs.enabled(cuda, False)  # the twins (no kernels)
    graph = torch.cuda.CUDAGraph()
    graph.capture_begin()
    assert not graphs.enabled(cuda, True)  # someone else is capturing
    graph.capture_end()
    monkeypatch.setenv("OSCAR_HF_EAGER_GRAPHS", "0")
    assert not graphs.enabled(cuda, True)
    monkeypatch.setenv("OSCAR_HF_EAGER_GRAPHS", "1")
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)  # a compiled step is graphed as a whole
    assert not graphs.enabled(cuda, True)


NEW = 13  # tokens generated: the history grows three times (8 -> 12 -> 16 -> 20 rows), the key mask once


def _generate(model, rot, config, ids, mask):
    cache = OscarCache(model, rot, config)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=NEW, min_new_tokens=NEW,
                             do_sample=False, pad_token_id=0, return_dict_in_generate=True, output_logits=True)
    return out.sequences, torch.stack(out.logits, 1), cache


def test_an_oscar_decode_step_replays_like_its_launches(monkeypatch, fake_cuda_graphs):
    """Greedy generate through OscarCache with each layer's decode step (store, then attend) replayed from the double
    gives the tokens, logits and stored states of the same steps called directly: new q/k/v each step, the key mask
    read in place (left padding), and the history growing (graphs captured anew over its new buffers).

    The step runs the twins that a graph can replay (device-side rows and lengths, as the kernels read them): the
    CPU's eager twins read them on the host, which a capture refuses."""
    token_rows = positions.PositionPlan.token_rows
    monkeypatch.setattr(positions.PositionPlan, "token_rows", lambda self, host: token_rows(self, False))
    monkeypatch.setattr(ops, "decode_attention_host", ops.decode_attention_reference)
    monkeypatch.setattr(cache_module, "_INITIAL_ROWS", 8)
    monkeypatch.setattr(storage, "_MIN_GROWTH", 1)
    model = tiny_model("llama", num_hidden_layers=1)  # one layer: the double replays op by op in Python
    rot = OscarRotations.data_free(model, "hadamard")
    config = OscarConfig(sink_tokens=4, window_tokens=8, demotion_block=4, key_block=4, value_clip=0.95)
    ids = torch.randint(4, VOCAB, (2, 10), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    want_ids, want_logits, want = _generate(model, rot, config, ids, mask)
    assert not want.graphs.stats
    monkeypatch.setattr(graphs, "enabled", lambda x, kernels: True)
    got_ids, got_logits, got = _generate(model, rot, config, ids, mask)
    assert got.graphs.stats["replays"] == NEW - 1  # every decode step
    assert got.graphs.stats["captures"] >= 4  # the first step, and again after each growth
    assert torch.equal(got_ids, want_ids) and torch.equal(got_logits, want_logits)
    for i in got.geometry.oscar_layers:
        for a, b in zip(got.layers[i].stored_states(), want.layers[i].stored_states()):
            assert torch.equal(a, b), i
