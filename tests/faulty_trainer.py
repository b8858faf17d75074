"""train_cpt.py with faults forced, for tests only: a non-finite loss on rank 1 at the steps listed in NAN_STEPS,
and the loss (so its gradient too) multiplied by SPIKE_FACTOR on every rank at the steps in SPIKE_STEPS."""

import os
import sys

import torch

from mhar_titan.main import run
from mhar_titan.trainer import CPTTrainer


def steps(name: str) -> set[int]:
    return {int(s) for s in os.environ.get(name, "").split(",") if s}


NAN_STEPS, SPIKE_STEPS = steps("NAN_STEPS"), steps("SPIKE_STEPS")
SPIKE_FACTOR = float(os.environ.get("SPIKE_FACTOR", "30"))


class FaultyTrainer(CPTTrainer):
    def forward_backward_step(self, **kwargs):
        if self.step in NAN_STEPS and torch.distributed.get_rank() == 1:
            factor = float("nan")
        elif self.step in SPIKE_STEPS:
            factor = SPIKE_FACTOR
        else:
            return super().forward_backward_step(**kwargs)
        real = self.loss_fn
        self.loss_fn = lambda pred, labels: real(pred, labels) * factor
        try:
            return super().forward_backward_step(**kwargs)
        finally:
            self.loss_fn = real


if __name__ == "__main__":
    run(sys.argv[1:], FaultyTrainer)
