"""Entry point: `torchrun --nproc-per-node=N train_cpt.py --job.config_file configs/X.toml`.

Runs torchtitan's trainer with this project's train spec and config sections,
on GPUs or, when the host has none, on CPU processes over gloo.

Under torchrun the worker first arms a parent-death signal (mhar_titan/components/lifetime.py), so a
SIGKILLed agent takes its workers with it. That module is loaded by path, before torch:
importing the `mhar_titan` package would take seconds (it registers the train spec).
"""

import os

_PARENT_AT_START = os.getppid()  # first: the torchrun agent that started us, if it still lives

import importlib.util  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402


def _arm_parent_death_signal() -> None:
    """Die with the torchrun agent (SIGKILL included); exit now if it is already gone."""
    spec = importlib.util.spec_from_file_location(
        "mhar_titan_lifetime_early", Path(__file__).resolve().parent / "mhar_titan" / "components" / "lifetime.py"
    )
    lifetime = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lifetime)
    if lifetime.started_by_torchelastic():
        lifetime.die_with_parent(_PARENT_AT_START)


if __name__ == "__main__":  # not where torch's checkpoint process imports this file (as __mp_main__): see lifetime.py
    _arm_parent_death_signal()

from torch.distributed.elastic.multiprocessing.errors import record  # noqa: E402

from mhar_titan.main import run  # noqa: E402


@record
def main() -> None:
    if "LOCAL_RANK" not in os.environ and not {"-h", "--help"} & set(sys.argv[1:]):
        print(
            "train_cpt.py: run it under torchrun (it needs a process group): launch/torchrun.sh CONFIG [--section.key "
            "value ...], or torchrun --nproc-per-node=N train_cpt.py --job.config_file CONFIG",
            file=sys.stderr,
        )
        sys.exit(2)
    run(sys.argv[1:])


if __name__ == "__main__":
    main()
