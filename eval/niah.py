"""`oscar-hf eval niah` as a script: see oscar_hf/evaluation/runner.py for the protocol and the options.

    python eval/niah.py --model smollm2-135m [--output eval/results] [options of oscar-hf eval]
"""

import sys

from oscar_hf.cli import main

if __name__ == "__main__":
    sys.exit(main(["eval", "niah", *sys.argv[1:]]))
