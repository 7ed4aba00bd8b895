#!/usr/bin/env bash
# Regenerates every raw result under eval/results/ and then eval/RESULTS.md + eval/plots/ (CPU; ~2 h on 2 shared cores).
# These are the settings of the committed JSON files (each file also records the exact command that wrote it).
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}   # one thread per process: 2-thread OpenMP thrashes on a shared 2-core box
T="--threads ${OMP_NUM_THREADS}"
oscar-hf eval all --model smollm2-135m --lengths 4096,8000 --diagnostic-sequences 1 $T   # ppl, ablations, diagnostics, niah
oscar-hf eval ppl --model gemma3-270m --sequences 2 $T
oscar-hf eval niah --model gemma3-270m --lengths 4096,8192 --depths 0.25,0.5,0.75 $T
oscar-hf eval ablations --model gemma3-270m --sequences 2 $T \
    --ablations oscar,g32,no-U,no-H,clip-none,clip-ref,shared-per-layer,logit-v
oscar-hf eval lm-eval --model smollm2-135m --tasks oscar_bb_siqa --num-fewshot 3 --limit 50 --sink 16 --window 32 \
    --residual 32 --methods bf16,oscar,oscar-ref,naive-int2,hadamard-int2,kivi2,naive-int4 $T
oscar-hf eval ppl --model qwen2.5-coder-0.5b --sequences 2 $T
oscar-hf eval niah --model qwen2.5-coder-0.5b --lengths 4096,8192,16384 --depths 0.25,0.75 $T
oscar-hf eval ppl --model qwen2.5-coder-1.5b --sequences 1 $T \
    --methods bf16,oscar,oscar-ref,naive-int2,hadamard-int2,kivi2,kivi2-g64,hf-hqq-int2,naive-int4
oscar-hf eval niah --model qwen2.5-coder-1.5b --lengths 4096 --depths 0.25,0.75 $T \
    --methods bf16,oscar,oscar-ref,naive-int2,hadamard-int2,kivi2,kivi2-g64,hf-hqq-int2,naive-int4
oscar-hf eval diagnostics --model qwen2.5-coder-0.5b --diagnostic-sequences 1 $T
oscar-hf eval diagnostics --model gemma3-270m --diagnostic-sequences 1 $T
oscar-hf eval diagnostics --model smollm2-135m --diagnostic-sequences 1 $T
python eval/make_results.py
