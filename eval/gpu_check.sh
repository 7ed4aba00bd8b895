#!/usr/bin/env bash
# One GPU call: lay this checkout out as the installed package (`gpu_site.sh`), then run bench_gpu.py's sections;
# its `check` section is the GPU correctness check of the kernels against their torch twins at realistic shapes
# (tests/test_kernels.py checks the same on the CPU in the Triton interpreter). Results land in $OUT.
#
#   OUT=/some/dir bash eval/gpu_check.sh [--sections check,quant,memory,micro] [other bench_gpu.py arguments]
#   BENCH=bench_generate.py OUT=/some/dir bash eval/gpu_check.sh [bench_generate.py arguments]
# Wheels in gpu-wheels/ (e.g. hqq for transformers' QuantizedCache, which the GPU image lacks) go into the same site,
# and transformers 5.24 from .whl/ where the image's is older (carry .whl: eval/README.md).
set -uo pipefail
source "$(dirname "$0")/gpu_site.sh"
cd "$SITE"  # not the repository root, where ./oscar_hf (without kernels) would come first on sys.path
BENCH=${BENCH:-bench_gpu.py}
[ $# -eq 0 ] && [ "$BENCH" = bench_gpu.py ] && set -- --sections check,quant,memory,micro
python3 "$REPO/eval/$BENCH" --out "$OUT" "$@" 2>&1 | tee "$OUT/${BENCH%.py}.log"
