"""train_cpt.py with a non-finite loss forced on rank 1 at the steps listed in NAN_STEPS (tests only)."""

import os
import sys

import torch

from mhar_titan.main import run
from mhar_titan.trainer import CPTTrainer

NAN_STEPS = {int(s) for s in os.environ.get("NAN_STEPS", "").split(",") if s}


class NaNTrainer(CPTTrainer):
    def forward_backward_step(self, **kwargs):
        if self.step not in NAN_STEPS or torch.distributed.get_rank() != 1:
            return super().forward_backward_step(**kwargs)
        real = self.loss_fn
        self.loss_fn = lambda pred, labels: real(pred, labels) * float("nan")
        try:
            return super().forward_backward_step(**kwargs)
        finally:
            self.loss_fn = real


if __name__ == "__main__":
    run(sys.argv[1:], NaNTrainer)
