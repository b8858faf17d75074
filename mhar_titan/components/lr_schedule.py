"""The learning-rate schedule: linear re-warmup from exactly 0, an optional plateau, then decay.

The factor is a function of the optimizer step alone (`lr_scheduler.total_steps` fixes where
the decay ends, `training.steps` only if it is unset), so a resumed or extended job continues
the same curve. torchtitan's own warmup starts at lr / warmup_steps instead of 0.
"""

from __future__ import annotations

import functools
import math
from typing import Any

from torchtitan.components.lr_scheduler import LRSchedulersContainer
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.config import LRScheduler as LRSchedulerConfig
from torchtitan.tools.logging import logger


def lr_factor(
    step: int, *, warmup_steps: int, decay_start: int, decay_end: int, decay_type: str, min_lr_factor: float
) -> float:
    """Multiplier of the peak LR for the update that follows `step` updates (0 for the first)."""
    if step < warmup_steps:
        return step / warmup_steps
    if step < decay_start:
        return 1.0
    if step >= decay_end:
        return min_lr_factor
    progress = (step - decay_start) / (decay_end - decay_start)
    if decay_type == "linear":
        shape = 1.0 - progress
    elif decay_type == "sqrt":
        shape = 1.0 - math.sqrt(progress)
    elif decay_type == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        raise ValueError(f"[lr_scheduler] decay_type = {decay_type!r}: expected linear, sqrt (1-sqrt) or cosine")
    return min_lr_factor + (1.0 - min_lr_factor) * shape


def build_lr_schedulers(
    optimizers: OptimizersContainer, lr_config: LRSchedulerConfig, training_steps: int
) -> LRSchedulersContainer:
    """The `TrainSpec` LR builder: warmup_steps, total_steps (the decay end), decay_ratio, decay_type,
    min_lr_factor of `[lr_scheduler]`."""
    # Settings that could only make a run that does nothing, or climbs the loss, silently.
    if training_steps <= 0:
        raise ValueError(f"[training] steps = {training_steps} must be positive")
    if lr_config.total_steps is not None and lr_config.total_steps <= 0:
        raise ValueError(f"[lr_scheduler] total_steps = {lr_config.total_steps} must be positive (or unset)")
    if not 0 <= lr_config.min_lr_factor <= 1:
        raise ValueError(f"[lr_scheduler] min_lr_factor = {lr_config.min_lr_factor} must be in [0, 1]")
    decay_end = lr_config.total_steps if lr_config.total_steps is not None else training_steps
    if lr_config.min_lr_factor == 0 and training_steps > decay_end:
        raise ValueError(
            f"[training] steps = {training_steps} > [lr_scheduler] total_steps = {decay_end} with min_lr_factor = 0: "
            f"steps {decay_end + 1} to {training_steps} would train at lr 0"
        )
    warmup = lr_config.warmup_steps
    if warmup < 0:
        raise ValueError(f"[lr_scheduler] warmup_steps = {warmup} must be >= 0")
    if warmup > decay_end:
        logger.warning(f"[lr_scheduler] warmup_steps = {warmup} exceeds the decay end {decay_end}; using {decay_end}")
        warmup = decay_end
    decay_steps = decay_end - warmup
    if lr_config.decay_ratio is not None:
        decay_steps = min(decay_steps, round(decay_end * lr_config.decay_ratio))
    factor = functools.partial(
        lr_factor,
        warmup_steps=warmup,
        decay_start=decay_end - decay_steps,
        decay_end=decay_end,
        decay_type=lr_config.decay_type,
        min_lr_factor=lr_config.min_lr_factor,
    )
    factor(0)  # fail at start-up on a bad decay_type
    return LRSchedulersContainer(optimizers, factor)


def apply_settings(schedulers: LRSchedulersContainer, settings: dict[str, dict[str, Any]]) -> list[str]:
    """After a resume: the config's peak LR, weight decay, betas and eps (`settings` by group name) onto the
    loaded optimizer groups and LR schedulers, and each group's LR for the next step recomputed from the
    config's schedule, as LambdaLR would (base LR x factor at the step reached). The checkpoint restored
    the old values; without this an allowed change would be recorded but not trained with, and a changed
    warmup would take effect a step late. Unchanged settings give the same values bit for bit. Returns a
    line per group whose values changed."""
    lines = []
    for scheduler in schedulers.schedulers:
        groups = scheduler.optimizer.param_groups
        for i, group in enumerate(groups):
            want = settings[group["name"]]
            step_lr = want["lr"] * scheduler.lr_lambdas[i](scheduler.last_epoch)
            was = {
                "peak lr": scheduler.base_lrs[i],
                "weight_decay": group["weight_decay"],
                "betas": tuple(group["betas"]),
                "eps": group["eps"],
                f"lr of step {scheduler.last_epoch + 1}": group["lr"],
            }
            now = dict(zip(was, (want["lr"], want["weight_decay"], want["betas"], want["eps"], step_lr), strict=True))
            scheduler.base_lrs[i] = group["initial_lr"] = want["lr"]
            group.update(weight_decay=want["weight_decay"], betas=want["betas"], eps=want["eps"], lr=step_lr)
            changed = [f"{k} {was[k]:.6g} -> {now[k]:.6g}" for k in was if k != "betas" and was[k] != now[k]]
            if was["betas"] != now["betas"]:
                changed.append(f"betas {list(was['betas'])} -> {list(now['betas'])}")
            if changed:
                lines.append(f"optimizer group {group['name']}: " + ", ".join(changed))
        scheduler._last_lr = [group["lr"] for group in groups]
    return list(dict.fromkeys(lines))
