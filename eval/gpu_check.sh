#!/usr/bin/env bash
# One GPU call: install this checkout without dependencies (the GPU image has torch, transformers and triton), run
# the kernel tests natively (no Triton interpreter: conftest sets it only without CUDA), then bench_gpu.py's
# sections. Results land in $OUT (pytest log, bench_gpu.json, the printed summary).
#
#   OUT=/some/dir bash eval/gpu_check.sh [--sections check,quant,memory,micro] [other bench_gpu.py arguments]
set -uo pipefail
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
# pytest runs from its own entry point, not `python -m pytest` from the root (the root's kernels/ would shadow names)
python3 -c "import sys, pytest; sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', 'tests/test_kernels.py']))" \
    2>&1 | tee "$OUT/pytest_kernels_gpu.log"
echo "pytest exit: ${PIPESTATUS[0]}" | tee -a "$OUT/pytest_kernels_gpu.log"
[ $# -eq 0 ] && set -- --sections check,quant,memory,micro
python3 eval/bench_gpu.py --out "$OUT" "$@" 2>&1 | tee "$OUT/bench_gpu.log"
