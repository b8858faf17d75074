"""Bad steps: a step whose loss or gradient norm is non-finite on any rank is skipped (every rank agrees through
the step's readback, SKIP_STEP), counted, and reported with every rank's share of the loss and its loader batches;
too many in a row stop the run, with a checkpoint of the last good state. A hook (components/hooks.py)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torchtitan.tools.logging import logger

from data.collectives import gather_objects
from mhar_titan.components.hooks import SKIP_STEP, Hook, Request, Scalar, Step, Stop


class BadSteps(Hook):
    name = "bad_steps"

    def __init__(self, limit: int):
        self.limit = limit  # [training] max_bad_steps
        self.in_a_row = 0
        self.skipped = 0  # in the whole run: checkpointed with the trainer's state
        self.group: dist.ProcessGroup | None = None

    def set_up(self, trainer: Any) -> None:
        self.group = trainer.dp_group

    def scalars(self, step: Step) -> dict[str, Scalar]:
        bad = ~torch.isfinite(step.loss) | ~torch.isfinite(step.grad_norm)
        return {SKIP_STEP: Scalar(bad, "max")}

    def after_step(self, step: Step) -> None:
        if step.applied:
            self.applied()
        else:
            self.skip(step.number, step.loss.item(), step.values["grad_norm"], step.batches, self.group)

    def request(self, step: Step) -> Request | None:
        return Stop("non-finite steps", self.stop_error(step.number)) if self.too_many() else None

    def metrics(self, step: Step) -> dict[str, float]:
        return {"train/skipped_steps": self.skipped} if step.log else {}

    def state_dict(self) -> dict[str, Any]:
        return {"skipped_steps": self.skipped}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.skipped = int(state.get("skipped_steps", 0))

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
