"""Bad steps: a step whose loss or gradient norm is non-finite on any rank is skipped (every rank agrees through
the step's flags), counted, and reported with every rank's share of the loss and its loader batches; too many
in a row stop the run, which the trainer does with a checkpoint of the last good state."""

from __future__ import annotations

import torch.distributed as dist
from torchtitan.tools.logging import logger

from data.collectives import gather_objects


class BadSteps:
    def __init__(self, limit: int):
        self.limit = limit  # [training] max_bad_steps
        self.in_a_row = 0
        self.skipped = 0  # in the whole run: checkpointed with the trainer's state

    def applied(self) -> None:
        self.in_a_row = 0

    def skip(self, step: int, loss: float, grad_norm: float, batches: tuple[int, int], group: dist.ProcessGroup | None):
        """Count a skipped step and log where every data-parallel rank was (a collective over `group`)."""
        self.in_a_row += 1
        self.skipped += 1
        everyone = gather_objects({"loss": loss, "batches": batches}, group)
        ranks = "; ".join(
            f"rank {r}: loss share {w['loss']:.4g}, loader batches {w['batches'][0]}..{w['batches'][1] - 1}"
            for r, w in enumerate(everyone)
        )
        logger.warning(
            f"step {step}: non-finite loss or gradient (grad norm {grad_norm:.4g}); step skipped "
            f"({self.in_a_row} in a row, {self.skipped} in all). {ranks}"
        )

    def too_many(self) -> bool:
        return self.in_a_row >= self.limit

    def stop_error(self, step: int) -> RuntimeError:
        return RuntimeError(
            f"step {step}: {self.in_a_row} non-finite steps in a row (training.max_bad_steps = {self.limit}); "
            "stopped with a checkpoint of the last good weights, optimizer and EMA (the data order has moved past "
            "the bad batches)"
        )
