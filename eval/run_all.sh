#!/usr/bin/env bash
# Reruns, on the CPU with today's code, the perplexity and needle runs behind eval/RESULTS.md, then writes the page
# (many hours on 2 shared cores; the 16K needle trials take minutes each). The committed files were built up run by
# run, on the CPU and on an H200 (`eval/gpu_eval.sh`); each cell's own command is beside it in RESULTS.md and in its
# JSON. This script reruns the same protocol in one go into OUTPUT (default eval/results: trials measured again
# replace the stored ones, the others stay).
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}   # one thread per process: 2-thread OpenMP thrashes on a shared 2-core box
OUTPUT=${OUTPUT:-eval/results}
RUN="--threads ${OMP_NUM_THREADS} --output ${OUTPUT} --quiet"
PEERS=bf16,oscar,oscar-token,oscar-ref,naive-int2,hadamard-int2,kivi2,kivi2-g64,kivi2-g128,hf-hqq-int2,naive-int4
DOMAIN_PEERS=bf16,oscar,oscar-token,kivi2-g64,kivi2
# model, perplexity sequences, longer needle lengths (SmolLM2 holds 8,192 positions: 8,000 leaves the question room)
for spec in smollm2-135m:3:8000 gemma3-270m:2:8192,16384 qwen2.5-coder-0.5b:2:8192,16384 \
            qwen2.5-coder-1.5b:1:8192,16384; do
  IFS=: read -r model sequences longer <<< "$spec"
  oscar-hf eval ppl --model "$model" --sequences "$sequences" --methods "$PEERS" $RUN
  for domain in python shakespeare; do
    oscar-hf eval ppl --model "$model" --sequences "$sequences" --domain "$domain" --methods "$DOMAIN_PEERS" $RUN
  done
  oscar-hf eval niah --model "$model" --methods "$PEERS" --lengths 4096 --seeds 0,1 $RUN
  oscar-hf eval niah --model "$model" --methods bf16,oscar,oscar-token,kivi2-g64 --lengths "$longer" --seeds 0,1 $RUN
  for domain in python shakespeare; do
    oscar-hf eval niah --model "$model" --methods bf16,oscar,kivi2-g64 --domain "$domain" \
      --lengths "4096,${longer%%,*}" --seeds 0,1 $RUN
  done
done
for model in qwen2.5-coder-0.5b qwen2.5-coder-1.5b; do   # four needles of the same pattern, one asked for
  oscar-hf eval niah --model "$model" --methods bf16,oscar,oscar-token,kivi2-g64 --needles 4 --lengths 4096 \
    --seeds 0,1 $RUN
  oscar-hf eval niah --model "$model" --methods bf16,oscar,kivi2-g64 --needles 4 --domain python --lengths 4096 \
    --seeds 0,1,2,3 $RUN
done
python eval/make_results.py
