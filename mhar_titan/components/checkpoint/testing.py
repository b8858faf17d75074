"""Test-only: a preemption that arrives while a background checkpoint is still being written, made deterministic.

With MHAR_TEST_HOLD_SAVE=<step>, the job that launches the background save of step <step> sends itself SIGTERM
(as a scheduler would, components/preemption.py) right after launching it, and that save's writer, on every
rank, holds before writing any file until its job announces that it waits for the save (the stop's checkpoint,
CPTCheckpointManager._async_wait). So the stop is agreed at the next step, the save is still in flight when the
job reaches its stop, and the test sees what the job does then. Tests set the variable; no config key or flag
reaches this, and with it unset nothing here does anything.
"""

from __future__ import annotations

import os
import signal
import time

from torchtitan.tools.logging import logger

ENV = "MHAR_TEST_HOLD_SAVE"
TIMEOUT_S = 300.0  # a hold nobody releases fails the save instead of hanging the job
_POLL_S = 0.01


def requested() -> int | None:
    """The step whose background save is held, or None."""
    value = os.environ.get(ENV, "").strip()
    if not value:
        return None
    if not value.isdigit():
        raise ValueError(f"{ENV}={value!r}: a step number")
    return int(value)


def _held(checkpoint_id: str) -> bool:
    step = requested()
    return step is not None and os.path.basename(os.path.normpath(checkpoint_id)) == f"step-{step}"


def _flag(checkpoint_id: str, owner: int) -> str:
    """Beside the step folder (retention and the loaders match `step-N` exactly, never this)."""
    return f"{os.path.normpath(checkpoint_id)}.waiting-{owner}"


def after_launch(checkpoint_id: str) -> None:
    """In the training process, once the background save of `checkpoint_id` is launched: the preemption."""
    if _held(checkpoint_id):
        logger.warning(f"TEST HOLD ({ENV}): SIGTERM while {checkpoint_id} is written in the background")
        signal.raise_signal(signal.SIGTERM)


def announce(checkpoint_id: str | None) -> None:
    """In the training process, before it waits for the background save of `checkpoint_id`: the hold ends."""
    if checkpoint_id is not None and _held(checkpoint_id):
        with open(_flag(checkpoint_id, os.getpid()), "w"):
            pass


def release(checkpoint_id: str | None) -> None:
    """After the wait: the flag goes."""
    if checkpoint_id is not None and _held(checkpoint_id):
        try:
            os.remove(_flag(checkpoint_id, os.getpid()))
        except FileNotFoundError:
            pass


def before_write(checkpoint_id: str, owner: int) -> None:
    """In the writer (a thread of the training process, or torch's checkpoint process), before any file: hold
    until the training process `owner` announces that it waits."""
    if not _held(checkpoint_id):
        return
    flag, deadline = _flag(checkpoint_id, owner), time.monotonic() + TIMEOUT_S
    while not os.path.exists(flag):
        if time.monotonic() > deadline:
            raise RuntimeError(f"TEST HOLD ({ENV}): {flag} did not appear within {TIMEOUT_S:.0f} s")
        time.sleep(_POLL_S)
    logger.warning(f"TEST HOLD ({ENV}): {checkpoint_id} released, writing")
