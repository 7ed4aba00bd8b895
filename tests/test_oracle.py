"""OscarCache and StaticOscarCache against the independent oracle of tests/oracle.py (its docstring is the
specification), through a model: plain eager attention over keys/values that the oracle cache has replaced by their
stored versions. Checked at every step, with every layer of the oracle's model fed the input the cache's model gave
that layer (teacher forcing: both sides then see the same queries, keys and values in every layer): every layer's
stored states (sink | dequantized history | window) are bit-identical to the oracle's, every layer's attention output
agrees to float32 rounding, and so do the logits. Also here: states crafted to reach the quantizer's edges (ties,
saturated scales, constant groups), the block mean's rounding, and consecutive crops. Random operation sequences:
tests/test_cache_state_machine.py.
"""

import pytest
import torch

from conftest import VOCAB, tiny_model
from oracle import F16_MAX, OracleCache, OracleLayer, Spec, clip, fake_quantize, fake_quantize_tokens
from oscar_hf import OscarCache, OscarConfig, OscarRotations, StaticOscarCache

S, W, B = 4, 8, 16  # sink, window, demotion block: R = 40 ring slots
MAX_LEN = 128  # StaticOscarCache's max_cache_len


def history(n: int) -> int:
    return max(0, (n - S - W) // B) * B


# --------------------------------------------------------------------------------------------- the layouts
def _orthogonal(g, h, d):
    return torch.linalg.qr(torch.randn(h, d, d, generator=g, dtype=torch.float64))[0].float()


def _layout(name):
    """(model kwargs, OscarConfig, per-layer Specs, OscarRotations kwargs) of one layout users run."""
    if name == "per_head":  # a calibrated file's refinements: key blocks, a wide head, wide key channels, key means
        model_kw = dict(family="llama", num_attention_heads=8, num_key_value_heads=4, head_dim=16)
        heads, d = 4, 16
        blocks = {0: (16, 8, 16, 8), 1: (8, 16, 8, 16), 2: (16, 16, 8, 8)}
        bits = {0: (2, 4, 2, 2), 1: (4, 2, 2, 2), 2: (2, 2, 2, 2)}
        wide = {0: (3, 0, 8, 1), 1: (0, 2, 5, 0), 2: (4, 0, 6, 2)}
        value_clips = {0: 0.75, 1: 0.9, 2: 1.0}
        config = OscarConfig(sink_tokens=S, window_tokens=W, demotion_block=B, key_block=B, value_clip="fitted")
        specs = {i: Spec(heads, d, "channel", blocks[i], bits[i], wide[i], value_clip=value_clips[i]) for i in range(3)}
        file = dict(key_blocks=blocks, head_bits=bits, key_wide_channels=wide, value_clips=value_clips,
                    layout=dict(key_granularity="channel", demotion_block=B, key_block=B,
                                key_block_allocation="fitted"))
    elif name == "token":  # the paper's token-wise keys, clipped, in groups of 8 channels, with key means
        model_kw = dict(family="llama", hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
        heads, d = 2, 32
        key_clips, value_clips = {0: 0.8, 1: 0.9, 2: 0.95}, {0: 0.75, 1: 1.0, 2: 0.9}
        config = OscarConfig(sink_tokens=S, window_tokens=W, demotion_block=B, key_granularity="token", group_size=8,
                             key_clip="fitted", value_clip="fitted")
        specs = {i: Spec(heads, d, "token", key_clip=key_clips[i], value_clip=value_clips[i], group=8)
                 for i in range(3)}
        file = dict(key_clips=key_clips, value_clips=value_clips,
                    layout=dict(key_granularity="token", demotion_block=B, key_block=B, key_block_allocation="uniform"))
    elif name == "grouped":  # uniform key blocks of 8, value groups of 8 channels, wide key channels (no wide heads)
        model_kw = dict(family="qwen3", num_attention_heads=4, num_key_value_heads=2, head_dim=32)
        heads, d = 2, 32
        wide = {0: (16, 3), 1: (0, 7), 2: (1, 0)}
        config = OscarConfig(sink_tokens=S, window_tokens=W, demotion_block=B, key_block=8, group_size=8,
                             value_clip=0.85)
        specs = {i: Spec(heads, d, "channel", (8, 8), None, wide[i], value_clip=0.85, group=8) for i in range(3)}
        file = dict(key_wide_channels=wide,
                    layout=dict(key_granularity="channel", demotion_block=B, key_block=8,
                                key_block_allocation="uniform"))
    else:
        raise ValueError(name)
    return model_kw, config, specs, file


def _setup(name, seed=0):
    model_kw, config, specs, file = _layout(name)
    family = model_kw.pop("family")
    fused = tiny_model(family, attn="oscar", **model_kw)
    plain = tiny_model(family, attn="eager", **model_kw)
    base = OscarRotations.data_free(fused, "hadamard")
    g = torch.Generator().manual_seed(seed)
    heads, d = fused.config.num_key_value_heads, fused.config.head_dim
    rotations = OscarRotations(
        base.geometry, {i: _orthogonal(g, heads, d) for i in base.layers},
        {i: _orthogonal(g, heads, d) for i in base.layers},
        key_means={i: 2 * torch.randn(heads, d, generator=g) for i in base.layers}, metadata=base.metadata, **file)
    return fused, plain, rotations, config, specs


# --------------------------------------------------------------------------------------------- the tests
LAYOUTS = ["per_head", "token", "grouped"]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny tensors: one thread is faster than two, and ten times faster on a loaded machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class _TeacherForcing:
    """Hooks on both models: every decoder layer of the oracle's model gets the input the cache's model gave the same
    layer, so that each layer sees the same queries, keys and values on both sides (its storage is then bit-identical,
    its attention outputs differ by float32 rounding only, and a deeper layer never inherits a difference that a
    quantization boundary amplified); and every layer's attention output (the o_proj input) is recorded."""

    def __init__(self, fused, plain):
        self.inputs, self.got, self.want = [], [], []
        for i, (a, b) in enumerate(zip(fused.model.layers, plain.model.layers)):
            a.register_forward_pre_hook(lambda _, args: self.inputs.append(args[0]))
            b.register_forward_pre_hook(lambda _, args, i=i: (self.inputs[i],) + args[1:])
            a.self_attn.o_proj.register_forward_pre_hook(lambda _, args: self.got.append(args[0]))
            b.self_attn.o_proj.register_forward_pre_hook(lambda _, args: self.want.append(args[0]))

    def attention_outputs(self):
        out = list(zip(self.got, self.want))
        self.inputs, self.got, self.want = [], [], []
        return out


@pytest.mark.parametrize("cache_class", [OscarCache, StaticOscarCache])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_cache_equals_the_oracle_through_prefill_decode_demotions_chunks_crops_and_reorder(layout, cache_class):
    fused, plain, rotations, config, specs = _setup(layout)
    kw = {"max_cache_len": MAX_LEN} if cache_class is StaticOscarCache else {}
    cache, oracle = cache_class(fused, rotations, config, **kw), OracleCache(plain, rotations, specs)
    for i, spec in specs.items():  # the cache did take the file's refinements (what the oracle was told)
        fmt = cache.layers[i].fmt
        assert fmt.keys.granularity == spec.granularity and fmt.values.group_size == spec.group
        if spec.granularity == "channel":
            assert fmt.keys.blocks == spec.blocks
            assert (fmt.keys.wide_channels or (0,) * fmt.heads) == spec.wide_channels
            assert [r >= 0 for r in fmt.keys.wide_rows or (-1,) * fmt.heads] == [b == 4 for b in spec.head_bits]
    hooks = _TeacherForcing(fused, plain)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(4, VOCAB, (2, MAX_LEN), generator=gen)

    def step(a, b):
        assert cache.get_seq_length() == oracle.get_seq_length() == a
        with torch.no_grad():
            got = fused(input_ids=ids[:, a:b], cache=cache).logits
            want = plain(input_ids=ids[:, a:b], cache=oracle).logits
        for i, (x, y) in enumerate(hooks.attention_outputs()):  # every layer's attention output
            assert (x - y).abs().max() <= 1e-5 * y.abs().max(), (a, b, i)
        assert (got - want).abs().max() <= 1e-5 * want.abs().max(), (a, b)
        for i, layer in enumerate(oracle.oracle):  # every layer's storage: the same floats
            keys, values = cache.layers[i].stored_states()
            want_keys, want_values = layer.stored()
            assert not want_keys.isnan().any() and not want_values.isnan().any()
            assert torch.equal(keys, want_keys) and torch.equal(values, want_values), (a, b, i)

    def continue_with_new_tokens(m):  # what follows a crop is not what was cropped
        ids[:, m:] = torch.randint(4, VOCAB, (2, MAX_LEN - m), generator=gen)

    step(0, 41)  # prefill: sink, one history block, a window of 21
    for t in range(41, 80):  # decode across demotions at 44, 60 and 76 tokens
        step(t, t + 1)
    step(80, 93)  # a chunk onto a filled cache, completing a block from the ring and the chunk

    cache.crop(-35)  # beyond the ring (R = 40): positions 36..52 come back as stored, 53..57 exact
    oracle.crop(-35)
    continue_with_new_tokens(58)
    step(58, 63)  # a chunk demoting the block 36..51 again: stored tokens, quantized a second time
    for t in range(63, 80):  # ... and the block 52..67 at 76: a stored token, exact ones, new ones
        step(t, t + 1)

    cache.crop(-10)  # within the ring: that block leaves the history again, its tokens come back from the ring
    oracle.crop(-10)
    continue_with_new_tokens(70)
    for t in range(70, 74):
        step(t, t + 1)

    beam = torch.tensor([1, 0])
    cache.reorder_cache(beam)
    oracle.reorder_cache(beam)
    ids = ids[beam]
    for t in range(74, 80):  # demotes again at 76
        step(t, t + 1)
    assert history(80) == 64


def test_the_oracle_is_not_the_identity():
    """Guards the oracle: with quantization on it differs from exact attention (else the test above is empty), its
    wide head and wide key channels are finer than its 2-bit ones, and its quantizer rounds as the spec says."""
    _, plain, rotations, _, specs = _setup("per_head")
    ids = torch.randint(4, VOCAB, (2, 60), generator=torch.Generator().manual_seed(2))
    oracle = OracleCache(plain, rotations, specs)
    with torch.no_grad():
        plain(input_ids=ids[:, :52], cache=oracle)
        quantized = plain(input_ids=ids[:, 52:60], cache=oracle).logits
        exact = plain(input_ids=ids).logits[:, 52:60]
    assert (quantized - exact).abs().max() > 1e-2

    layer = oracle.oracle[0]  # head 1: 4-bit; heads 0, 2, 3: 3, 8, 1 wide key channels; history: positions 4..51
    hist = slice(S, S + layer.h)
    assert layer.h == 48
    err_k = (layer.hist_k[:, :, hist] - layer.win_k[:, :, hist]).abs().mean((0, 2))  # [H, d]
    err_v = (layer.hist_v[:, :, hist] - layer.win_v[:, :, hist]).abs().mean((0, 2))
    assert err_k[1].mean() < err_k[3].mean() / 2 and err_v[1].mean() < err_v[0].mean() / 2
    assert err_k[0, :3].mean() < err_k[0, 3:13].mean() / 2  # the 4-bit channels of head 0
    assert (layer.hist_k[:, 0, hist, 13:].unflatten(1, (-1, 16)).diff(dim=2) == 0).all()  # 0-bit: one mean per block

    x = torch.tensor([[0.0, 0.5, 1.0, 1.5, 2.5, 3.0]])  # scale 1, minimum 0: ties round to even
    assert fake_quantize_tokens(x, 2, 6, 1.0).tolist() == [[0.0, 0.0, 1.0, 2.0, 2.0, 3.0]]
    x = torch.tensor([[-4.0, 1.0, 2.0, -1.0]])  # r = 0.5: τ = sort(|x|)[2] = 2
    assert clip(x, 0.5).tolist() == [[-2.0, 1.0, 2.0, -1.0]] and torch.equal(clip(x, 0.99), x)
    x = torch.arange(16.0)[None]  # 4 bits, scale 1: exact
    assert torch.equal(fake_quantize(x, -1, 4), x)
    x = torch.tensor([[0.0, 15 * 16384.0]])  # a wide scale is bounded by a quarter of the float16 range
    assert fake_quantize(x, -1, 4).tolist() == [[0.0, 15 * F16_MAX / 4]]


# --------------------------------------------------------------------------------------------- crafted states
def _identity_cache(cache_class):
    """The per-head layout with identity rotations and no key means: the states stored are the states given."""
    model_kw, config, specs, file = _layout("per_head")
    model = tiny_model(model_kw.pop("family"), attn="oscar", **model_kw)
    base = OscarRotations.data_free(model, "identity")
    rotations = OscarRotations(base.geometry, base.key_rotations, base.value_rotations, metadata=base.metadata, **file)
    kw = {"max_cache_len": MAX_LEN} if cache_class is StaticOscarCache else {}
    spec = specs[0]
    eye = torch.eye(spec.d).expand(spec.heads, -1, -1)
    return cache_class(model, rotations, config, **kw), OracleLayer(eye, eye, None, spec)


@pytest.mark.parametrize("cache_class", [OscarCache, StaticOscarCache])
def test_crafted_states_at_the_quantizer_edges_equal_the_oracle(cache_class):
    """What random model states never reach: codes exactly halfway (round half to even), scales beyond the float16
    range (a wide one bounded by a quarter of it), minima below it, constant channels and rows, a clip threshold
    shared by several elements. Layer 0 of the per-head layout: head 0 with 3 wide key channels (blocks of 16),
    head 1 wide (4-bit, blocks of 8), head 2 with 8 (blocks of 16), head 3 with 1 (blocks of 8); values clipped at
    0.75 (floor(0.75·16) = 12 exactly)."""
    cache, oracle = _identity_cache(cache_class)
    g = torch.Generator().manual_seed(3)
    keys, values = 2 * torch.randn(1, 4, 44, 16, generator=g), 2 * torch.randn(1, 4, 44, 16, generator=g)
    block = slice(S, S + 16)  # the first key block of head 0; the first two of head 1
    ties = torch.tensor([0.0, 3.0, 0.5, 1.5, 2.5, 1.0, 2.0, 0.5, 1.5, 2.5, 0.0, 3.0, 0.5, 1.5, 2.5, 2.0])
    keys[0, 0, block, 5] = ties  # a 2-bit channel: scale 1, minimum 0, codes x ± 1/2
    keys[0, 0, block, 4] = torch.linspace(-60000.0, 150000.0, 16)  # range / 3 beyond float16: the scale saturates
    keys[0, 0, block, 6] = 0.1  # constant: the smallest normal scale, the minimum rounded to float16
    keys[0, 0, block, 0] = torch.linspace(-65000.0, 200000.0, 16)  # a 4-bit channel: range / 15 > 65504 / 4
    keys[0, 0, block, 1] = torch.linspace(-100000.0, 0.0, 16)  # a minimum below the float16 range
    keys[0, 1, block, 2] = torch.linspace(-65000.0, 200000.0, 16)  # the wide head
    keys[0, 1, block, 3] = torch.tensor([0.0, 15.0, 0.5, 1.5, 2.5, 3.5, 14.5, 7.5] * 2)  # 4-bit ties
    values[0, 0, 20] = torch.tensor([1.0, -1.0] * 8)  # every |x| is the clip threshold
    values[0, 0, 21] = torch.tensor([3.0, -3.0, 0.5, 0.0] + [1.0] * 12)  # τ = 1: a row of -1, 0, 0.5, 1
    values[0, 1, 22] = torch.linspace(-200000.0, 100000.0, 16)  # a wide head's row beyond the float16 range
    values[0, 2, 23] = 0.3  # constant
    cache.store(keys, values, 0)
    oracle.update(keys, values)
    assert cache.get_seq_length() == 44 and oracle.h == 32
    got_k, got_v = cache.layers[0].stored_states()
    want_k, want_v = oracle.stored()
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
    assert not torch.equal(got_k[:, :, block], keys[:, :, block])  # quantized, and the edges were reached:
    assert got_k[0, 0, block, 5].tolist() == [0.0, 3.0, 0.0, 2.0, 2.0, 1.0, 2.0, 0.0, 2.0, 2.0, 0.0, 3.0, 0.0, 2.0,
                                              2.0, 2.0]
    # the 4-bit channel's scale saturated at 65504 / 4 (else 17664): 15 steps above the minimum fp16(-65000) = -64992
    assert got_k[0, 0, block, 0].max() == 15 * F16_MAX / 4 - 64992.0


def test_the_block_mean_of_a_zero_bit_channel_is_rounded_to_float32_then_float16():
    """A 0-bit key channel keeps its block mean, summed exactly and rounded to float32, then to float16 (the kernel's
    arithmetic). Here the exact mean is 1 + 2^-11 + 2^-40, just above the midpoint between the float16 values 1 and
    1 + 2^-10; in float32 it becomes the midpoint 1 + 2^-11, which rounds to even: 1."""
    cache, oracle = _identity_cache(OscarCache)
    keys, values = torch.zeros(1, 4, 44, 16), torch.zeros(1, 4, 44, 16)
    keys[0, 0, S, 15] = 16 + 2.0**-7  # head 0's first key block: channel 15 is one of its 0-bit channels
    keys[0, 0, S + 1, 15] = 2.0**-36  # the sum (exact in float64) is 16 + 2^-7 + 2^-36, the mean 1 + 2^-11 + 2^-40
    cache.store(keys, values, 0)
    oracle.update(keys, values)
    assert oracle.stored()[0][0, 0, S, 15].item() == 1.0
    assert cache.layers[0].stored_states()[0][0, 0, S, 15].item() == 1.0


# --------------------------------------------------------------------------------------------- crops in a row
@pytest.mark.parametrize("cache_class", [OscarCache, StaticOscarCache])
def test_two_short_crops_in_a_row_restore_the_state_of_a_run_that_never_saw_the_tokens(cache_class):
    """Crops restore exactly the state of a cache that was never given the removed tokens, except for window positions
    whose ring slot a position R = W + 2b or more later took after them (docs/storage-format.md, positions.py). With
    S = 4, W = 8, b = 16 (R = 40): 93 tokens, then crop(-8) twice: exact.
    Then crop(-10) twice from 93 (the window of 73 tokens starts at 52, which the token at 92 overwrote in the ring):
    exact but for position 52, which comes back as the history stores it (a bug let it read the cropped token 92).

    The states are given with `store`, so that the kept tokens' keys and values are the same in both caches (through
    the model they are not: a chunk's queries read the history that chunk leaves, so the kept tokens' deeper-layer
    states depend on the removed ones); one model step on each cache then reads them."""
    model = tiny_model("llama")
    rotations = OscarRotations.data_free(model, "hadamard")
    config = OscarConfig(sink_tokens=S, window_tokens=W, demotion_block=B, key_block=B, value_clip="none")
    kw = {"max_cache_len": MAX_LEN} if cache_class is StaticOscarCache else {}
    g = torch.Generator().manual_seed(4)
    layers = model.config.num_hidden_layers
    states = [(torch.randn(1, 2, 93, 16, generator=g), torch.randn(1, 2, 93, 16, generator=g)) for _ in range(layers)]

    def filled(chunks):
        cache = cache_class(model, rotations, config, **kw)
        for a, b in chunks:
            for i, (k, v) in enumerate(states):
                cache.store(k[:, :, a:b], v[:, :, a:b], i)
        return cache

    ids = torch.randint(4, VOCAB, (1, 1), generator=g)
    with torch.no_grad():
        cropped = filled(((0, 60), (60, 73), (73, 93)))
        cropped.crop(-8)  # 85 tokens
        cropped.crop(-8)  # 77 tokens: within b + 1 = 17 of the 93 it held
        fresh = filled(((0, 60), (60, 77)))
        _assert_same_states(cropped, fresh, 77)
        position = torch.tensor([[77]])
        got = model(ids, cache=cropped, position_ids=position).logits
        want = model(ids, cache=fresh, position_ids=position).logits
        _assert_same_states(cropped, fresh, 78)
        assert (got - want).abs().max() <= 1e-5 * want.abs().max()
        # further: two crops of 10 from 93
        cropped, longest = filled(((0, 60), (60, 73), (73, 93))), filled(((0, 93),))
        cropped.crop(-10)
        cropped.crop(-10)
        fresh = filled(((0, 73),))
    for i in cropped.geometry.oscar_layers:
        k, v = cropped.layers[i].stored_states()
        k_ref, v_ref = fresh.layers[i].stored_states()
        k_long, v_long = longest.layers[i].stored_states()
        k_ref[..., 52, :], v_ref[..., 52, :] = k_long[..., 52, :], v_long[..., 52, :]  # as the history stores it
        wrong = [p for p in range(k.shape[2]) if not torch.equal(k[..., p, :], k_ref[..., p, :])]
        assert not wrong and torch.equal(v, v_ref), f"layer {i}: positions {wrong} differ"


def _assert_same_states(a, b, length):
    for i in a.geometry.oscar_layers:
        for x, y in zip(a.layers[i].stored_states(), b.layers[i].stored_states()):
            assert x.shape[2] == length and torch.equal(x, y), i
