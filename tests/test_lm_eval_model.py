"""The `oscar` lm-eval model type: quantization must reach loglikelihood scoring (lm-eval #1105/#3298), BF16 must
reproduce plain HFLM, and the offline command line must work."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def smollm2_fp32():
    from oscar_hf import assets

    return assets.load_model("smollm2-135m", dtype=torch.float32, attn_implementation="oscar")


def _loglikelihoods(lm):
    import lm_eval

    from oscar_hf.evaluation.lm_eval_model import task_manager

    out = lm_eval.simple_evaluate(model=lm, tasks=["oscar_bb_siqa"], task_manager=task_manager(), limit=4,
                                  num_fewshot=1, log_samples=True, random_seed=0, numpy_random_seed=0,
                                  torch_random_seed=0, fewshot_random_seed=0, bootstrap_iters=0)
    return np.array([r[0][0] for s in out["samples"]["oscar_bb_siqa"] for r in s["resps"]])


def test_quantization_reaches_loglikelihood_scoring(smollm2_fp32):
    from lm_eval.models.huggingface import HFLM

    from oscar_hf.evaluation.lm_eval_model import OscarLM

    model, tok = smollm2_fp32
    plain = _loglikelihoods(HFLM(pretrained=model, tokenizer=tok, batch_size=1))
    bf16 = _loglikelihoods(OscarLM(pretrained=model, tokenizer=tok, method="bf16", batch_size=1))
    naive = _loglikelihoods(OscarLM(pretrained=model, tokenizer=tok, method="naive-int2", sink=0, window=0,
                                    residual=32, batch_size=1))
    assert len(plain) == 12  # 4 questions x 3 choices
    # an unquantized cache reproduces plain HFLM: the context/continuation split changes nothing but rounding
    np.testing.assert_allclose(bf16, plain, atol=2e-3)
    # naive INT2 with no full-precision window changes every loglikelihood, by a lot on average
    assert np.all(np.abs(naive - plain) > 1e-3)
    assert np.mean(np.abs(naive - plain)) > 0.5


def test_lm_eval_command_line_with_the_oscar_model_type(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    cmd = [sys.executable, "-m", "oscar_hf.cli", "lm-eval", "--model", "oscar",
           "--model_args", "pretrained=offline:smollm2-135m,method=naive-int2,sink=0,window=0,dtype=bfloat16",
           "--tasks", "oscar_bb_siqa", "--limit", "2", "--device", "cpu", "--batch_size", "1",
           "--output_path", str(tmp_path)]
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    files = list(tmp_path.rglob("results_*.json"))
    assert files, result.stdout[-2000:]
    res = json.loads(files[0].read_text())
    assert "oscar_bb_siqa" in res["results"] and res["config"]["model"] == "oscar"
    assert res["config"]["model_args"]["method"] == "naive-int2"


def test_generate_until_uses_the_methods_cache(smollm2_fp32):
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from oscar_hf.evaluation.lm_eval_model import OscarLM

    model, tok = smollm2_fp32
    request = [Instance(request_type="generate_until", doc={}, idx=0,
                        arguments=("The capital of France is", {"until": ["\n"], "max_gen_toks": 6, "do_sample": False}))]
    plain = HFLM(pretrained=model, tokenizer=tok, batch_size=1).generate_until(request)
    lm = OscarLM(pretrained=model, tokenizer=tok, method="bf16", batch_size=1)
    made = []
    original = lm.make_cache
    lm.make_cache = lambda: made.append(1) or original()
    assert lm.generate_until(request) == plain
    assert made == [1]


def test_the_long_bundled_task_reaches_the_history_and_zero_shot_does_not(smollm2_fp32):
    """Guards (11): with the default 64 + 256-token BF16 windows a 0-shot oscar_bb_siqa prompt is never quantized
    (its score measures BF16, and the run says so), while the bundled oscar_bb_siqa_long (25-shot by default) puts
    every scored token's context partly in the INT2 history."""
    import lm_eval

    from oscar_hf.evaluation.lm_eval_model import OscarLM, task_manager

    model, tok = smollm2_fp32
    seen = {}
    for task, shots in (("oscar_bb_siqa", 0), ("oscar_bb_siqa_long", None)):
        lm = OscarLM(pretrained=model, tokenizer=tok, method="naive-int2", batch_size=1)
        lm_eval.simple_evaluate(model=lm, tasks=[task], task_manager=task_manager(), limit=1, num_fewshot=shots,
                                random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0,
                                bootstrap_iters=0)
        seen[task] = (lm.scored_tokens, lm.history_tokens)
    assert seen["oscar_bb_siqa"][0] > 0 and seen["oscar_bb_siqa"][1] == 0
    assert seen["oscar_bb_siqa_long"][1] == seen["oscar_bb_siqa_long"][0] > 0
