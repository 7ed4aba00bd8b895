# Sourced by the GPU scripts (gpu_check.sh, gpu_eval.sh): lays this checkout out as the installed package in a
# temporary site (oscar_hf with kernels/ as oscar_hf.kernels; the GPU image has torch, transformers and triton, and no
# index to build an editable install from) and installs the wheels in gpu-wheels/ (git-ignored; given to the device
# tool as `carry`: e.g. hqq, or gguf for loading the offline models) into it. Sets REPO, OUT, SITE.
#
# The caches hand their view to the attention through the forward's kwargs, which needs transformers >= 5.24; the GPU
# image has 5.17. Where the machine's transformers is older, the transformers wheel in .whl/ (git-ignored, carried as
# `.whl`; eval/README.md gives the `pip download` line) goes into the site, and a missing or unusable one stops here.
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT=${OUT:-$REPO/gpu-out}
SITE=$(mktemp -d)
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 PYTHONPATH="$SITE"
cp -r "$REPO/oscar_hf" "$SITE/oscar_hf" && cp -r "$REPO/kernels" "$SITE/oscar_hf/kernels"
if ls "$REPO"/gpu-wheels/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-deps --no-index --target "$SITE" "$REPO"/gpu-wheels/*.whl 2>&1 | tail -2
fi
TRANSFORMERS_MIN=5.24.0
transformers_older() {  # exit status 0 when the importable transformers is older than TRANSFORMERS_MIN (or missing)
  python3 - "$TRANSFORMERS_MIN" <<'EOF'
import sys
from packaging.version import Version
try:
    import transformers
except ImportError:
    sys.exit(0)
sys.exit(0 if Version(transformers.__version__) < Version(sys.argv[1]) else 1)
EOF
}
if transformers_older; then
  if ls "$REPO"/.whl/transformers-*.whl >/dev/null 2>&1; then
    # every wheel in .whl/: transformers and whichever of its dependencies the image lacks (one version of each)
    python3 -m pip install -q --no-deps --no-index --no-compile --no-cache-dir --upgrade --target "$SITE" \
      "$REPO"/.whl/*.whl 2>&1 | tail -2
  fi
  if transformers_older; then
    echo "gpu_site.sh: transformers $(python3 -c 'import transformers; print(transformers.__version__)' 2>&1 | tail -1)" \
         "is older than $TRANSFORMERS_MIN, which oscar_hf needs, and no usable wheel came in .whl/:" \
         "download it as eval/README.md says and carry .whl" >&2
    exit 1
  fi
fi
{
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv
  python3 -c 'import torch, transformers, triton; print(f"torch {torch.__version__}, transformers '\
'{transformers.__version__} ({transformers.__file__}), triton {triton.__version__}")'
} | tee "$OUT/gpu.txt"  # one file: a device call brings back at most 8 from $OUT
