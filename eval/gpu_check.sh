#!/usr/bin/env bash
# One GPU call: lay this checkout out as the installed package (`gpu_site.sh`), then run bench_gpu.py's sections;
# its `check` section is the GPU correctness check of the kernels against their torch twins at realistic shapes
# (tests/test_kernels.py checks the same on the CPU in the Triton interpreter). Results land in $OUT.
#
#   OUT=/some/dir bash eval/gpu_check.sh [--sections check,quant,memory,micro] [other bench_gpu.py arguments]
#   BENCH=bench_generate.py OUT=/some/dir bash eval/gpu_check.sh [bench_generate.py arguments]
#   GPU_TESTS=only OUT=/some/dir bash eval/gpu_check.sh    # the GPU tests alone
# Wheels in gpu-wheels/ (e.g. hqq for transformers' QuantizedCache, which the GPU image lacks) go into the same site,
# and transformers 5.24 from .whl/ where the image's is older (carry .whl: eval/README.md).
#
# The check section begins with the GPU tests, tests/test_gpu_state.py (real CUDA graphs of the eager decode step,
# history growth through the Triton store kernels, the compiled decode step against eager; about a minute), before
# any benchmark: pass/fail and seconds per test in $OUT/gpu_tests.log, also when the benchmark fails or runs out of
# time. GPU_TESTS: auto (default: when the call runs a check section and a GPU is there), 1 (whenever a GPU is
# there), 0 (never), only (the tests, then stop). GPU_TESTS_SECONDS bounds them (default 300). The exit status is
# non-zero when a test failed, even where the benchmark then ran.
set -uo pipefail
source "$(dirname "$0")/gpu_site.sh"
cd "$SITE"  # not the repository root, where ./oscar_hf (without kernels) would come first on sys.path
BENCH=${BENCH:-bench_gpu.py}
GPU_TESTS=${GPU_TESTS:-auto}
[ $# -eq 0 ] && [ "$BENCH" = bench_gpu.py ] && set -- --sections check,quant,memory,micro

runs_check() {  # exit status 0 when this call's benchmark runs a check section (named, or in its default sections)
  local sections="" previous=""
  for arg in "$@"; do
    [ "$previous" = --sections ] && sections=$arg
    case "$arg" in --sections=*) sections=${arg#--sections=} ;; esac
    previous=$arg
  done
  if [ -z "$sections" ]; then  # the benchmark's default sections: bench_gpu.py's and bench_generate.py's begin with it
    case "$BENCH" in bench_gpu.py | bench_generate.py) return 0 ;; *) return 1 ;; esac
  fi
  case ",$sections," in *,check,* | *,model-check,*) return 0 ;; *) return 1 ;; esac
}

run_gpu_tests() {  # tests/test_gpu_state.py, its log in $OUT/gpu_tests.log; exit status: pytest's
  local log="$OUT/gpu_tests.log"
  if ! python3 -c 'import pytest' 2>/dev/null; then
    echo "gpu_check.sh: pytest is not importable here: carry its wheels (pytest, pluggy, iniconfig) in gpu-wheels/" \
      | tee "$log" >&2
    return 1
  fi
  # the test file from the repository (its conftest.py beside it), oscar_hf from the site (PYTHONPATH); no cache
  # folder written into the checkout; -v and -rA: a line per test, --durations=0: the seconds of each
  timeout "${GPU_TESTS_SECONDS:-300}" python3 -m pytest "$REPO/tests/test_gpu_state.py" -v -rA --durations=0 \
    -p no:cacheprovider 2>&1 | tee "$log"
  local rc=${PIPESTATUS[0]}
  [ "$rc" -eq 124 ] && echo "gpu_check.sh: the GPU tests ran past ${GPU_TESTS_SECONDS:-300} s" | tee -a "$log" >&2
  return "$rc"
}

tests_rc=0
if [ "$GPU_TESTS" = only ] || [ "$GPU_TESTS" = 1 ] || { [ "$GPU_TESTS" = auto ] && runs_check "$@"; }; then
  if python3 -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    run_gpu_tests
    tests_rc=$?
  else
    echo "gpu_check.sh: no GPU visible to torch: the GPU tests are not run" | tee "$OUT/gpu_tests.log" >&2
    [ "$GPU_TESTS" = only ] && tests_rc=1  # asked for the tests alone: nothing was checked
  fi
  [ "$GPU_TESTS" = only ] && exit "$tests_rc"
fi
python3 "$REPO/eval/$BENCH" --out "$OUT" "$@" 2>&1 | tee "$OUT/${BENCH%.py}.log"
bench_rc=${PIPESTATUS[0]}
[ "$tests_rc" -ne 0 ] && exit "$tests_rc"
exit "$bench_rc"
