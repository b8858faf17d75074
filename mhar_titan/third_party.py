"""Import-time messages of third-party packages, kept off the commands whose refusals are one line.

transformers imports torchao when it is installed (the dev and float8 extras); beside a CPU build of torch,
torchao logs a warning for each CUDA library it cannot load, and torch's pytree a deprecation note for each enum
torchao registers. Neither says anything about the command's work: `quiet_imports()`, called by an entry point
before it imports transformers, lets their errors through and nothing below.
"""

from __future__ import annotations

import logging

IMPORT_NOISE = ("torchao", "torch.utils._pytree")


def quiet_imports() -> None:
    for name in IMPORT_NOISE:
        logging.getLogger(name).setLevel(logging.ERROR)
