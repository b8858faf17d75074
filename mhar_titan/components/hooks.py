"""The hook protocol: each training concern is a `Hook` that the trainer calls at every phase of its loop, so that a
new concern (a metric, a health check, a stop condition, a piece of checkpointed state) is a new hook, not an edit
of the trainer (mhar_titan/trainer.py, torchtitan's loop with one call site per phase).

A step, in the order the trainer calls its hooks (each hook in the order of the job's list):

    before_step     the batches are about to be read
    after_data      the step's batches are in hand
    after_backward  every microbatch's backward has run (before the gradient clipping)
    scalars         the hook's device values for the step's one readback, by name, each with how the ranks combine
                    it (`Scalar`): one collective per kind, one non-blocking copy to the host, read once the update
                    has been issued
    after_step      the values read back (`Step.values`), the update applied or skipped
    metrics, line   TensorBoard scalars of the step, and on log steps the hook's part of the log line
    after_save      the step's periodic checkpoint is written (if due)
    request         stop the job (`Stop`), or write a checkpoint now (`SaveNow`)

Around the steps: `before_build` (the process group is up, nothing built yet), `set_up` (the trainer is built),
`start` (the checkpoint is loaded), `close` (the job ends, well or not). State: `state_dict`/`load_state_dict` are
entries of the trainer's checkpointed state (plain data), `checkpointed` adds entries of their own (sharded tensors
that reshard on load, as the EMA). Every rank calls every hook at every phase: a hook may use collectives, and
decisions taken from the read-back values (agreed by their reduction) are the same on every rank.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful

if TYPE_CHECKING:  # the trainer imports this module; hooks are handed the trainer at set-up
    from torchtitan.train import Trainer

REDUCTIONS = ("max", "sum", "mean", "none")
SKIP_STEP = "skip_step"  # an agreed device value; non-zero: the step's update is not applied (components/bad_steps.py)


@dataclasses.dataclass(frozen=True)
class Scalar:
    """A device tensor for the step's readback, and how the ranks combine it first: `max` over every rank in float32
    (a flag any rank raises, a largest value), `sum` or `mean` over the data-parallel ranks (float64, float32), `none`
    (already the same on every rank, as the clipped gradient norm). A 0-dim tensor reads back as a float, any other
    as the tuple of its elements (flattened)."""

    value: torch.Tensor
    reduce: str = "none"

    def __post_init__(self) -> None:
        if self.reduce not in REDUCTIONS:
            raise ValueError(f"Scalar reduce = {self.reduce!r}: one of {', '.join(REDUCTIONS)}")


_KINDS = (("max", torch.float32), ("sum", torch.float64), ("mean", torch.float32), ("none", torch.float64))


def reduce_scalars(named: dict[str, Scalar], dp_group: dist.ProcessGroup | None) -> dict[str, torch.Tensor]:
    """Each named value combined over the ranks as its `reduce` says, on the device, in the order given: one
    all-reduce per kind present (`max` over every rank, `sum` and `mean` over the data-parallel group `dp_group`),
    each kind in its dtype (Scalar). Every rank must call with the same names."""
    out: dict[str, torch.Tensor] = {}
    for kind, dtype in _KINDS:
        names = [name for name, s in named.items() if s.reduce == kind]
        if not names:
            continue
        values = [named[name].value.detach() for name in names]
        flat = torch.cat([v.to(dtype).reshape(-1) for v in values])
        if kind == "max" and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flat, op=dist.ReduceOp.MAX)
        elif kind in ("sum", "mean") and dp_group is not None:
            dist.all_reduce(flat, group=dp_group)
            if kind == "mean":
                flat /= dist.get_world_size(dp_group)
        for name, v, piece in zip(names, values, flat.split([v.numel() for v in values]), strict=True):
            out[name] = piece.reshape(v.shape)
    return {name: out[name] for name in named}


def on_device(value: float, like: torch.Tensor) -> torch.Tensor:
    """A host number as a 0-dim float32 tensor on `like`'s device, by a fill (a copy from host memory would wait for
    the work queued before it)."""
    return like.new_full((), float(value), dtype=torch.float32)


@dataclasses.dataclass
class Step:
    """The step in progress as the trainer fills it, phase by phase, for its hooks."""

    number: int
    last: bool  # the run's last step (training.steps)
    log: bool  # a log step (torchtitan's metrics.log_freq): the metrics and the log line are written
    batches: tuple[int, int] = (0, 0)  # this rank's loader batches: the first of the step, one past its last
    loss: torch.Tensor | None = None  # this rank's share of the global mean loss (the device's, not read back)
    grad_norm: torch.Tensor | None = None  # the gradient norm over all ranks, before clipping
    device: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)  # the reduced values, not yet read
    values: dict[str, Any] = dataclasses.field(default_factory=dict)  # read back: float, or tuple of floats
    applied: bool = True  # the update was applied (not skipped)
    lrs: dict[str, float] = dataclasses.field(default_factory=dict)  # each group's LR as the update applied it


@dataclasses.dataclass(frozen=True)
class Stop:
    """End the job at this step boundary: a full checkpoint first (`checkpoint`), then `after_checkpoint` (a marker
    for the launcher, a log line), then `error` is raised: its type and exit code are the job's (a SystemExit with
    a code, or an exception: exit 1). Ask it on every rank alike."""

    reason: str
    error: BaseException
    checkpoint: bool = True
    after_checkpoint: Callable[[], None] | None = None


@dataclasses.dataclass(frozen=True)
class SaveNow:
    """Write a full checkpoint at this step, whatever the interval, and go on. Ask it on every rank alike. A
    `temporary` one is written as the interval's are (in the background where async_mode says) and removed once a
    newer checkpoint is complete; otherwise it is written at once and kept as the interval's are."""

    reason: str
    temporary: bool = False


Request = Stop | SaveNow


class Hook:
    """A training concern. Override the phases it takes part in; the others do nothing."""

    name = "hook"
    spike_scored: tuple[str, ...] = ()  # read-back values the spike monitor scores (components/spikes.py)

    def before_build(self, job_config: Any) -> None:
        """The process group is up; nothing is built yet (the run folder's lock)."""

    def set_up(self, trainer: Trainer) -> None:
        """The trainer is built (model, optimizers, loader, checkpointer, metrics); nothing is loaded yet."""

    def start(self, step: int) -> None:
        """The run's checkpoint or its base is loaded: training begins after `step`."""

    def before_step(self, step: Step) -> None:
        """Before the step's batches are read."""

    def after_data(self, step: Step) -> None:
        """The step's batches are read."""

    def after_backward(self, step: Step) -> None:
        """Every microbatch's forward and backward has run."""

    def scalars(self, step: Step) -> dict[str, Scalar]:
        """Device values for the step's readback, by name (unique over the job's hooks)."""
        return {}

    def after_step(self, step: Step) -> None:
        """The step's values are read back (`step.values`); its update applied, or skipped (`step.applied`)."""

    def metrics(self, step: Step) -> dict[str, float]:
        """TensorBoard scalars at this step (most hooks: on log steps only)."""
        return {}

    def line(self, step: Step, metrics: dict[str, float]) -> str:
        """On log steps: this hook's part of the log line (empty: none), from every hook's `metrics`."""
        return ""

    def after_save(self, step: Step) -> None:
        """The step's checkpoint, if one was due, is written (or, in the background, staged)."""

    def request(self, step: Step) -> Request | None:
        """Stop the job, or checkpoint now, at this step boundary."""
        return None

    def state_dict(self) -> dict[str, Any]:
        """Entries of the trainer's checkpointed state (plain data: numbers, strings), by key."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The trainer's checkpointed state as loaded (every hook's entries)."""

    def checkpointed(self) -> dict[str, Stateful]:
        """Checkpoint entries of their own (tensors sharded as the model: they reshard on load)."""
        return {}

    def close(self) -> None:
        """The job ends (after the checkpointer has finished), well or not."""


class Hooks:
    """A job's hooks, called in their order at each phase."""

    def __init__(self, hooks: list[Hook]):
        self.hooks = list(hooks)
        names = [h.name for h in self.hooks]
        if len(set(names)) != len(names):
            raise ValueError(f"hooks {names}: each needs a name of its own")

    def __iter__(self) -> Iterator[Hook]:
        return iter(self.hooks)

    def each(self, phase: str, *args: Any) -> None:
        """One phase of every hook, in order."""
        for hook in self.hooks:
            getattr(hook, phase)(*args)

    def set_up(self, trainer: Trainer) -> None:
        """Each hook's set-up, then its own checkpoint entries registered, in order (a later hook's set-up sees what
        the checkpoint holds: the run's checks count the EMA's bytes)."""
        for hook in self.hooks:
            hook.set_up(trainer)
            trainer.checkpointer.states.update(hook.checkpointed())

    def _merged(self, what: str, out: dict[str, Any], phase: Callable[[Hook], dict[str, Any]]) -> dict[str, Any]:
        """Every hook's entries added to `out`; a name two give is an error naming both (never one overwritten)."""
        for hook in self.hooks:
            for name, value in phase(hook).items():
                if name in out:
                    raise ValueError(f"hook {hook.name!r}: the {what} {name!r} is already given by another")
                out[name] = value
        return out

    def scalars(self, step: Step, named: dict[str, Scalar]) -> dict[str, Scalar]:
        """`named` (the trainer's own values) and every hook's."""
        return self._merged("step value", dict(named), lambda hook: hook.scalars(step))

    def metrics(self, step: Step) -> dict[str, float]:
        return self._merged("TensorBoard scalar", {}, lambda hook: hook.metrics(step))

    def line(self, step: Step, metrics: dict[str, float]) -> str:
        return "  ".join(part for part in (hook.line(step, metrics) for hook in self.hooks) if part)

    def request(self, step: Step) -> list[Request]:
        return [r for r in (hook.request(step) for hook in self.hooks) if r is not None]

    def state_dict(self, own: dict[str, Any]) -> dict[str, Any]:
        """`own` (the trainer's entries) and every hook's."""
        return self._merged("checkpointed entry", dict(own), lambda hook: hook.state_dict())

    def close(self) -> None:
        """Every hook's close, the last hook first (the run lock, taken first, is released last); the first failure
        is raised once all have run."""
        failure: BaseException | None = None
        for hook in reversed(self.hooks):
            try:
                hook.close()
            except BaseException as e:
                failure = failure or e
        if failure is not None:
            raise failure
