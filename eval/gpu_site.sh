# Sourced by the GPU scripts (gpu_check.sh, gpu_eval.sh): lays this checkout out as the installed package in a
# temporary site (oscar_hf with kernels/ as oscar_hf.kernels; the GPU image has torch, transformers and triton, and no
# index to build an editable install from) and installs the wheels in gpu-wheels/ (git-ignored; given to the device
# tool as `carry`: e.g. hqq, or gguf for loading the offline models) into it. Sets REPO, OUT, SITE.
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT=${OUT:-$REPO/gpu-out}
SITE=$(mktemp -d)
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 PYTHONPATH="$SITE"
cp -r "$REPO/oscar_hf" "$SITE/oscar_hf" && cp -r "$REPO/kernels" "$SITE/oscar_hf/kernels"
if ls "$REPO"/gpu-wheels/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-deps --no-index --target "$SITE" "$REPO"/gpu-wheels/*.whl 2>&1 | tail -2
fi
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
