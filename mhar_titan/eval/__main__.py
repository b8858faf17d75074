"""python -m mhar_titan.eval runs/<pair> --tasks ... [--watch | --once]: see mhar_titan/eval/cli.py.

Offline from the first import: datasets and huggingface_hub read HF_DATASETS_OFFLINE and HF_HUB_OFFLINE once,
when imported, and cli.py's imports load them (through torchtitan). Set later, a task whose dataset is not
cached retried the Hub for a minute before failing.
"""

import os
import sys

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from mhar_titan.third_party import quiet_imports  # noqa: E402  (after the environment is set)

quiet_imports()  # before cli.py's imports load transformers (and torchao with it)

from mhar_titan.eval.cli import main  # noqa: E402  (after the environment is set)

if __name__ == "__main__":
    main(sys.argv[1:])
