"""StaticOscarCache: the same storage and the same attention as OscarCache, in fixed buffers a compiled step can use.

The reference is the dynamic `OscarCache` (itself checked against an independent oracle in test_oracle.py): both are
the same layers over the same position plan, so on the same inputs they must store identical tensors and give the
same logits (up to the order of float additions)."""

import pytest
import torch

from conftest import VOCAB, tiny_model
from oscar_hf import OscarCache, OscarConfig, OscarRotations, StaticOscarCache

SMALL = dict(sink_tokens=4, window_tokens=8, demotion_block=4, key_block=4, value_clip=0.95)
LAYOUTS = {"channel": OscarConfig(**SMALL), "token": OscarConfig(**SMALL, key_granularity="token", key_clip=0.9),
           # per-head key blocks (8 and 4 tokens) in chunks of 8, as a fitted allocation gives them
           "mixed": OscarConfig(**{**SMALL, "demotion_block": 8}),
           # ... with wide key channels in head 0 and a wide (4-bit) head 1, as calibrated files give them
           "wide": OscarConfig(**{**SMALL, "demotion_block": 8})}


def _pair(family="llama", layout="channel", max_cache_len=200, **model_kw):
    model = tiny_model(family, **model_kw)
    rot = OscarRotations.data_free(model, "hadamard")
    config = LAYOUTS[layout]
    if layout in ("mixed", "wide"):
        rot.key_blocks = {layer: (8, 4) for layer in rot.layers}
        rot.layout.update(key_block=config.key_block, demotion_block=config.demotion_block)  # what the file was fitted for
    if layout == "wide":
        rot.head_bits = {layer: (2, 4) for layer in rot.layers}
        rot.key_wide_channels = {layer: (5, 0) for layer in rot.layers}
    return model, OscarCache(model, rot, config), StaticOscarCache(model, rot, config, max_cache_len=max_cache_len)


def _ids(batch, n, seed):
    return torch.randint(4, VOCAB, (batch, n), generator=torch.Generator().manual_seed(seed))


def _assert_same_storage(dyn, sta):
    """Layer 0 sees the same inputs in both caches: identical storage. Deeper layers see the previous layers'
    attention outputs, equal up to float rounding, which can move a value across a rounding boundary of the 2-bit
    quantizer now and then: (almost) all elements identical."""
    for i in dyn.geometry.oscar_layers:
        kd, vd = dyn.layers[i].stored_states()
        ks, vs = sta.layers[i].stored_states()
        assert kd.shape == ks.shape and vd.shape == vs.shape
        if i == 0:
            assert torch.equal(kd, ks) and torch.equal(vd, vs)
        for a, b in ((kd, ks), (vd, vs)):
            assert ((a - b).abs() > 1e-3).float().mean() < 0.01, i


@pytest.mark.parametrize("family,layout", [("llama", "channel"), ("llama", "token"), ("gemma3", "channel"),
                                           ("llama", "mixed"), ("llama", "wide")])
def test_prefill_decode_and_chunks_store_and_attend_like_the_dynamic_cache(family, layout):
    model, dyn, sta = _pair(family, layout)
    if layout in ("mixed", "wide"):
        assert dyn.layers[0].fmt.keys.blocks == sta.layers[0].fmt.keys.blocks == (8, 4)
    if layout == "wide":
        assert dyn.layers[0].fmt.keys.wide_channels == sta.layers[0].fmt.keys.wide_channels == (5, 0)
    with torch.no_grad():
        steps = [_ids(2, 37, 0)] + [_ids(2, 1, s) for s in range(1, 30)] + [_ids(2, 9, 99)] + [_ids(2, 1, s) for s in range(5)]
        for ids in steps:  # 30 single steps: blocks complete and the ring wraps (R = 8 + 2·4 = 16)
            a, b = model(ids, cache=dyn).logits, model(ids, cache=sta).logits
            assert (a - b).abs().max() < 1e-4 * max(1.0, a.abs().max().item())
    assert int(sta.get_seq_length()) == dyn.get_seq_length() == 37 + 29 + 9 + 5
    _assert_same_storage(dyn, sta)


def test_generate_gives_the_dynamic_cache_tokens():
    model, dyn, sta = _pair()
    ids = _ids(2, 30, 1)
    with torch.no_grad():
        a = model.generate(ids, cache=dyn, max_new_tokens=25, do_sample=False, pad_token_id=0)
        b = model.generate(ids, cache=sta, max_new_tokens=25, do_sample=False, pad_token_id=0)
    assert torch.equal(a, b)


def test_an_eager_prefill_gets_a_mask_over_the_keys_it_sees(monkeypatch):
    """A fresh prefill without padding reaches sdpa with no mask (is_causal: a GPU's flash kernel), not one
    materialized over max_cache_len keys; with padding, a mask over the prompt only; decode steps keep one mask shape
    over max_cache_len. The tokens stay the dynamic cache's."""
    seen = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def recording(query, key, value, attn_mask=None, is_causal=False, **kwargs):
        seen.append((query.shape[2], None if attn_mask is None else attn_mask.shape[-1], is_causal))
        return sdpa(query, key, value, attn_mask=attn_mask, is_causal=is_causal, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    model, dyn, sta = _pair(max_cache_len=300)
    ids = _ids(2, 30, 1)
    with torch.no_grad():
        want = model.generate(ids, cache=dyn, max_new_tokens=3, do_sample=False, pad_token_id=0)
        seen.clear()
        got = model.generate(ids, cache=sta, max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert torch.equal(got, want)
    layers = len(sta.geometry.oscar_layers)
    assert seen[:layers] == [(30, None, True)] * layers  # the prefill: no mask, causal
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    with torch.no_grad():
        sta.reset()
        seen.clear()
        model.generate(ids, attention_mask=mask, cache=sta, max_new_tokens=1, do_sample=False, pad_token_id=0)
    assert seen == [(30, 30, False)] * layers  # padding: a mask over the prompt's keys
    assert sta.get_mask_sizes(1, 0) == (300, 0) and sta.get_mask_sizes(5, 0) == (35, 0)  # 30 stored


def test_left_padded_batch_matches_the_dynamic_cache():
    model, dyn, sta = _pair()
    ids = _ids(2, 30, 2)
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    with torch.no_grad():
        a = model.generate(ids, attention_mask=mask, cache=dyn, max_new_tokens=20, do_sample=False, pad_token_id=0)
        b = model.generate(ids, attention_mask=mask, cache=sta, max_new_tokens=20, do_sample=False, pad_token_id=0)
    assert torch.equal(a, b)


def test_the_decode_step_traces_as_one_graph_without_recompiling():
    """Dynamo captures the whole decode step (fullgraph: no graph break anywhere in the cache or the attention) and
    the lengths changing every step cause no recompilation (they live on the device)."""
    model, dyn, sta = _pair(max_cache_len=120)
    with torch.no_grad():
        model(_ids(1, 30, 3), cache=dyn)
        model(_ids(1, 30, 3), cache=sta)
        step = torch.compile(lambda ids, pos: model(ids, cache=sta, position_ids=pos).logits,
                             backend="eager", fullgraph=True)
        # (config.patch: a monkeypatched dynamo config option is hidden, not restored, when the patch is undone)
        with torch._dynamo.config.patch(error_on_recompile=True):
            for i in range(14):  # crosses block boundaries and wraps the ring
                ids, pos = _ids(1, 1, 10 + i), torch.tensor([[30 + i]])
                a = model(ids, cache=dyn, position_ids=pos).logits
                b = step(ids, pos)
                assert (a - b).abs().max() < 1e-4 * max(1.0, a.abs().max().item()), i
    torch._dynamo.reset()
    _assert_same_storage(dyn, sta)


def test_crop_rolls_back_exactly_within_the_ring_and_like_the_dynamic_cache_beyond():
    model, dyn, sta = _pair()
    _, _, ref = _pair()
    with torch.no_grad():
        for cache in (sta, ref, dyn):
            model(_ids(1, 40, 4), cache=cache)
        for s in range(3):
            model(_ids(1, 1, 20 + s), cache=sta)
        with pytest.raises(ValueError, match="negative"):
            sta.crop(3)
        sta.crop(-3)  # as assisted decoding does after rejected candidates
        assert int(sta.get_seq_length()) == 40
        for s in range(9):  # the same continuation: identical to a cache that never saw the cropped tokens
            ids = _ids(1, 1, 50 + s)
            a, b = model(ids, cache=ref).logits, model(ids, cache=sta).logits
            assert torch.equal(a, b)
        for i in ref.geometry.oscar_layers:
            assert all(torch.equal(x, y) for x, y in zip(ref.layers[i].stored_states(), sta.layers[i].stored_states()))
        # further back than the ring reaches: the window comes back from the history, as the dynamic cache does it
        for s in range(9):
            model(_ids(1, 1, 50 + s), cache=dyn)
        dyn.crop(-sta.plan.ring)
        sta.crop(-sta.plan.ring)
        a, b = model(_ids(1, 3, 70), cache=dyn).logits, model(_ids(1, 3, 70), cache=sta).logits
        assert (a - b).abs().max() < 1e-4 * max(1.0, a.abs().max().item())


def test_crop_is_refused_when_a_static_sliding_window_cannot_roll_back():
    """transformers' static sliding-window layers keep only the window: once full, a crop cannot restore what the
    removed tokens pushed out (Gemma 3 crop(-3) after 33 tokens moved the logits by 0.46, silently)."""
    model, dyn, sta = _pair("gemma3")
    with torch.no_grad():
        model(_ids(1, 30, 4), cache=sta)
        model(_ids(1, 3, 5), cache=sta)
        before = int(sta.get_seq_length())
        with pytest.raises(ValueError, match="sliding-window layers"):
            sta.crop(-3)
        assert int(sta.get_seq_length()) == before  # refused before anything changed


def test_reset_then_another_batch_size_reinitialises():
    model, _, sta = _pair("gemma3")
    _, _, fresh = _pair("gemma3")
    with torch.no_grad():
        model(_ids(3, 20, 4), cache=sta)
        sta.reset()
        a = model(_ids(2, 20, 5), cache=sta).logits
        b = model(_ids(2, 20, 5), cache=fresh).logits
        assert torch.equal(a, b)
        with pytest.raises(ValueError, match="holds a batch of 2 sequences, not 1"):
            model(_ids(1, 1, 6), cache=sta)


def test_beam_reorder_is_in_place():
    model, _, sta = _pair()
    with torch.no_grad():
        model(_ids(3, 30, 5), cache=sta)
    storage = sta.layers[0].storage
    before = [t.clone() for t in storage.buffers()]
    pointers = [t.data_ptr() for t in storage.buffers()]
    sta.reorder_cache(torch.tensor([2, 0, 0]))
    after = storage.buffers()
    assert [t.data_ptr() for t in after] == pointers
    for b, a in zip(before, after):
        assert torch.equal(a[0], b[2]) and torch.equal(a[1], b[0]) and torch.equal(a[2], b[0])


def test_bad_use_is_refused_with_a_clear_message():
    model = tiny_model("llama")
    rot = OscarRotations.data_free(model, "hadamard")
    with pytest.raises(ValueError, match="max_cache_len"):
        StaticOscarCache(model, rot, LAYOUTS["channel"])
    sdpa = tiny_model("llama", attn="sdpa")
    with pytest.raises(ValueError, match="oscar"):
        StaticOscarCache(sdpa, OscarRotations.data_free(sdpa, "hadamard"), LAYOUTS["channel"], max_cache_len=64)
    cache = StaticOscarCache(model, rot, LAYOUTS["channel"], max_cache_len=50)
    with torch.no_grad(), pytest.raises(ValueError, match="holds max_cache_len=50 tokens; this pass would store 60"):
        model(_ids(1, 60, 6), cache=cache)
    cache = StaticOscarCache(model, rot, LAYOUTS["channel"], max_cache_len=50)
    # a generate call that would run past the buffers is refused on the host before its first step: inside a CUDA graph
    # the device-side check would end the process's CUDA context
    with torch.no_grad(), pytest.raises(ValueError, match="this generate call may store 59"):
        model.generate(_ids(1, 40, 6), cache=cache, max_new_tokens=20, do_sample=False, pad_token_id=0)
    assert cache.get_seq_length() == 0  # nothing ran
    # the model switched to another attention after the cache was built: refused at its first layer, not a mask of
    # max_cache_len positions against the stored keys deep inside sdpa
    model.set_attn_implementation("sdpa")
    with torch.no_grad(), pytest.raises(ValueError, match="StaticOscarCache needs attn_implementation=\"oscar\", "
                                                          "but the model now runs 'sdpa'"):
        model.generate(_ids(1, 10, 6), cache=cache, max_new_tokens=2, do_sample=False, pad_token_id=0)


def test_buffers_are_allocated_once_and_sized_by_the_layout():
    """Nothing is reallocated while decoding (a captured graph needs fixed addresses), and the allocation is what the
    layout says: sink + ring in BF16 (each with a scratch slot), the history for every position beyond the sink (no
    scratch: skipped writes take a negative row), channel-wise key metadata per block and token-wise value metadata
    per token."""
    model, _, sta = _pair(max_cache_len=100)
    with torch.no_grad():
        model(_ids(1, 30, 7), cache=sta)
        layer = sta.layers[0]
        pointers = [t.data_ptr() for t in layer.storage.buffers()]
        for s in range(20):
            model(_ids(1, 1, 30 + s), cache=sta)
        model(_ids(1, 7, 77), cache=sta)
    assert [t.data_ptr() for t in layer.storage.buffers()] == pointers
    heads, d, s, w, b = 2, 16, 4, 8, 4
    ring, rows = w + 2 * b, -(-(100 - s) // b) * b
    expected = 2 * (s + 1 + ring + 1) * heads * d * layer.storage.sink_keys.element_size()  # sink and ring
    expected += 2 * rows * heads * d // 4  # 2-bit codes, keys and values
    expected += (rows // b) * heads * d * 2 * 2 + rows * heads * 1 * 2 * 2  # fp16 (scale, min): keys per block, values per token
    assert layer.memory_bytes()["allocated"] == expected
    report = sta.memory_report()
    assert report["tokens"] == 57 and isinstance(report["tokens"], int)  # 30 + 20 + 7, a number, not a device tensor


def test_every_tensor_the_decode_step_reads_has_a_static_address():
    """A CUDA graph copies each input whose address is not marked static into its own pool on every replay: the
    buffers, the plan and the per-layer constants (rotations) must all be marked."""
    model, _, sta = _pair(max_cache_len=100)
    with torch.no_grad():
        model(_ids(1, 30, 7), cache=sta)
    for layer in sta.layers:
        tensors = {name: t for name, t in vars(layer).items() if isinstance(t, torch.Tensor) and not name.startswith("_")}
        tensors.update({name: t for name, t in vars(layer.storage).items() if isinstance(t, torch.Tensor)})
        tensors.update({f"history.{i}": t for i, t in enumerate(layer.storage.keys.buffers + layer.storage.values.buffers)})
        tensors.update({f"plan.{k}": t for k, t in vars(layer.plan).items() if isinstance(t, torch.Tensor)})
        assert {"key_rotation", "value_rotation", "ring_keys", "plan.write_rows", "history.0"} <= set(tensors)
        unmarked = [name for name, t in tensors.items() if not hasattr(t, "_dynamo_static_input_type")]
        assert not unmarked, unmarked


def _generate(model, ids, cache, **kw):
    kw.setdefault("max_new_tokens", 20)
    kw.setdefault("do_sample", False)
    return model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, pad_token_id=0, **kw)


@pytest.mark.parametrize("mode", ["sampling", "beam_search", "continued", "prompt_lookup"])
def test_generate_modes_match_the_dynamic_cache(mode):
    model = tiny_model("llama")
    rot = OscarRotations.data_free(model, "hadamard")
    config = OscarConfig(**{**SMALL, "demotion_block": 8, "key_block": 8})  # a ring of 8 + 16 tokens: room for 4 rejected candidates
    ids = torch.cat([_ids(1, 18, 8)] * 2, 1)  # repetition gives prompt lookup something to propose
    outs = []
    for make in (lambda: OscarCache(model, rot, config), lambda: StaticOscarCache(model, rot, config, max_cache_len=160)):
        cache = make()
        torch.manual_seed(0)
        if mode == "sampling":
            outs.append(_generate(model, ids, cache, do_sample=True, top_k=20))
        elif mode == "beam_search":
            outs.append(_generate(model, ids, cache, num_beams=3))
        elif mode == "continued":
            first = _generate(model, ids, cache)
            outs.append(_generate(model, torch.cat([first, _ids(1, 9, 9)], 1), cache))
        else:
            outs.append(_generate(model, ids, cache, prompt_lookup_num_tokens=4))
    assert torch.equal(outs[0], outs[1])


def test_batch_selection_and_expansion_follow_the_dynamic_cache():
    model, dyn, sta = _pair()
    with torch.no_grad():
        for cache in (dyn, sta):
            model(_ids(3, 30, 11), cache=cache)
            cache.batch_select_indices(torch.tensor([2, 0]))
            cache.batch_repeat_interleave(2)
        for s in range(6):
            ids = _ids(4, 1, 40 + s)
            a, b = model(ids, cache=dyn).logits, model(ids, cache=sta).logits
            assert b.shape[0] == 4 and (a - b).abs().max() < 1e-4 * max(1.0, a.abs().max().item())


def test_eager_decode_graphs_are_keyed_by_layout_and_buffer_addresses(monkeypatch):
    """The capture itself needs CUDA (checked on the H200: bench_generate.py's `check`, graphs vs launches bit for
    bit); here the keys: one graph per layer (the token's store and the attention), reused across steps (the lengths
    live on the device), a new one when the buffers are replaced (batch selection). The key mask is copied once per
    pass into one buffer the graphs read in place: a padding mask needs no graph of its own."""
    from oscar_hf import graphs

    model, _, sta = _pair()
    keys = []

    def run(self, key, fn, *inputs, resident=()):
        keys.append((key, graphs.signature(*resident), graphs.addresses(*resident)))  # as DecodeGraphs.run keys them
        return fn(*inputs, *resident)

    assert not graphs.enabled(torch.zeros(1), True)  # never on the CPU
    monkeypatch.setattr(graphs, "enabled", lambda x, kernels: True)
    monkeypatch.setattr(graphs.DecodeGraphs, "run", run)
    layers = len(sta.geometry.oscar_layers)
    with torch.no_grad():
        model(_ids(3, 30, 5), cache=sta)  # a chunk: no graphs
        assert keys == []
        for s in range(3):
            model(_ids(3, 1, 50 + s), cache=sta)
        assert len(keys) == 3 * layers and len(set(keys)) == layers
        assert all(key[0][1] == "step" for key in keys)
        sta.batch_select_indices(torch.tensor([2, 0]))
        model(_ids(2, 1, 60), cache=sta)
        assert len(set(keys)) == 2 * layers
        mask = sta.graphs._mask
        assert mask.shape == (2, 200)  # the static cache's max_cache_len
        padded = torch.ones(2, 35, dtype=torch.long)
        padded[1, :4] = 0
        model(_ids(2, 1, 61), attention_mask=padded, cache=sta)
    assert len(set(keys)) == 2 * layers and sta.graphs._mask is mask
    assert not mask[1, :4].any() and mask[1, 4:35].all() and mask[0, :35].all()


def test_decode_graphs_capture_once_per_key_and_copy_the_inputs(monkeypatch):
    """The policy of `DecodeGraphs.run` (the capture needs CUDA; its results are checked on the GPU): one graph per
    key and resident set, whatever addresses the inputs come at (each call copies them in); a new key, or resident
    buffers at other addresses, capture anew."""
    from oscar_hf import graphs

    made = []

    class FakeCall:
        def __init__(self, fn, inputs, resident, pool, stream):
            self.inputs, self.resident, self.calls = [x.clone() for x in inputs], resident, 0
            made.append(self)

        def __call__(self, *inputs):
            self.calls += 1
            for mine, x in zip(self.inputs, inputs):
                mine.copy_(x)
            return self

    monkeypatch.setattr(graphs, "GraphedCall", FakeCall)
    monkeypatch.setattr(graphs.torch.cuda, "graph_pool_handle", lambda: "pool")
    monkeypatch.setattr(graphs.torch.cuda, "Stream", lambda: "capture stream")
    g = graphs.DecodeGraphs()
    xs = [torch.full((4,), float(i)) for i in range(3)]
    buffer, other_buffer = torch.zeros(2), torch.zeros(2)
    first = g.run("k", None, xs[0], resident=(buffer,))
    assert all(g.run("k", None, x, resident=(buffer,)) is first for x in xs)  # inputs anywhere: copied in
    assert first.calls == 4 and torch.equal(first.inputs[0], xs[2])
    assert g.run("other", None, xs[0], resident=(buffer,)) is not first
    assert g.run("k", None, xs[0], resident=(other_buffer,)) is not first  # the buffers moved: a new graph
    assert len(made) == 3 and g.stats == {"captures": 3, "replays": 6}



def test_decode_graphs_key_mask_is_copied_once_per_mask_and_grows_by_doubling():
    """The key mask the eager graphs read in place: one copy per attention mask (the layers of a pass share it), the
    same buffer while masks fit (a dynamic cache's mask grows by one key per step), at least twice as long when one
    does not, and a new buffer for another batch."""
    from oscar_hf import graphs

    g = graphs.DecodeGraphs()
    rows = []

    def row(m):
        return lambda: rows.append(m) or m[:, 0, -1, :]

    m1 = torch.ones(2, 1, 1, 10, dtype=torch.bool)
    m1[1, ..., :3] = False
    buf = g.key_mask(m1, row(m1))
    assert buf.shape == (2, 10) and torch.equal(buf, m1[:, 0, -1])
    assert g.key_mask(m1, row(m1)) is buf and len(rows) == 1  # the next layer of the pass: no copy
    m1[0, ..., 5] = False  # written in place: copied again
    assert torch.equal(g.key_mask(m1, row(m1))[0], m1[0, 0, -1]) and len(rows) == 2
    m2 = torch.ones(2, 1, 1, 11, dtype=torch.bool)
    grown = g.key_mask(m2, row(m2))
    assert grown.shape == (2, 20) and grown[:, :11].all()
    m3 = torch.zeros(2, 1, 1, 12, dtype=torch.bool)
    assert g.key_mask(m3, row(m3)) is grown and not grown[:, :12].any()
    assert g.key_mask(m1[:1], row(m1[:1])).shape == (1, 10)  # another batch


class _EmulatedGraph:
    """`graphs.GraphedCall` emulated on the CPU, as a CUDA graph behaves: the warm-up runs `fn` once; a replay runs it
    again on what the graph reads (its own copies of the inputs, refilled by each call, and the resident tensors in
    place) into one output buffer that the next replay overwrites."""

    def __init__(self, fn, inputs, resident, pool, stream):
        self.fn, self.resident = fn, resident
        self.inputs = [x.clone() for x in inputs]
        fn(*self.inputs, *resident)
        self.output = None

    def __call__(self, *inputs):
        torch._foreach_copy_(self.inputs, list(inputs))
        out = self.fn(*self.inputs, *self.resident)
        if self.output is None:
            self.output = torch.empty_like(out)
        return self.output.copy_(out)


def test_eager_decode_graphs_replay_what_the_launches_compute(monkeypatch):
    """An eager step's graphs (one per layer: the token's store, then the attention) against the same step launched
    op by op, with the kernels (the Triton interpreter) and CUDA graphs emulated (`_EmulatedGraph`): a padded batch
    (the key mask buffer the graphs read in place, which grows with the dynamic cache's mask), a key block completing
    during decode, the same greedy tokens and logits bit for bit. (The static cache's layers are the same code over
    fixed buffers; its key graphs are checked above, and graphs against launches on the GPU by bench_generate's
    `check`.)"""
    from oscar_hf import graphs

    monkeypatch.setenv("OSCAR_HF_KERNELS", "1")
    monkeypatch.setattr(graphs, "GraphedCall", _EmulatedGraph)
    monkeypatch.setattr(graphs.torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(graphs.torch.cuda, "Stream", lambda: "capture stream")
    on = {"graphs": False}
    monkeypatch.setattr(graphs, "enabled", lambda x, kernels: kernels and on["graphs"])
    model = tiny_model(dtype=torch.bfloat16, head_dim=64, num_hidden_layers=1)
    rotations = OscarRotations.data_free(model, "hadamard")
    config = OscarConfig(sink_tokens=4, window_tokens=16, demotion_block=16, key_block=16, value_clip=0.95)
    ids = _ids(2, 35, 3)
    padding = torch.ones_like(ids)
    padding[1, :5] = 0
    outs, caches = {}, {}
    for graphed in (False, True):
        on["graphs"] = graphed
        cache = OscarCache(model, rotations, config)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=padding, cache=cache, max_new_tokens=3, min_new_tokens=3,
                                 do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
        outs[graphed], caches[graphed] = out, cache
    assert caches[False].layers[0].kernel  # the kernels ran, not the twins
    assert not caches[False].graphs.stats and caches[True].graphs.stats["captures"] > 0
    assert caches[True].graphs._mask.shape[1] > ids.shape[1] + 1  # the mask buffer grew during decode
    assert torch.equal(outs[True].sequences, outs[False].sequences)
    assert all(torch.equal(a, b) for a, b in zip(outs[True].logits, outs[False].logits))


def _two_turns(model, cache, seed=5):
    """Greedy generate, then a second turn on the same cache: the first turn's output and a new user message."""
    ids, more = _ids(1, 12, seed), _ids(1, 7, seed + 1)
    with torch.no_grad():
        first = model.generate(ids, cache=cache, max_new_tokens=12, do_sample=False)
        return model.generate(torch.cat([first, more], 1), cache=cache, max_new_tokens=12, do_sample=False)


@pytest.fixture
def compiled_forward():
    """transformers' documented pattern, `model.forward = torch.compile(model.forward, fullgraph=True)` (with the
    "eager" backend, which traces as the others do but compiles nothing)."""
    compiled = []

    def compile_forward(model, fullgraph=True):
        torch._dynamo.reset()
        model.forward = torch.compile(model.forward, backend="eager", fullgraph=fullgraph)
        compiled.append(model)
        return model

    yield compile_forward
    for model in compiled:
        model.__dict__.pop("forward", None)  # back to the class's forward
    torch._dynamo.reset()


def test_a_compiled_forward_gives_the_uncompiled_tokens_over_two_turns(compiled_forward):
    """The prefill runs compiled too (it knows the token count on the host: generate reads it before each call,
    after compiled decode steps left it on the device), then the decode steps, across demotions."""
    model, _, _ = _pair(max_cache_len=128)
    rot, config = OscarRotations.data_free(model, "hadamard"), LAYOUTS["channel"]
    want = _two_turns(model, StaticOscarCache(model, rot, config, max_cache_len=128))
    compiled_forward(model)
    got = _two_turns(model, StaticOscarCache(model, rot, config, max_cache_len=128))
    assert torch.equal(got, want)


def test_a_compiled_forward_runs_the_growable_cache_eagerly_and_refuses_it_under_fullgraph(compiled_forward):
    """OscarCache grows its history on the host, which no compiled code can: a compiled forward runs its update
    eagerly (a graph break, the same tokens), and fullgraph=True refuses it at the first layer, naming the cache to
    use (it wrote past its buffers once they had to grow)."""
    model, _, _ = _pair()
    rot, config = OscarRotations.data_free(model, "hadamard"), LAYOUTS["channel"]
    ids = _ids(1, 12, 3)
    with torch.no_grad():
        want = model.generate(ids, cache=OscarCache(model, rot, config), max_new_tokens=30, do_sample=False)
        compiled_forward(model, fullgraph=False)
        got = model.generate(ids, cache=OscarCache(model, rot, config), max_new_tokens=30, do_sample=False)
        assert torch.equal(got, want)
        compiled_forward(model, fullgraph=True)
        cache = OscarCache(model, rot, config)
        with pytest.raises(Exception, match="StaticOscarCache"):
            model.generate(ids, cache=cache, max_new_tokens=3, do_sample=False)
    assert not cache.layers[0].is_initialized  # refused before any layer was written


def test_a_compiled_multi_token_pass_without_the_host_count_is_refused(compiled_forward):
    """Outside generate, after compiled decode steps, a compiled multi-token pass would not know where its tokens go:
    refused, naming what to do."""
    model, _, sta = _pair(max_cache_len=64)
    compiled_forward(model)
    with torch.no_grad():
        model(_ids(1, 10, 1), cache=sta)
        model(_ids(1, 1, 2), cache=sta, position_ids=torch.tensor([[10]]))  # a compiled step: L only on the device
        with pytest.raises(Exception, match="model.generate .* or reset"):
            model(_ids(1, 3, 3), cache=sta, position_ids=torch.tensor([[11, 12, 13]]))


@pytest.mark.parametrize("beams", [1, 3])
def test_generate_allocates_a_static_cache_before_its_first_pass(beams):
    """generate allocates a StaticOscarCache's buffers, for its expanded batch, before the first forward pass: inside
    a compiled forward they would be outputs of its CUDA graphs, which the next replay overwrites."""
    model, _, sta = _pair(max_cache_len=64)
    seen = []
    forward = model.forward

    def spy(*args, **kwargs):
        seen.append([layer.batch_size if layer.is_initialized else None for layer in sta.layers])
        return forward(*args, **kwargs)

    model.forward = spy
    try:
        with torch.no_grad():
            model.generate(_ids(2, 8, 0), cache=sta, max_new_tokens=3, do_sample=False, num_beams=beams)
    finally:
        del model.forward
    assert seen[0] == [2 * beams] * len(sta.layers)
