"""Architectures outside the tested list warn once; GPT-2 (absolute positions, fused c_attn, 1024 positions) works
end to end: the cache matches DynamicCache without quantization, and the CLI calibrates and generates."""

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache, GPT2Config, PhiConfig

from conftest import VOCAB, char_tokenizer
from oscar_hf import OscarCache, OscarConfig, OscarRotations, models
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
    assert "calibration_sequence_length, heldout_tokens lowered to the model's 512 positions" in capsys.readouterr().err
    assert OscarRotations.from_pretrained(folder).metadata["weight_fingerprint"]["sha256"]
    assert main(["generate", "--model", str(folder), "--prompt", TEXT[:400], "--max-new-tokens", "4",
                 "--dtype", "float32"]) == 0
    assert "in the INT2 history" in capsys.readouterr().out
