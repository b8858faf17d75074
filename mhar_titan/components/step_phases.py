"""The step's phase boundaries (the batch fetched, the model's forward, the backward, the optimizer step) and what
is measured at them: the device memory allocated there, and where a log window's time went, so that a slow step
names its cause.

Time shares of the window since the last log step: `data` (the host waiting for the loader's batches), `forward_
backward` (from the batch to the end of the backward, its gradient reductions included) and `optimizer` (clipping,
the update, the EMA), `checkpoint` and `validation` (their wall time, from the step clock's pauses), and `other`
(the rest: logging, the host's own work, time the device sat idle for the host). On a GPU the forward/backward and
optimizer times are the device's, from CUDA events read once they have completed (no sync is added; a step whose
optimizer is still running when the window closes counts in the next window); on a CPU they are wall time.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from mhar_titan.components.hooks import Hook, Step

SHARES = ("data", "forward_backward", "optimizer", "checkpoint", "validation")
SHORT = {
    "data": "data",
    "forward_backward": "fwd+bwd",
    "optimizer": "opt",
    "checkpoint": "ckpt",
    "validation": "val",
    "other": "other",
}


class StepPhases:
    """`mark(boundary)` at each boundary: "fetch" (before the batches are read), "data" (after), "forward" (the
    model's forward hook), "backward", "optimizer"."""

    MEMORY = ("forward", "backward", "optimizer")

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device
        self.memory: dict[str, float] = {}
        self.began = time.perf_counter()
        self.seconds = dict.fromkeys(SHARES, 0.0)
        self.step_marks: dict[str, float | torch.cuda.Event] = {}
        self.pending: list[tuple[torch.cuda.Event, ...]] = []  # (data, backward, optimizer) events, maybe running

    def mark(self, boundary: str) -> None:
        if self.cuda and boundary in self.MEMORY:  # a host-side counter, no sync
            gib = torch.cuda.memory_allocated(self.device) / 2**30
            self.memory[boundary] = max(gib, self.memory.get(boundary, 0.0))
        if boundary == "fetch":
            self.step_marks = {"fetch": time.perf_counter()}
        elif boundary == "data":
            self.seconds["data"] += time.perf_counter() - self.step_marks.get("fetch", time.perf_counter())
            self._stamp("data")
        elif boundary in ("backward", "optimizer"):
            self._stamp(boundary)
            if boundary == "optimizer" and {"data", "backward"} <= set(self.step_marks):
                self._close_step()

    def _stamp(self, boundary: str) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.step_marks[boundary] = event
        else:
            self.step_marks[boundary] = time.perf_counter()

    def _close_step(self) -> None:
        data, backward, optimizer = (self.step_marks[k] for k in ("data", "backward", "optimizer"))
        if self.cuda:
            self.pending.append((data, backward, optimizer))
        else:
            self.seconds["forward_backward"] += backward - data
            self.seconds["optimizer"] += optimizer - backward
        self.step_marks = {}

    def _settle(self) -> None:
        """GPU: the device times of the steps whose optimizer events have completed."""
        done = [p[2].query() for p in self.pending]
        for (data, backward, optimizer), finished in zip(self.pending, done, strict=True):
            if finished:
                self.seconds["forward_backward"] += data.elapsed_time(backward) / 1e3
                self.seconds["optimizer"] += backward.elapsed_time(optimizer) / 1e3
        self.pending = [p for p, finished in zip(self.pending, done, strict=True) if not finished]

    def take(self, pauses: dict[str, float]) -> dict[str, float]:
        """The window's scalars, then a new window: memory after each phase (GiB, GPU) and the time shares;
        `pauses`: the checkpoint and validation seconds of the window (StepClock.take_pauses)."""
        self._settle()
        now = time.perf_counter()
        wall = max(now - self.began, 1e-9)
        seconds = {**self.seconds, **{k: pauses.get(k, 0.0) for k in ("checkpoint", "validation")}}
        out = {f"memory/after_{p}_gib": self.memory[p] for p in self.MEMORY if p in self.memory}
        shares = {k: v / wall for k, v in seconds.items()}
        shares["other"] = max(0.0, 1.0 - sum(shares.values()))
        out.update({f"time/{k}": v for k, v in shares.items()})
        self.memory, self.began, self.seconds = {}, now, dict.fromkeys(SHARES, 0.0)
        return out


def shares_text(metrics: dict[str, float]) -> str:
    """'time data 1% fwd+bwd 84% opt 9% ckpt 0% val 0% other 6%' for the log line."""
    parts = [f"{SHORT[k]} {metrics[f'time/{k}']:.0%}" for k in (*SHARES, "other") if f"time/{k}" in metrics]
    return "time " + " ".join(parts)


class TimeShares(Hook):
    """The phases marked at the loop's boundaries (the forward by the model's forward hook), and on log steps the
    window's memory and time shares in TensorBoard and at the end of the log line."""

    name = "time_shares"

    def set_up(self, trainer: Any) -> None:
        self.phases, self.clock = StepPhases(trainer.device), trainer.clock
        trainer.model_parts[0].register_forward_hook(self._after_forward)

    def _after_forward(self, *_: Any) -> None:
        if torch.is_grad_enabled():  # a training forward, not validation
            self.phases.mark("forward")

    def before_step(self, step: Step) -> None:
        self.phases.mark("fetch")

    def after_data(self, step: Step) -> None:
        self.phases.mark("data")

    def after_backward(self, step: Step) -> None:
        self.phases.mark("backward")

    def after_step(self, step: Step) -> None:
        self.phases.mark("optimizer")

    def metrics(self, step: Step) -> dict[str, float]:
        return self.phases.take(self.clock.take_pauses()) if step.log else {}

    def line(self, step: Step, metrics: dict[str, float]) -> str:
        return shares_text(metrics)
