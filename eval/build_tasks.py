"""Builds the offline lm-eval task data shipped in `oscar_hf/evaluation/tasks/` from the BIG-bench sdist on PyPI.

    python eval/build_tasks.py     # downloads bigbench==1.0.0 (sdist, ~358 MB) into $OSCAR_HF_HOME/downloads once

social_iqa (BIG-bench, Apache-2.0): the 1954 examples shuffled with seed 0; the first 200 are the test split, the
next 50 the few-shot pool. Each line: {"question", "choices", "label"}. The BIG-bench canary string is kept in the
task folder's README so that the data stays identifiable.
"""

import json
import random
import tarfile
from pathlib import Path

from oscar_hf.assets import pip_download

TASKS = Path(__file__).resolve().parents[1] / "oscar_hf" / "evaluation" / "tasks"
MEMBER = "bigbench-1.0.0/bigbench/benchmark_tasks/social_iqa/task.json"


def main() -> None:
    sdist = pip_download("bigbench==1.0.0")
    with tarfile.open(sdist) as tar:
        task = json.load(tar.extractfile(MEMBER))
    rows = []
    for ex in task["examples"]:
        choices = list(ex["target_scores"])
        rows.append({"question": ex["input"].strip(), "choices": choices,
                     "label": [ex["target_scores"][c] for c in choices].index(1)})
    random.Random(0).shuffle(rows)
    for name, part in (("test", rows[:200]), ("fewshot", rows[200:250])):
        path = TASKS / f"bb_siqa_{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in part))
        print(f"wrote {path} ({len(part)} examples)")
    print("canary:", task["canary"])


if __name__ == "__main__":
    main()
