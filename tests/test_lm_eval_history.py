"""The `oscar` lm-eval model on tiny random models: bundled model names resolve offline (never the Hub), and every
run says how many scored tokens attended to quantized history (short prompts stay in the BF16 windows)."""

import logging

import pytest
import torch

from conftest import char_tokenizer, tiny_model


@pytest.fixture
def offline_tiny(tmp_path, monkeypatch):
    """`smollm2-135m` resolves to a tiny model folder; the Hub is off (a lookup fails at once instead of retrying)."""
    import huggingface_hub

    from oscar_hf import assets

    folder = tmp_path / "models" / "smollm2-135m"
    tiny_model("llama", attn="sdpa").save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)
    monkeypatch.setattr(assets, "model_path", lambda name: tmp_path / "models" / name)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return folder


def test_bundled_model_names_resolve_offline(offline_tiny):
    """Guards (11): `pretrained=smollm2-135m` (no `offline:` prefix) loads the bundled model's folder, for the oscar
    model type and, through `oscar-hf lm-eval`'s argument rewrite, for any other (`--model hf`); it went to the Hub
    (38 s of retries, then a traceback ending in "couldn't connect to 'https://huggingface.co'")."""
    from oscar_hf.evaluation.lm_eval_model import OscarLM, resolve_model_args

    lm = OscarLM(pretrained="smollm2-135m", method="bf16", dtype="float32", device="cpu", batch_size=1)
    assert lm.model.config.num_hidden_layers == 3 and lm.model.config._name_or_path == str(offline_tiny)
    argv = ["--model", "hf", "--model_args", "pretrained=smollm2-135m,dtype=float32", "--tasks", "t",
            "-a", '{"pretrained": "offline:smollm2-135m"}', "--model_args=pretrained=org/hub-model"]
    assert resolve_model_args(argv) == ["--model", "hf", "--model_args", f"pretrained={offline_tiny},dtype=float32",
                                        "--tasks", "t", "-a", f'{{"pretrained": "{offline_tiny}"}}',
                                        "--model_args=pretrained=org/hub-model"]


def test_each_run_reports_how_many_scored_tokens_reached_the_history(caplog):
    """Guards (11): a context inside the BF16 sink + window is scored in full precision; the model counts the scored
    tokens whose query attended to quantized history and logs it after the run (a warning when none did, since the
    score then measures BF16)."""
    from oscar_hf.evaluation.lm_eval_model import OscarLM

    lm = OscarLM(pretrained=tiny_model("llama"), tokenizer=char_tokenizer(), method="naive-int2", sink=4, window=8,
                 batch_size=1)
    ids = torch.randint(4, 100, (120,), generator=torch.Generator().manual_seed(0)).tolist()
    short, long = (None, ids[:6], ids[6:9]), (None, ids[:100], ids[100:103])
    with caplog.at_level(logging.INFO, logger="lm_eval.oscar"):
        lm._loglikelihood_tokens([short], disable_tqdm=True)
        assert (lm.scored_tokens, lm.history_tokens) == (3, 0)
        assert caplog.records[-1].levelno == logging.WARNING
        assert "0 of 3 scored tokens (0%) attended to quantized history" in caplog.records[-1].getMessage()
        assert "sink 4 + window 8 tokens" in caplog.records[-1].getMessage()
        lm._loglikelihood_tokens([long, short], disable_tqdm=True)
    assert (lm.scored_tokens, lm.history_tokens) == (9, 3)
    assert caplog.records[-1].levelno == logging.INFO
    assert "3 of 9 scored tokens (33%) attended to quantized history" in caplog.records[-1].getMessage()
