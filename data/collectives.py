"""The one all-gather of small Python values the project uses (checkpoint verdicts, data counters, a bad step's
whereabouts): every rank's value on every rank, or just this one's without a process group. Here, below
mhar_titan, because the data loader needs it too."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist


def gather_objects(value: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    """Every rank's `value` (small, picklable) in rank order, on every rank of `group` (default: all ranks);
    `[value]` when there is no process group or it has one rank. Every rank of the group must call."""
    if not dist.is_initialized():
        return [value]
    world = dist.get_world_size(group)
    if world == 1:
        return [value]
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, value, group=group)
    return everyone
