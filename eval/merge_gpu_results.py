"""Adds a GPU run's needle trials (`gpu_eval.sh`'s results.tgz, unpacked) to the committed ones:

    python eval/merge_gpu_results.py /tmp/x/oscar_gpu_results eval/results/h200

Each `<model>/niah*.json` of the run joins the file of the same name under the target (trials measured again are
replaced, the others kept with the provenance of the run that measured them; `runner.merge_record_files`), or is
copied where the target has none. Rotation files stay behind: they are the GPU machine's calibration cache.
"""
import json
import shutil
import sys
from pathlib import Path

from oscar_hf.evaluation.runner import merge_record_files


def main(run: Path, target: Path) -> None:
    files = sorted(run.glob("*/niah*.json"))
    if not files:
        raise SystemExit(f"{run} holds no <model>/niah*.json")
    for new in files:
        old = target / new.parent.name / new.name
        old.parent.mkdir(parents=True, exist_ok=True)
        if old.is_file():
            old.write_text(json.dumps(merge_record_files(old, new), indent=1))
            print(f"merged {new} into {old}")
        else:
            shutil.copyfile(new, old)
            print(f"copied {new} to {old}")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit("usage: merge_gpu_results.py RUN_RESULTS_DIR TARGET_DIR")
    main(Path(sys.argv[1]), Path(sys.argv[2]))
