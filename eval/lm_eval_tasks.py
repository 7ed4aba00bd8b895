"""`oscar-hf eval lm-eval` as a script: the offline lm-eval tasks through each method's cache (OscarLM).

    python eval/lm_eval_tasks.py --model smollm2-135m --tasks oscar_bb_siqa --num-fewshot 3 --limit 50 \
        --sink 16 --window 32 --residual 32
(Not named lm_eval.py: a script folder on sys.path would shadow the lm_eval package.)
"""

import sys

from oscar_hf.cli import main

if __name__ == "__main__":
    sys.exit(main(["eval", "lm-eval", *sys.argv[1:]]))
