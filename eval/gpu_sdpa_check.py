"""Diagnostic (GPU): does torch's SDPA backend choice break Gemma-3-270M's BF16 answers on the H200?

On the H200, BF16 Gemma-3 gave broken needle answers (`' 1 1 1 1'`) on trials the CPU answers
(`results/gpu/gpu_eval_niah_gemma_call6.log`). Gemma-3's local layers are masked sliding-window attention at head_dim
256; a public report (NVIDIA-NeMo/Automodel#3232) finds cuDNN SDPA wrong there on SM90. This runs those trials in
plain BF16 (a DynamicCache, no OSCAR involved) under each SDPA backend set and prints the answers and how far each
backend's last-token logits are from the math backend's (fp32 accumulation):

    python3 eval/gpu_sdpa_check.py [model] [length]     # under gpu_site.sh's PYTHONPATH, on the GPU machine

Result (`results/gpu/gemma_sdpa_check.log`): every backend gives the same wrong answers, within 0.41 of the math
backend's logits, so attention was not the cause; neither was bf16 (float32 answers the same,
`gemma_dtype_check.log`). The cause was the tokenizer that transformers 5.17 converts from the GGUF file: one token per
character (`gemma_tokenizer_check.log`); `assets.check_tokenizer_merges` now refuses such a conversion.
"""
import os
import sys
from contextlib import nullcontext

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from oscar_hf.evaluation.domains import evaluation_texts
from oscar_hf.evaluation.niah import answer_matches, greedy_answer, make_trial, prefill
from oscar_hf.evaluation.runner import load

B = SDPBackend
SETTINGS = {  # name -> backends allowed (None: torch's default choice)
    "default": None,
    "no-cudnn": [B.FLASH_ATTENTION, B.EFFICIENT_ATTENTION, B.MATH],
    "cudnn-only": [B.CUDNN_ATTENTION],
    "efficient-only": [B.EFFICIENT_ATTENTION],
    "math-only": [B.MATH],
}


@torch.no_grad()
def last_logits(model, ids):
    return model(input_ids=ids.to(model.device), logits_to_keep=1).logits[0, -1].float()


def main(model_name="gemma3-270m", length=8192):
    model, tokenizer, info = load(model_name, device=os.environ.get("DEVICE", "cuda"))  # DEVICE=cpu: a dry run
    print(f"{info['name']} on {info['device']}, torch {torch.__version__}, cudnn {torch.backends.cudnn.version()}")
    docs, _ = evaluation_texts("essays")
    for depth, seed in ((0.1, 0), (0.1, 1), (0.3, 1), (0.5, 0)):
        trial = make_trial(tokenizer, docs, length, depth, seed)
        ids = torch.cat([trial.haystack_ids, trial.question_ids], dim=1)
        with sdpa_kernel([B.MATH]):
            reference = last_logits(model, ids)
        for name, backends in SETTINGS.items():
            try:
                with sdpa_kernel(backends) if backends else nullcontext():
                    cache = prefill(model, trial.haystack_ids)
                    text = tokenizer.decode(greedy_answer(model, cache, trial.question_ids, 8), skip_special_tokens=True)
                    logits = last_logits(model, ids)
                gap = (logits - reference).abs().max().item()
                print(f"L={length} depth={depth} seed={seed} {name:>14}: hit={answer_matches(text, trial.key)!s:5} "
                      f"max|logit - math|={gap:8.3f} answer={text!r}")
            except RuntimeError as error:  # a backend that cannot run this shape says so
                print(f"L={length} depth={depth} seed={seed} {name:>14}: not available ({str(error).splitlines()[0][:120]})")


if __name__ == "__main__":
    main(*(sys.argv[1:2] or ["gemma3-270m"]), *(int(a) for a in sys.argv[2:3]))
