"""Both caches against the oracle (tests/oracle.py) on random operation sequences, with hypothesis' stateful testing:
prefill chunks of boundary sizes, single tokens (eager, and through the branch-free path a compiled step traces),
growth past capacity, crops deep and shallow, regrowth, reset, another batch size, beam reorders, batch repeats and
selections, and left padding; in the default layout (per-head key blocks, a wide head, wide key channels, clips,
key means) and the paper's (token-wise keys), with and without sliding-window layers. After every operation every
layer's stored state (sink | dequantized history | window; a sliding layer's tokens) is bit-identical to the
oracle's; every pass's attention output (or the dequantized states a non-"oscar" attention gets) agrees with eager
attention over what the oracle says is stored, to float32 rounding.

CI runs a fixed-seed set of sequences (`derandomize`); a longer, random run is one command:

    OSCAR_HF_STATE_EXAMPLES=2000 OSCAR_HF_STATE_SEED=random pytest tests/test_cache_state_machine.py

A failure is shrunk to a short sequence of operations and printed as a reproducible program.
"""

from __future__ import annotations

import os
from contextlib import contextmanager, nullcontext
from functools import lru_cache

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition, rule,
                                 run_state_machine_as_test)

from conftest import tiny_model
from oracle import OracleLayer, OracleSlidingLayer, Spec
from oscar_hf import OscarCache, OscarConfig, OscarRotations, StaticOscarCache
from oscar_hf import cache as cache_module
from oscar_hf import storage as storage_module
from oscar_hf.attention import oscar_attention_forward

S, W, B = 4, 8, 8  # sink, window, demotion block
R = W + 2 * B  # ring slots
MAX_LEN = 160  # StaticOscarCache's max_cache_len
EXAMPLES = int(os.environ.get("OSCAR_HF_STATE_EXAMPLES", "50"))  # sequences per configuration
SEED = os.environ.get("OSCAR_HF_STATE_SEED", "fixed")


# --------------------------------------------------------------------------------------------- the configurations
def _orthogonal(g, h, d):
    return torch.linalg.qr(torch.randn(h, d, d, generator=g, dtype=torch.float64))[0].float()


@lru_cache(maxsize=None)
def _setup(layout: str, family: str):
    """(model, rotations, config, {layer: Spec}) of a tiny model (2 KV heads of dim 16) in one of the layouts users
    run: "default" (calibrated refinements: per-head key blocks, a wide head, wide key channels, value clips, key
    means) or "paper" (token-wise keys in groups of 8 channels, clipped, with key means)."""
    model = tiny_model(family, attn="oscar")
    base = OscarRotations.data_free(model, "hadamard")
    layers = base.layers
    heads, d = model.config.num_key_value_heads, model.config.head_dim
    common = dict(sink=S, window=W, block=B)
    if layout == "default":
        kinds = [((8, 4), (2, 4), (3, 0), 0.75), ((4, 8), (2, 2), (0, 5), 0.9), ((8, 8), (4, 2), (0, 8), 1.0)]
        per_layer = {i: kinds[j % 3] for j, i in enumerate(layers)}
        blocks, bits, wide, clips = ({i: k[n] for i, k in per_layer.items()} for n in range(4))
        config = OscarConfig(sink_tokens=S, window_tokens=W, demotion_block=B, key_block=B, value_clip="fitted")
        specs = {i: Spec(heads, d, "channel", blocks[i], bits[i], wide[i], value_clip=clips[i], **common)
                 for i in layers}
        file = dict(key_blocks=blocks, head_bits=bits, key_wide_channels=wide, value_clips=clips,
                    layout=dict(key_granularity="channel", demotion_block=B, key_block=B,
                                key_block_allocation="fitted"))
    else:
        key_clips = {i: (0.8, 0.95)[j % 2] for j, i in enumerate(layers)}
        value_clips = {i: (0.75, 1.0)[j % 2] for j, i in enumerate(layers)}
        config = OscarConfig(sink_tokens=S, window_tokens=W, demotion_block=B, key_granularity="token", group_size=8,
                             key_clip="fitted", value_clip="fitted")
        specs = {i: Spec(heads, d, "token", key_clip=key_clips[i], value_clip=value_clips[i], group=8, **common)
                 for i in layers}
        file = dict(key_clips=key_clips, value_clips=value_clips,
                    layout=dict(key_granularity="token", demotion_block=B, key_block=B, key_block_allocation="uniform"))
    g = torch.Generator().manual_seed(0)
    rotations = OscarRotations(
        base.geometry, {i: _orthogonal(g, heads, d) for i in layers}, {i: _orthogonal(g, heads, d) for i in layers},
        key_means={i: 2 * torch.randn(heads, d, generator=g) for i in layers}, metadata=base.metadata, **file)
    return model, rotations, config, specs


@contextmanager
def _traced_as_compiled():
    """What a compiled decode step runs: the code as dynamo traces it (`torch.compiler.is_compiling()` true: positions
    from the plan's device tensors, branch-free writes, no host synchronisation), executed eagerly."""
    real = torch.compiler.is_compiling
    torch.compiler.is_compiling = lambda: True
    try:
        yield
    finally:
        torch.compiler.is_compiling = real


def _reference_attention(q, keys, values, pads, past, scale):
    """Eager causal attention in float64 over un-rotated `keys`/`values` `[B, H, N, d]` for `q` `[B, Hq, n, d]` at
    positions past.., left padding `pads` `[B]` masked; `[B, n, Hq, d]` and the rows that see a key `[B, n]`."""
    group = q.shape[1] // keys.shape[1]
    k, v = keys.double().repeat_interleave(group, 1), values.double().repeat_interleave(group, 1)
    qpos, kpos = past + torch.arange(q.shape[2]), torch.arange(k.shape[2])
    allowed = (kpos[None, None, None, :] <= qpos[None, None, :, None]) & (kpos >= pads[:, None])[:, None, None, :]
    scores = (q.double() @ k.transpose(-1, -2) * scale).masked_fill(~allowed, float("-inf"))
    out = torch.nan_to_num(scores.softmax(-1)) @ v
    return out.transpose(1, 2), qpos[None, :] >= pads[:, None]


# --------------------------------------------------------------------------------------------- the state machine
class CacheMachine(RuleBasedStateMachine):
    """One cache and the oracle, driven layer by layer as a model drives them (`cache.update(..., kwargs=...)` then
    the attention call); random keys, values and queries for every pass."""

    cache_class: type = OscarCache
    layout, family = "default", "llama"

    def __init__(self):
        super().__init__()
        self.model, rotations, config, specs = _setup(self.layout, self.family)
        self.static = self.cache_class is StaticOscarCache
        kw = {"max_cache_len": MAX_LEN} if self.static else {}
        self.cache = self.cache_class(self.model, rotations, config, **kw)
        self.cache.activate_past_recording()  # as assisted decoding does: sliding layers keep what a crop needs
        cfg = self.model.config
        means = rotations.key_means
        self.oracle = [OracleLayer(rotations.key_rotations[i], rotations.value_rotations[i], means[i], specs[i])
                       if kind == "oscar" else OracleSlidingLayer(cfg.sliding_window, record_past=True)
                       for i, kind in enumerate(self.cache.geometry.plan)]
        self.sliding = [i for i, kind in enumerate(self.cache.geometry.plan) if kind != "oscar"]
        self.heads, self.q_heads, self.d = cfg.num_key_value_heads, cfg.num_attention_heads, cfg.head_dim
        self.batch, self.pads = 1, torch.zeros(1, dtype=torch.long)

    @property
    def length(self) -> int:
        return self.oracle[self.cache.first_oscar_layer].length

    # ------------------------------------------------------------------ one forward pass
    def _pass(self, n: int, how: str, seed: int, compiled: bool = False) -> None:
        """Every layer stores n tokens of batch `self.batch` and attends (`how`: "fused", the "oscar" attention reading
        the cache's view; "dequantized", what any other attention gets back; "store", `cache.store` with no attention)."""
        g = torch.Generator().manual_seed(seed)
        past, b, h, d = self.length, self.batch, self.heads, self.d
        states = [(2 * torch.randn(b, h, n, d, generator=g), 2 * torch.randn(b, h, n, d, generator=g),
                   torch.randn(b, self.q_heads, n, d, generator=g)) for _ in self.oracle]
        if self.static and past + n > MAX_LEN and not compiled:  # refused before any layer is written
            with pytest.raises(ValueError, match="max_cache_len"):
                self.cache.update(states[0][0], states[0][1], 0, kwargs={})
            return
        with _traced_as_compiled() if compiled else nullcontext():
            for i, (keys, values, query) in enumerate(states):
                self._layer_pass(i, keys, values, query, past, how)

    def _layer_pass(self, i, keys, values, query, past, how):
        oracle = self.oracle[i]
        if how == "store":
            self.cache.store(keys, values, i)
            oracle.update(keys, values)
            return
        kwargs = {} if how == "fused" else None
        got = self.cache.update(keys, values, i, kwargs=kwargs)
        want = oracle.update(keys, values)
        if i in self.sliding:
            if not self.static:  # transformers' layer: the last w - 1 tokens and the new ones, exact
                assert all(torch.equal(x, y) for x, y in zip(got, want)), i
            return
        scale = self.d ** -0.5
        ref, rows = _reference_attention(query, *want, self.pads, past, scale)
        if how == "fused":
            n = keys.shape[2]
            width = MAX_LEN if self.static else past + n
            positions = torch.arange(width)
            mask = ((positions[None, None, None, :] <= past + torch.arange(n)[None, None, :, None])
                    & (positions >= self.pads[:, None])[:, None, None, :])
            out, _ = oscar_attention_forward(self.model.model.layers[i].self_attn, query, *got, mask,
                                             scaling=scale, **kwargs)
        else:  # the past as stored, un-rotated: the same attention up to the rotation's rounding
            for x, y in zip(got, want):
                assert x.shape == y.shape and (x - y).abs().max() <= 1e-5 * y.abs().max(), i
            out, _ = _reference_attention(query, *got, self.pads, past, scale)
        err = (out.double() - ref)[rows].abs().max() if rows.any() else 0.0
        assert err <= 1e-5 * ref[rows].abs().max(), (i, how, float(err))

    # ------------------------------------------------------------------ operations
    def _boundary_sizes(self) -> list[int]:
        """Pass sizes that end at or next to a token count where the state changes: the sink filled, a demotion, the
        ring wrapped, the history's capacity (of a growable cache) reached."""
        length = self.length
        targets = [S, S + W + B] + [S + W + k * B for k in range(2, 12)]
        layer = self.cache.layers[self.cache.first_oscar_layer]
        if layer.is_initialized:
            targets.append(S + layer.storage.capacity)
        sizes = {t - length + e for t in targets for e in (-1, 0, 1)} | {R, R + 1, 2 * R + 3, W + B}
        return sorted(s for s in sizes if 2 <= s <= 3 * R)

    @initialize(data=st.data())
    def prefill(self, data):
        """Every sequence begins with a prompt."""
        self.chunk(data)

    @rule(data=st.data())
    def chunk(self, data):
        """A multi-token pass (a prefill, a chunk of one, a verification pass of assisted decoding)."""
        if self.length == 0:  # a new sequence: its batch size and left padding
            batch = data.draw(st.sampled_from([1, 2]), label="batch")
            self.begin(batch, data.draw(st.integers(0, 3), label="pad") if batch == 2 else 0)
        n = data.draw(st.one_of(st.sampled_from(self._boundary_sizes()), st.integers(2, 40)), label="tokens")
        how = data.draw(st.sampled_from(["fused", "store"] if self.static else ["fused", "dequantized", "store"]),
                        label="how")
        self._pass(n, how, data.draw(st.integers(0, 2**16), label="seed"))

    @precondition(lambda self: self.length > 0)
    @rule(data=st.data())
    def tokens(self, data):
        """Single-token steps (decoding), eager or as a compiled step runs them (the static cache)."""
        length = self.length
        to_demotion = next(S + W + k * B - length for k in range(1, 10**6) if S + W + k * B > length)
        count = data.draw(st.one_of(st.integers(1, B + 2), st.just(to_demotion)), label="count")
        compiled = self.static and length + count <= MAX_LEN and data.draw(st.booleans(), label="compiled")
        how = "fused" if self.static else data.draw(st.sampled_from(["fused", "dequantized"]), label="how")
        self.decode(count, how, data.draw(st.integers(0, 2**16), label="seed"), compiled)

    @precondition(lambda self: self.length > 0)
    @rule(data=st.data())
    def crop(self, data):
        """Removes the newest tokens (assisted decoding's rollback: a few; a rewind: many)."""
        length = self.length
        remove = data.draw(st.one_of(st.sampled_from([1, 2, B - 1, B, B + 1, B + 2, R - 1, R, R + 1]),
                                     st.integers(1, length)), label="remove")
        self.do_crop(min(length, remove))

    @rule()
    def reset(self):
        self.do_reset()

    @precondition(lambda self: self.length > 0 and self.batch == 2)
    @rule(beam=st.sampled_from([[1, 0], [0, 0], [1, 1]]))
    def reorder(self, beam):
        """Beam search's reorder, in place."""
        index = torch.tensor(beam)
        self.cache.reorder_cache(index)
        self._map_batch(lambda t: t[index])

    @precondition(lambda self: self.length > 0 and self.batch == 1)
    @rule()
    def repeat(self):
        """One sequence becomes two (generate's expansion for several returned sequences)."""
        if self._batch_fixed("batch_repeat_interleave"):
            return
        self.cache.batch_repeat_interleave(2)
        self._map_batch(lambda t: t.repeat_interleave(2, dim=0))

    @precondition(lambda self: self.length > 0 and self.batch == 2)
    @rule(row=st.sampled_from([0, 1]))
    def select(self, row):
        """One sequence of two is kept."""
        if self._batch_fixed("batch_select_indices"):
            return
        self.cache.batch_select_indices(torch.tensor([row]))
        self._map_batch(lambda t: t[[row]])

    # ------------------------------------------------------------------ the operations, by value
    def begin(self, batch: int, pad: int = 0) -> None:
        """The batch size of a new sequence, and the left padding of its second row."""
        assert self.length == 0
        self.batch, self.pads = batch, torch.tensor([0, pad][:batch])

    def decode(self, count: int, how: str, seed: int, compiled: bool = False) -> None:
        for t in range(count):
            self._pass(1, how, seed + t, compiled)

    def do_crop(self, remove: int) -> None:
        refused = any(self.static or not self.oracle[i].can_crop(remove) for i in self.sliding)
        if refused:  # the sliding layers cannot roll back that far: refused, nothing changes
            with pytest.raises(ValueError, match="crop|remove"):
                self.cache.crop(-remove)
            return
        self.cache.crop(-remove)
        for layer in self.oracle:
            layer.crop(remove)

    def do_reset(self) -> None:
        self.cache.reset()
        for layer in self.oracle:
            layer.reset()

    def _batch_fixed(self, name: str) -> bool:
        """transformers' static sliding-window layers cannot change their batch: the cache refuses, and nothing
        changes."""
        if not (self.static and self.sliding):
            return False
        with pytest.raises(ValueError, match="cannot change its batch size"):
            getattr(self.cache, name)(2 if name == "batch_repeat_interleave" else torch.tensor([0]))
        return True

    def _map_batch(self, fn):
        for layer in self.oracle:
            layer.map_batch(fn)
        self.pads = fn(self.pads)
        self.batch = self.pads.shape[0]

    # ------------------------------------------------------------------ the invariant
    @invariant()
    def stored_states_equal_the_oracle(self):
        length = self.length
        assert int(self.cache.get_seq_length()) == length
        for i, (layer, oracle) in enumerate(zip(self.cache.layers, self.oracle)):
            if i in self.sliding:
                if not self.static and oracle.length:
                    want = oracle.stored()
                    assert torch.equal(layer.keys, want[0]) and torch.equal(layer.values, want[1]), i
                continue
            if not length:
                continue
            storage = layer.storage
            assert storage.keys.capacity == storage.values.capacity >= length - S, i  # every row written fits
            got, want = layer.stored_states(length), oracle.stored()  # (length given: no host synchronisation)
            for x, y in zip(got, want):
                assert x.shape == y.shape and torch.equal(x, y), (i, [p for p in range(length)
                                                                     if not torch.equal(x[:, :, p], y[:, :, p])])


# --------------------------------------------------------------------------------------------- the runs
@pytest.fixture(autouse=True)
def _small_growth_steps(monkeypatch):
    """A growable cache starts with one demotion block of history and grows by a few rows: sequences of a few
    hundred tokens cross several growths."""
    monkeypatch.setattr(cache_module, "_INITIAL_ROWS", B)
    monkeypatch.setattr(storage_module, "_MIN_GROWTH", 4)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: one thread is faster
    yield
    torch.set_num_threads(threads)


CONFIGURATIONS = [
    (OscarCache, "default", "llama"),
    (StaticOscarCache, "default", "llama"),
    (OscarCache, "paper", "llama"),
    (StaticOscarCache, "paper", "llama"),
    (OscarCache, "default", "gemma3"),
    (StaticOscarCache, "paper", "gemma3"),
]


@pytest.mark.parametrize("cache_class, layout, family", CONFIGURATIONS,
                         ids=[f"{c.__name__}-{l}-{f}" for c, l, f in CONFIGURATIONS])
def test_random_operation_sequences_keep_the_cache_equal_to_the_oracle(cache_class, layout, family):
    machine = type(f"{cache_class.__name__}Machine", (CacheMachine,),
                   {"cache_class": cache_class, "layout": layout, "family": family})
    run_state_machine_as_test(machine, settings=settings(
        max_examples=EXAMPLES, stateful_step_count=16, deadline=None, database=None,
        derandomize=SEED == "fixed", suppress_health_check=list(HealthCheck), print_blob=True))


# --------------------------------------------------------------------------------------------- scripted sequences
# The operation sequences behind bugs the random search must keep finding, run by value through the same machine
# (the invariant checked after each operation): (operation, arguments...).
SCRIPTS = {
    # values written past a grown history's last row (keys and values grew to different capacities)
    "decode across growths": [("begin", 1), ("_pass", 20, "fused", 0), ("decode", 140, "fused", 1)],
    # a crop deeper than the ring, a regrowth that completes no key block, then a short crop: the removed tokens'
    # keys, still in the history, must not come back
    "a crop after a deep crop and a regrowth": [("begin", 1), ("_pass", 60, "store", 0), ("do_crop", 30),
                                               ("_pass", 10, "store", 1), ("do_crop", 2)],
    # a reset, then a shorter sequence: which position each ring slot holds starts again
    "a crop after a reset": [("begin", 1), ("_pass", 100, "store", 0), ("do_crop", 1), ("do_reset",), ("begin", 1),
                             ("_pass", 30, "store", 1), ("do_crop", 1)],
    # the first key block completed by a compiled decode step
    "compiled steps from the prompt": [("begin", 2, 1), ("_pass", 5, "fused", 0), ("decode", 30, "fused", 1, True)],
}


@pytest.mark.parametrize("cache_class", [OscarCache, StaticOscarCache])
@pytest.mark.parametrize("script", list(SCRIPTS))
def test_scripted_sequences_keep_the_cache_equal_to_the_oracle(script, cache_class):
    machine = type("Machine", (CacheMachine,), {"cache_class": cache_class})()
    for operation, *args in SCRIPTS[script]:
        if operation == "decode" and len(args) == 4 and cache_class is not StaticOscarCache:
            args = args[:3]  # only the static cache's steps are compiled
        getattr(machine, operation)(*args)
        machine.stored_states_equal_the_oracle()
