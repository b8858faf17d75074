"""Test-only faults in a resume, so that the checks which must catch a broken resume (the preflight's stage d)
can be shown to catch it: the data one batch off, the optimizer moments lost, the LR schedule restarted, the
EMA restarted from the loaded weights. Tests and benchmarks/resume_spread.py set MHAR_TEST_RESUME_FAULT; no
config key or command-line flag reaches this, and with the variable unset it does nothing."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

from torchtitan.tools.logging import logger

from mhar_titan.components.ema import STATE as EMA_STATE
from mhar_titan.components.hooks import Hook

ENV = "MHAR_TEST_RESUME_FAULT"
FAULTS = {
    "data": "the data position one batch ahead",
    "moments": "the AdamW moments zeroed (not restored)",
    "lr": "the LR schedule restarted from step 0",
    "ema": "the EMA restarted from the loaded weights",
}


def requested() -> str | None:
    """The fault the environment asks for, or None; an unknown name is an error naming the known ones."""
    fault = os.environ.get(ENV, "").strip()
    if fault and fault not in FAULTS:
        raise ValueError(f"{ENV}={fault!r}: one of {', '.join(FAULTS)}")
    return fault or None


def inject(trainer: Any, data_iterator: Iterator) -> None:
    """After a resume's load, before its first step: break what the named fault names, and say so in the log."""
    fault = requested()
    if fault is None or trainer.step == 0:
        return
    if fault == "data":
        next(data_iterator)
    elif fault == "moments":
        for opt in trainer.optimizers.optimizers:
            for state in opt.state.values():
                for key in ("exp_avg", "exp_avg_sq"):
                    if key in state:
                        state[key].zero_()
    elif fault == "lr":
        for scheduler in trainer.lr_schedulers.schedulers:
            scheduler.last_epoch = 0
            for i, group in enumerate(scheduler.optimizer.param_groups):
                group["lr"] = scheduler.base_lrs[i] * scheduler.lr_lambdas[i](0)
            scheduler._last_lr = [group["lr"] for group in scheduler.optimizer.param_groups]
    elif (ema := trainer.checkpointer.states.get(EMA_STATE)) is not None:  # as if the checkpoint had not restored it
        ema.ready = False
        ema.start()
    logger.warning(f"TEST FAULT ({ENV}): {FAULTS[fault]} at the resume from step {trainer.step}")


class ResumeFault(Hook):
    """The fault MHAR_TEST_RESUME_FAULT names, broken in at the start of a resumed job (the last hook to start)."""

    name = "resume_fault"

    def set_up(self, trainer: Any) -> None:
        self.trainer = trainer

    def start(self, step: int) -> None:
        inject(self.trainer, self.trainer.data_iterator)
