"""Test-only seams of the checkpoints, each set by an environment variable that tests (and benchmarks) set; no config
key or command-line flag reaches them, and with the variables unset nothing here does anything.

- MHAR_TEST_HOLD_SAVE=<step>: a preemption that arrives while a background checkpoint is still being written, made
  deterministic. The job that launches the background save of step <step> sends itself SIGTERM (as a scheduler
  would, components/preemption.py) right after launching it, and that save's writer, on every rank, holds before
  writing any file until its job announces that it waits for the save (the stop's checkpoint,
  CPTCheckpointManager._async_wait). So the stop is agreed at the next step, the save is still in flight when the
  job reaches its stop, and the test sees what the job does then. With `<step>:cluster` the job does not signal
  itself: it says that the save is held, and the test signals every process of the job as a cluster does
  (the launcher, torchrun, the workers and torch's checkpoint processes, components/signals.py).
- MHAR_TEST_RESUME_FAULT=<fault>: faults in a resume, so that the checks which must catch a broken resume (the
  preflight's stage d) can be shown to catch it: the data one batch off, the optimizer moments lost, the LR schedule
  restarted, the EMA restarted from the loaded weights. Tests and benchmarks/resume_spread.py set it.
- MHAR_TEST_FAIL_UPLOAD=<step>:<rank>: that rank's upload of that step to the store fails (remote.py).
- MHAR_TEST_HANG=<step>:<site>[:once][,...]: one rank stops for good at that step, where a job hangs for real:
  `collective` (rank 1 before the step's readback, which rank 0 then waits in), `loader` (rank 0 reading the step's
  batches), `save` (rank 1 writing the step's checkpoint) or `validation` (rank 1 as the step's validation begins,
  after its checkpoint); with `once`, only where the run folder has no stacks
  of that hang yet (a restarted job gets past it). For the watchdog's tests (components/watchdog.py) and the soak.
- MHAR_TEST_CRASH=<step>:<once|always>[,...]: rank 1 raises an error after that step; `once` only where the run
  folder has no crash record of that step and rank yet (so a restarted job gets past it). For the restarts' tests
  (components/endings.py) and the soak (chaos/soak.py).
- MHAR_TEST_SLOW_RANK=<rank>:<seconds>: that rank sleeps before every block's forward, as a slow GPU computes: for
  the straggler warning's test (components/rank_timing.py).

The hang and the crash take a comma-separated list, each entry at its own step.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

from torchtitan.tools.logging import logger

from mhar_titan.components.checkpoint.layout import step_folder, step_of
from mhar_titan.components.ema import STATE as EMA_STATE
from mhar_titan.components.hooks import Hook, Scalar, Step

HOLD_SAVE_ENV = "MHAR_TEST_HOLD_SAVE"
HOLD_TIMEOUT_S = 300.0  # a hold nobody releases fails the save instead of hanging the job
_POLL_S = 0.01
RESUME_FAULT_ENV = "MHAR_TEST_RESUME_FAULT"
FAULTS = {
    "data": "the data position one batch ahead",
    "moments": "the AdamW moments zeroed (not restored)",
    "lr": "the LR schedule restarted from step 0",
    "ema": "the EMA restarted from the loaded weights",
}
FAIL_UPLOAD_ENV = "MHAR_TEST_FAIL_UPLOAD"  # `STEP:RANK` makes that rank's upload of that step fail
HANG_ENV = "MHAR_TEST_HANG"
CRASH_ENV = "MHAR_TEST_CRASH"
SLOW_RANK_ENV = "MHAR_TEST_SLOW_RANK"
HANG_SITES = ("collective", "loader", "save", "validation")


# -- MHAR_TEST_HOLD_SAVE ---------------------------------------------------------------------------------------------


def _steps_and(env: str, kinds: tuple[str, ...], usage: str) -> list[tuple[int, str]]:
    """`<step>:<kind>[,<step>:<kind>...]` from the variable `env` (none where unset), at most one entry a step; any
    other value is an error showing `usage`."""
    value = os.environ.get(env, "").strip()
    found: dict[int, str] = {}
    for entry in value.split(",") if value else []:
        step, _, kind = entry.strip().partition(":")
        if not step.isdigit() or kind not in kinds or int(step) in found:
            raise ValueError(f"{env}={value!r}: {usage}, at most one entry a step")
        found[int(step)] = kind
    return sorted(found.items())


def _hold() -> tuple[int, bool] | None:
    """The step whose background save is held and whether the job signals itself, or None."""
    holds = _steps_and(HOLD_SAVE_ENV, ("", "cluster"), "a step number, or a step number and ':cluster'")
    if len(holds) > 1:
        raise ValueError(f"{HOLD_SAVE_ENV}: one step, not {len(holds)}")
    return (holds[0][0], holds[0][1] == "") if holds else None


def held_step() -> int | None:
    """The step whose background save is held, or None."""
    hold = _hold()
    return None if hold is None else hold[0]


def _held(checkpoint_id: str) -> bool:
    step = held_step()
    return step is not None and os.path.basename(os.path.normpath(checkpoint_id)) == step_folder(step)


def _flag(checkpoint_id: str, owner: int) -> str:
    """Beside the step folder (retention and the loaders match `step-N` exactly, never this)."""
    return f"{os.path.normpath(checkpoint_id)}.waiting-{owner}"


def after_launch(checkpoint_id: str) -> None:
    """In the training process, once the background save of `checkpoint_id` is launched: the preemption."""
    if not _held(checkpoint_id):
        return
    if _hold()[1]:
        logger.warning(f"TEST HOLD ({HOLD_SAVE_ENV}): SIGTERM while {checkpoint_id} is written in the background")
        signal.raise_signal(signal.SIGTERM)
    else:
        _wait_for_cluster(checkpoint_id)


def _wait_for_cluster(checkpoint_id: str) -> None:
    """`<step>:cluster`: this rank waits for a SIGTERM from outside, saying so with a file beside the step folder
    (`step-N.signal-<pid>`, removed once it came) for the test to send it when every rank waits."""
    came, previous = threading.Event(), signal.getsignal(signal.SIGTERM)

    def on_term(signum: int, frame: Any) -> None:
        came.set()
        if callable(previous):
            previous(signum, frame)

    signal.signal(signal.SIGTERM, on_term)
    flag, deadline = f"{os.path.normpath(checkpoint_id)}.signal-{os.getpid()}", time.monotonic() + HOLD_TIMEOUT_S
    with open(flag, "w"):
        pass
    logger.warning(f"TEST HOLD ({HOLD_SAVE_ENV}): {checkpoint_id} held in the background; waiting for a SIGTERM")
    try:
        while not came.wait(_POLL_S):
            if time.monotonic() > deadline:
                raise RuntimeError(f"TEST HOLD ({HOLD_SAVE_ENV}): no SIGTERM within {HOLD_TIMEOUT_S:.0f} s")
    finally:
        signal.signal(signal.SIGTERM, previous)
        os.remove(flag)


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
    step = step_of(os.path.basename(os.path.normpath(checkpoint_id)))
    for at in hangs():
        if at[:2] == (step, "save") and _rank() == 1:
            run = os.path.dirname(os.path.dirname(os.path.normpath(checkpoint_id)))  # <dump>/checkpoint/step-N
            if not (at[2] and _hung_before(run, step)):
                hang_forever()
    if not _held(checkpoint_id):
        return
    flag, deadline = _flag(checkpoint_id, owner), time.monotonic() + HOLD_TIMEOUT_S
    while not os.path.exists(flag):
        if time.monotonic() > deadline:
            raise RuntimeError(f"TEST HOLD ({HOLD_SAVE_ENV}): {flag} did not appear within {HOLD_TIMEOUT_S:.0f} s")
        time.sleep(_POLL_S)
    logger.warning(f"TEST HOLD ({HOLD_SAVE_ENV}): {checkpoint_id} released, writing")


# -- MHAR_TEST_RESUME_FAULT ------------------------------------------------------------------------------------------


def resume_fault() -> str | None:
    """The fault the environment asks for, or None; an unknown name is an error naming the known ones."""
    fault = os.environ.get(RESUME_FAULT_ENV, "").strip()
    if fault and fault not in FAULTS:
        raise ValueError(f"{RESUME_FAULT_ENV}={fault!r}: one of {', '.join(FAULTS)}")
    return fault or None


class ResumeFault(Hook):
    """The named fault, broken in at the start of a resumed job after every other hook has started
    (train_spec.build_hooks adds it last, and only where the variable names a fault); the log says so."""

    name = "resume_fault"

    def __init__(self, fault: str):
        self.fault = fault

    def set_up(self, trainer: Any) -> None:
        self.trainer = trainer

    def start(self, step: int) -> None:
        trainer, fault = self.trainer, self.fault
        if step == 0:
            return
        if fault == "data":
            next(trainer.data_iterator)
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
        elif (
            ema := trainer.checkpointer.states.get(EMA_STATE)
        ) is not None:  # as if the checkpoint had not restored it
            ema.ready = False
            ema.start()
        logger.warning(f"TEST FAULT ({RESUME_FAULT_ENV}): {FAULTS[fault]} at the resume from step {step}")


# -- MHAR_TEST_FAIL_UPLOAD -------------------------------------------------------------------------------------------


def fail_upload(step: int, rank: int) -> None:
    """In an upload to the store (remote.py), before anything is put: the store's refusal, where a test asks."""
    if os.environ.get(FAIL_UPLOAD_ENV, "") == f"{step}:{rank}":
        raise OSError(f"the store refused the upload ({FAIL_UPLOAD_ENV}, a test)")


# -- MHAR_TEST_HANG --------------------------------------------------------------------------------------------------


def hangs() -> list[tuple[int, str, bool]]:
    """The step and site of each hang the environment asks for and whether only once; a bad value is an error
    naming the sites."""
    kinds = (*HANG_SITES, *(f"{site}:once" for site in HANG_SITES))
    found = _steps_and(HANG_ENV, kinds, f"<step>:<site>[:once], the site one of {', '.join(HANG_SITES)}")
    return [(step, kind.partition(":")[0], kind.endswith(":once")) for step, kind in found]


def before_validation(dump_folder: str, step: int) -> None:
    """In a validation, before any batch: the `validation` hang, where the environment asks for one."""
    for at, site, once in hangs():
        if (at, site) == (step, "validation") and _rank() == 1 and not (once and _hung_before(dump_folder, step)):
            hang_forever()


def _hung_before(dump_folder: str, step: int) -> bool:
    return os.path.isdir(os.path.join(dump_folder, "hangs")) and any(
        n.startswith(f"step-{step}-rank-") for n in os.listdir(os.path.join(dump_folder, "hangs"))
    )


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def hang_forever() -> None:
    """Where the hang is (the name the stacks show)."""
    logger.warning(f"TEST HANG ({HANG_ENV}): rank {_rank()} stops here for good")
    while True:
        time.sleep(1)


class _Stuck:
    """A data iterator that never returns."""

    def __iter__(self) -> _Stuck:
        return self

    def __next__(self) -> Any:
        hang_forever()


class Hang(Hook):
    """The hangs the environment asks for, each at its step and site (train_spec.build_hooks adds it last)."""

    name = "test_hang"

    def __init__(self, hangs: list[tuple[int, str, bool]]):
        self.hangs = hangs

    def set_up(self, trainer: Any) -> None:
        self.trainer, dump = trainer, trainer.job_config.job.dump_folder
        self.due = {(at, site) for at, site, once in self.hangs if not (once and _hung_before(dump, at))}

    def scalars(self, step: Step) -> dict[str, Scalar]:
        if (step.number, "collective") in self.due and _rank() == 1:
            hang_forever()
        return {}

    def _stick(self, before: int) -> None:
        if (before + 1, "loader") in self.due and _rank() == 0:
            self.trainer.data_iterator = _Stuck()  # the next step's batches

    def start(self, step: int) -> None:
        self._stick(step)  # a job resumed just before the hang's step

    def after_save(self, step: Step) -> None:
        self._stick(step.number)


# -- MHAR_TEST_CRASH -------------------------------------------------------------------------------------------------


def crashes() -> list[tuple[int, bool]]:
    """The step of each crash the environment asks for and whether it recurs."""
    return [
        (at, kind == "always") for at, kind in _steps_and(CRASH_ENV, ("once", "always"), "<step>:once or <step>:always")
    ]


class Crash(Hook):
    """Rank 1's error after each step the environment names (train_spec.build_hooks adds it last)."""

    name = "test_crash"

    def __init__(self, crashes: list[tuple[int, bool]]):
        self.always = dict(crashes)

    def set_up(self, trainer: Any) -> None:
        self.crashes = os.path.join(trainer.job_config.job.dump_folder, "crashes")

    def after_step(self, step: Step) -> None:
        if step.number not in self.always or _rank() != 1:
            return
        if self.always[step.number] or not os.path.exists(
            os.path.join(self.crashes, f"step-{step.number}-rank-1.json")
        ):
            raise RuntimeError(f"TEST CRASH ({CRASH_ENV}) after step {step.number}")


# -- MHAR_TEST_SLOW_RANK ---------------------------------------------------------------------------------------------


def slow_rank() -> tuple[int, float] | None:
    """(rank, seconds) of MHAR_TEST_SLOW_RANK=<rank>:<seconds>, or None where unset; a bad value is an error."""
    value = os.environ.get(SLOW_RANK_ENV, "").strip()
    if not value:
        return None
    rank, _, seconds = value.partition(":")
    try:
        parsed = int(rank), float(seconds)
    except ValueError:
        parsed = (-1, -1.0)
    if parsed[0] < 0 or not parsed[1] > 0:
        raise ValueError(f"{SLOW_RANK_ENV}={value!r}: <rank>:<seconds>, e.g. 1:0.02")
    return parsed


class SlowRank(Hook):
    """That rank's every block forward made slower by a sleep, as a slow GPU would be (after the timing's own hooks:
    train_spec.build_hooks adds it last)."""

    name = "test_slow_rank"

    def __init__(self, rank: int, seconds: float):
        self.rank, self.seconds = rank, seconds

    def set_up(self, trainer: Any) -> None:
        if _rank() != self.rank:
            return
        model = trainer.model_parts[0]
        for layer in model.layers.values():
            layer.register_forward_pre_hook(lambda *_: time.sleep(self.seconds))
