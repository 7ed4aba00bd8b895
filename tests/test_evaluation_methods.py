"""The method registry: every method builds a working cache, bits are honest, and the NIAH cache surgery
(`fill_from_prefill`) is equivalent to a method's own prefill."""

import pytest
import torch
from transformers import DynamicCache

from conftest import char_tokenizer, tiny_model
from oscar_hf import CalibrationConfig, OscarCache, OscarConfig
from oscar_hf.calibrate import RotationTargets, calibrate
from oscar_hf.evaluation.methods import (
    RotationStore, Windows, ablation_methods, cache_bits, fill_from_prefill, format_methods, get_method,
    main_methods,
    nominal_history_bits,
)
from oscar_hf.metrics import cache_kwarg

TEXT = "The quick brown fox jumps over the lazy dog. " * 400


@pytest.fixture(scope="module")
def calibrated():
    model = tiny_model("llama")
    rotations = calibrate(model, char_tokenizer(), data=_text_file(), config=OscarConfig(sink_tokens=16, window_tokens=32),
                          calibration=CalibrationConfig(tokens=512, sequence_length=256, heldout_tokens=384),
                          progress=False)
    return model, rotations


def _text_file():
    import tempfile

    f = tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False)
    f.write(TEXT)
    f.close()
    return f.name


def test_registry_names_and_errors():
    methods = main_methods()
    assert list(methods)[:4] == ["bf16", "oscar", "oscar-token", "oscar-ref"]
    assert methods["oscar"].oscar == OscarConfig()  # the `oscar` row is the library's default
    for name in ("oscar-token", "oscar-ref", "naive-int2", "hadamard-int2", "naive-int4"):  # the paper's layout
        assert (methods[name].oscar.key_granularity, methods[name].oscar.demotion_block) == ("token", 8)
    for name in ("naive-int2", "hadamard-int2", "kivi2", "hf-hqq-int2", "naive-int4", "oscar-s32w64", "kivi2-g64"):
        assert name in methods
    ref = methods["oscar-ref"]
    assert (ref.targets.per_head, ref.targets.value_target, ref.oscar.key_clip, ref.oscar.value_clip) == (
        False, "logit", 0.96, 0.92)
    assert methods["naive-int2"].oscar.key_clip == "none" and methods["naive-int2"].rotations == "identity"
    assert {"no-U", "no-H", "no-P", "ktk-vtv", "sw-0-0", "sw-32-128", "sw-128-512", "clip-ref"} <= set(ablation_methods())
    with pytest.raises(ValueError, match="unknown method"):
        get_method("int1")
    with pytest.raises(ValueError, match="needs calibrated"):
        methods["oscar"].make_cache(tiny_model("llama"))
    small = main_methods(Windows(8, 16, 32))
    assert (small["oscar"].oscar.sink_tokens, small["oscar"].oscar.window_tokens, small["kivi2"].kivi.residual) == (8, 16, 32)


def test_nominal_bits_follow_the_papers_accounting():
    methods = main_methods()
    assert nominal_history_bits(methods["oscar-token"], 128) == 2.25  # the paper's 2.25 (+ windows -> 2.28 at 128K)
    assert nominal_history_bits(methods["oscar-token"], 64) == 2.5  # head_dim 64: 16-bit scale + min cost 0.5 bit
    # keys 2 + 32/64 (per channel per 64 tokens), values 2 + 32/head_dim (per token)
    no_wide = format_methods()["oscar-no-wide"]
    assert nominal_history_bits(no_wide, 128) == 2.375
    assert nominal_history_bits(no_wide, 64) == 2.5
    # the default: wide heads (4 bits) up to 2.4375 / 2.75 bits, at most
    assert nominal_history_bits(methods["oscar"], 128) == 2.4375
    assert nominal_history_bits(methods["oscar"], 64) == 2.75
    assert nominal_history_bits(methods["kivi2"], 64) == 3.0  # a group of 32 tokens costs 1 bit
    assert nominal_history_bits(methods["kivi2-g64"], 64) == 2.5
    assert nominal_history_bits(methods["naive-int4"], 64) == 4.5
    assert nominal_history_bits(methods["bf16"], 64) == 16


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_every_method_makes_a_cache_that_generates(family, calibrated):
    model = tiny_model(family)
    rotations = calibrate(model, char_tokenizer(), data=_text_file(),
                          calibration=CalibrationConfig(tokens=256, sequence_length=256, heldout_tokens=384),
                          progress=False)
    ids = torch.randint(4, 100, (1, 320))  # a multiple of 64: transformers' QuantizedCache needs it with HQQ
    for name, method in main_methods().items():
        cache = method.make_cache(model, rotations if method.needs_calibration else None)
        out = model.generate(ids, max_new_tokens=6, do_sample=False, **{cache_kwarg(model): cache})
        assert out.shape == (1, 326), name
        bits = cache_bits(cache)
        assert bits["tokens"] == 325, name
        assert 0 < bits["bits_per_element"] <= 32, name


def test_cache_bits_for_oscar_kivi_and_bf16():
    model = tiny_model("llama", head_dim=64, hidden_size=128, num_attention_heads=2, num_key_value_heads=1)
    n = 4096
    k = torch.randn(1, 1, n, 64).bfloat16()
    cache = OscarCache(model.config, main_methods()["naive-int2"].make_cache(model).rotations,
                       OscarConfig(key_clip="none", value_clip="none"))
    for layer in range(3):
        cache.update(k, k, layer)
    # 320 BF16 tokens + the rest at 2.5 bits (head_dim 64), recent window holds 256..263 tokens
    b = cache_bits(cache)
    history = cache.plan.counts(n)[1]
    assert b["bits_per_element"] == pytest.approx(((n - history) * 16 + history * 2.5) / n, rel=1e-6)
    dyn = DynamicCache(config=model.config)
    for layer in range(3):
        dyn.update(k, k, layer)
    assert cache_bits(dyn)["bits_per_element"] == 16


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_fill_from_prefill_equals_the_methods_own_prefill(family):
    """The NIAH shortcut: a BF16 prefill copied into a method's cache gives the same continuation logits as running
    the method's cache from the start (float32; OSCAR's rotated attention differs only by rounding)."""
    model = tiny_model(family)
    ids = torch.randint(4, 100, (1, 448))
    kw = cache_kwarg(model)
    with torch.no_grad():
        bf16 = DynamicCache(config=model.config)
        model(input_ids=ids[:, :384], **{kw: bf16})
        for name in ("naive-int2", "hadamard-int2", "kivi2", "hf-hqq-int2", "naive-int4"):
            method = main_methods(Windows(16, 32, 32))[name]
            direct = method.make_cache(model)
            model(input_ids=ids[:, :384], **{kw: direct})
            expected = model(input_ids=ids[:, 384:], **{kw: direct}).logits
            filled = fill_from_prefill(method.make_cache(model), bf16)
            got = model(input_ids=ids[:, 384:], **{kw: filled}).logits
            torch.testing.assert_close(got, expected, atol=2e-4, rtol=1e-4, msg=name)
            # and quantization did change something
            assert not torch.allclose(got, model(input_ids=ids).logits[:, 384:], atol=1e-3), name


def test_rotation_store_calibrates_once_and_reuses_statistics(calibrated):
    model, _ = calibrated
    store = RotationStore(model, char_tokenizer(), data=_text_file(), calibration_tokens=512, progress=False,
                          calibration_sequence_length=256)
    base = OscarConfig(sink_tokens=16, window_tokens=32)
    calibration = CalibrationConfig(heldout_tokens=384)
    from oscar_hf.evaluation.methods import Method

    a = store.rotations_for(Method("a", "a", "oscar", "calibrated", base, calibration))
    stats = store.statistics
    b = store.rotations_for(Method("b", "b", "oscar", "calibrated", base, calibration, RotationTargets(hadamard=False)))
    assert store.statistics is stats and a is not b
    assert store.rotations_for(Method("a2", "a", "oscar", "calibrated", base, calibration)) is a
    assert store.rotations_for(Method("n", "n", "oscar", "identity", base)) is None


def test_each_setting_that_changes_a_calibration_gets_its_own_folder():
    from oscar_hf.evaluation.methods import Method, calibration_key

    def key(**changes):
        config = OscarConfig(**{k: v for k, v in changes.items() if k in OscarConfig.__dataclass_fields__})
        calibration = CalibrationConfig(**{k: v for k, v in changes.items() if k in CalibrationConfig.__dataclass_fields__})
        targets = changes.get("targets", RotationTargets())
        return calibration_key(Method("m", "m", "oscar", "calibrated", config, calibration, targets), 8192, 2048)

    variants = [key(), key(clip_grid=(0.8, 0.9, 1.0)), key(clip_grid=(0.8, 1.0)), key(sink_tokens=32),
                key(wide_heads="none"), key(targets=RotationTargets(per_head=False)), key(heldout_tokens=512)]
    assert len(set(variants)) == len(variants)
    assert key() == key()
