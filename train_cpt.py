"""Entry point: `torchrun --nproc-per-node=N train_cpt.py --job.config_file configs/X.toml`.

Runs torchtitan's trainer with this project's train spec and config sections,
on GPUs or, when the host has none, on CPU processes over gloo.
"""

import sys

from torch.distributed.elastic.multiprocessing.errors import record

from mhar_titan.trainer import run


@record
def main() -> None:
    run(sys.argv[1:])


if __name__ == "__main__":
    main()
