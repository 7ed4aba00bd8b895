#!/usr/bin/env bash
# One GPU call: lay this checkout out as the installed package (oscar_hf with kernels/ as oscar_hf.kernels; the GPU
# image has torch, transformers and triton, and no index to build an editable install from), then run bench_gpu.py's
# sections; its `check` section is the GPU correctness check of the kernels against their torch twins at realistic
# shapes (tests/test_kernels.py checks the same on the CPU in the Triton interpreter). Results land in $OUT.
#
#   OUT=/some/dir bash eval/gpu_check.sh [--sections check,quant,memory,micro] [other bench_gpu.py arguments]
#   BENCH=bench_generate.py OUT=/some/dir bash eval/gpu_check.sh [bench_generate.py arguments]
# Wheels in gpu-wheels/ (git-ignored; give it to the device tool as `carry`: e.g. hqq for transformers' QuantizedCache, which the GPU image lacks) are
# installed into the same temporary site first.
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$REPO/gpu-out}
SITE=$(mktemp -d)
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 PYTHONPATH="$SITE"
cp -r "$REPO/oscar_hf" "$SITE/oscar_hf" && cp -r "$REPO/kernels" "$SITE/oscar_hf/kernels"
if ls "$REPO"/gpu-wheels/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-deps --no-index --target "$SITE" "$REPO"/gpu-wheels/*.whl 2>&1 | tail -2
fi
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
cd "$SITE"  # not the repository root, where ./oscar_hf (without kernels) would come first on sys.path
BENCH=${BENCH:-bench_gpu.py}
[ $# -eq 0 ] && [ "$BENCH" = bench_gpu.py ] && set -- --sections check,quant,memory,micro
python3 "$REPO/eval/$BENCH" --out "$OUT" "$@" 2>&1 | tee "$OUT/${BENCH%.py}.log"
