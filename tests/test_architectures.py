"""Architectures outside the tested list warn once; GPT-2 (absolute positions, fused c_attn, 1024 positions) works
end to end: the cache matches DynamicCache without quantization, and the CLI calibrates and generates."""

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache, GPT2Config, PhiConfig

from conftest import VOCAB, char_tokenizer
from oscar_hf import OscarCache, OscarConfig, OscarRotations, StaticOscarCache, models
from oscar_hf.cli import main
from oscar_hf.models import TESTED_MODEL_TYPES, model_geometry
from test_calibrate import TEXT


def tiny_gpt2(positions: int = 1024, attn: str = "oscar"):
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=positions, bos_token_id=1,
                        eos_token_id=2, pad_token_id=0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn).eval()
    with torch.no_grad():  # sharper attention, as tiny_model does
        for name, p in model.named_parameters():
            if name.endswith("c_attn.weight"):
                p.mul_(4.0)
    return model


def tiny_neox(seed: int = 0, attn: str = "sdpa"):
    from transformers import GPTNeoXConfig

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(GPTNeoXConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=512, rotary_pct=0.25, bos_token_id=1, eos_token_id=2), attn_implementation=attn).eval()


def test_an_untested_model_type_warns_once_naming_the_list(monkeypatch):
    monkeypatch.setattr(models, "_warned_untested", set())
    config = PhiConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=2, intermediate_size=96)
    with pytest.warns(UserWarning, match=r"model_type 'phi' is not among .*\(" + ", ".join(TESTED_MODEL_TYPES)):
        model_geometry(config)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model_geometry(config)  # once per process


@pytest.mark.parametrize("attn", ["oscar", "sdpa"])
def test_gpt2_without_quantization_equals_dynamic_cache(attn):
    model = tiny_gpt2(attn=attn)
    ids = torch.randint(3, VOCAB, (1, 60), generator=torch.Generator().manual_seed(0))
    cache = OscarCache(model, OscarRotations.data_free(model, "hadamard"),
                       OscarConfig(bits=16, sink_tokens=4, window_tokens=8, key_clip="none", value_clip="none"))
    reference = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids[:, :40], cache=cache)
        model(ids[:, :40], cache=reference)
        torch.testing.assert_close(model(ids[:, 40:], cache=cache).logits, model(ids[:, 40:], cache=reference).logits,
                                   atol=1e-5, rtol=1e-5)


def test_gpt2_calibrates_within_its_positions_and_generates(tmp_path, capsys):
    folder = tmp_path / "gpt2"
    tiny_gpt2(positions=512, attn="sdpa").save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)
    data = tmp_path / "calib.txt"
    data.write_text(TEXT * 2)
    # Defaults: 2048-token sequences and 1024 held-out tokens, more than the model's 512 positions.
    assert main(["calibrate", "--model", str(folder), "--data", str(data), "--tokens", "512", "--dtype", "float32",
                 "--quiet"]) == 0
    assert "calibration sequence length and held-out tokens lowered to the model's 512 positions" in capsys.readouterr().err
    assert OscarRotations.from_pretrained(folder).metadata["weight_fingerprint"]["sha256"]
    assert main(["generate", "--model", str(folder), "--prompt", TEXT[:400], "--max-new-tokens", "4",
                 "--dtype", "float32"]) == 0
    assert "in the INT2 history" in capsys.readouterr().out


def tiny_gemma3_vlm(attn: str = "oscar"):
    """A tiny random Gemma3ForConditionalGeneration (how transformers loads Gemma-3 4B/12B/27B): a SigLIP vision
    tower (hidden 24, its own `layers.N.self_attn` with q/k/v projections) and a Gemma-3 text model (KV rows 32)."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig, SiglipVisionConfig

    torch.manual_seed(0)
    text = Gemma3TextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                            sliding_window=12, layer_types=["sliding_attention", "full_attention"] * 2,
                            query_pre_attn_scalar=16, pad_token_id=0, bos_token_id=1, eos_token_id=None)
    vision = SiglipVisionConfig(hidden_size=24, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                                image_size=28, patch_size=14)
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=VOCAB - 1,
                          boi_token_index=VOCAB - 3, eoi_token_index=VOCAB - 2)
    model = Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():  # sharper attention, as tiny_model does
        for name, p in model.named_parameters():
            if "language_model" in name and name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(4.0)
    model.set_attn_implementation(attn)
    return model


def test_a_vision_language_model_generates_like_dynamic_cache():
    """Guards (4): a Gemma3ForConditionalGeneration is not refused for its vision tower (whose k_proj, 24 rows, was
    taken for a tensor-parallel shard of the 32 text KV rows): the cache builds on the language model's layers only,
    and with bits=16 generates exactly DynamicCache's tokens, from text and from an image; the 2-bit cache runs."""
    from oscar_hf.models import decoder_attention, kv_head_shards

    model = tiny_gemma3_vlm()
    assert sorted(decoder_attention(model)) == [0, 1, 2, 3]
    assert all("language_model" in name for name, _ in decoder_attention(model).values())
    assert kv_head_shards(model, 16, 2) == {}
    rotations = OscarRotations.data_free(model, "hadamard")
    exact = OscarConfig(bits=16, sink_tokens=4, window_tokens=8, key_clip="none", value_clip="none")
    text_ids = torch.randint(3, VOCAB - 4, (1, 30), generator=torch.Generator().manual_seed(0))
    image_ids = torch.tensor([[1, 5, 6, VOCAB - 3] + [VOCAB - 1] * 4 + [VOCAB - 2] + list(range(20, 45))])
    pixels = torch.randn(1, 3, 28, 28, generator=torch.Generator().manual_seed(1))
    for ids, extra in ((text_ids, {}), (image_ids, {"pixel_values": pixels})):
        kw = dict(max_new_tokens=12, do_sample=False, pad_token_id=0, **extra)
        with torch.no_grad():
            ours = model.generate(ids, cache=OscarCache(model, rotations, exact), **kw)
            reference = model.generate(ids, cache=DynamicCache(config=model.config), **kw)
            two_bit = model.generate(ids, cache=OscarCache(model, rotations, OscarConfig(
                sink_tokens=4, window_tokens=8, key_clip="none", value_clip="none")), **kw)
        assert ours.tolist() == reference.tolist()
        assert two_bit.shape == reference.shape


def test_a_vision_language_model_calibrates_on_its_language_model(tmp_path):
    """Guards (4): calibration and the weight fingerprint see only the language model's attention layers (the vision
    tower's layers 0-1 would otherwise stand in for text layers 0-1)."""
    from oscar_hf.calibrate import calibrate
    from oscar_hf.rotations_io import weight_fingerprint
    from test_calibrate import CAL, LAYOUT

    model = tiny_gemma3_vlm(attn="sdpa")
    data = tmp_path / "calib.txt"
    data.write_text(TEXT)
    rotations = calibrate(model, char_tokenizer(), data=str(data), config=LAYOUT, calibration=CAL, progress=False)
    assert rotations.layers == [1, 3]
    tensors = weight_fingerprint(model)["sketch"]["tensors"]
    assert {name.split(".", 2)[2] for name in tensors} == {"q_proj.weight", "k_proj.weight", "v_proj.weight",
                                                            "q_norm.weight", "k_norm.weight"}
    assert tensors["layers.0.k_proj.weight"]["shape"] == [32, 64] and len(tensors) == 4 * 5
    vision = model.model.vision_tower.encoder.layers[0].self_attn.k_proj.weight
    with torch.no_grad():
        vision.mul_(2.0)  # the vision tower is no part of the fingerprint
    rotations.check_fingerprint(model)
    model.set_attn_implementation("oscar")
    OscarCache(model, rotations, LAYOUT)


def test_gpt_neox_rotations_carry_a_fingerprint_that_verifies(tmp_path, capsys):
    """Guards (15): GPT-NeoX's fused `query_key_value` is fingerprinted, so rotations just written by `oscar-hf
    calibrate` are not said to "record no weight fingerprint (recalibrate with `oscar-hf calibrate`)", and other
    weights of the same shapes are refused."""
    folder, other = tmp_path / "neox", tmp_path / "other"
    for path, seed in ((folder, 0), (other, 1)):
        tiny_neox(seed).save_pretrained(path)
        char_tokenizer().save_pretrained(path)
    data = tmp_path / "calib.txt"
    data.write_text(TEXT * 2)
    assert main(["calibrate", "--model", str(folder), "--data", str(data), "--tokens", "512", "--dtype", "float32",
                 "--quiet"]) == 0
    tensors = OscarRotations.from_pretrained(folder).metadata["weight_fingerprint"]["sketch"]["tensors"]
    assert "layers.1.query_key_value.weight" in tensors
    capsys.readouterr()
    gen = ["--prompt", TEXT[:100], "--max-new-tokens", "2", "--dtype", "float32"]
    assert main(["generate", "--model", str(folder), *gen]) == 0
    assert "fingerprint" not in capsys.readouterr().err
    assert main(["generate", "--model", str(other), "--rotations", str(folder / "oscar"), *gen]) == 2
    assert "calibrated on other weights" in capsys.readouterr().err


def test_gpt_neox_takes_oscar_cache_and_refuses_a_static_one_when_it_is_built():
    """GPT-NeoX's attention calls `cache.update` without the kwargs it gives the attention function, so the fused
    "oscar" attention gets no stored history from it: `OscarCache` returns the history dequantized (without
    quantization, the same logits as DynamicCache), and `StaticOscarCache`, which only the fused attention can read,
    is refused in one line when it is built (it failed inside sdpa at the first decode step)."""
    model = tiny_neox(attn="oscar")
    rotations = OscarRotations.data_free(model, "hadamard")
    with pytest.raises(ValueError, match="GPTNeoXAttention does not .* use OscarCache"):
        StaticOscarCache(model, rotations, max_cache_len=64)
    cache = OscarCache(model, rotations, OscarConfig(bits=16, sink_tokens=4, window_tokens=8, key_clip="none",
                                                     value_clip="none"))
    reference = DynamicCache(config=model.config)
    ids = torch.randint(3, VOCAB, (1, 44), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(ids[:, :40], cache=cache)
        model(ids[:, :40], cache=reference)
        for t in range(40, 44):
            torch.testing.assert_close(model(ids[:, t : t + 1], cache=cache).logits,
                                       model(ids[:, t : t + 1], cache=reference).logits, atol=1e-5, rtol=1e-5)
