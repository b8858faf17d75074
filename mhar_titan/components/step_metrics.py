"""Throughput, MFU, peak memory and ETA for the per-step log; the step's host-device copies without a sync."""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
from tensorboard.compat.proto.summary_pb2 import Summary
from torch.utils.tensorboard import SummaryWriter
from torchtitan.components.metrics import BaseLogger, MetricsProcessor, TensorBoardLogger

from mhar_titan.titan_compat import each_logger, take_log_window, tensorboard_writer


def throughput(mp: MetricsProcessor) -> dict[str, float]:
    """Tokens/s per device, MFU and peak memory since the last log step; resets those counters."""
    w = take_log_window(mp)
    tps = w["tokens"] / (w["seconds"] * mp.parallel_dims.non_data_parallel_size)
    mem = w["memory"]
    return {
        "tokens_per_s": tps,
        "mfu": 100 * w["flops_per_token"] * tps / w["peak_flops"],
        "memory/peak_active_gib": mem.max_active_gib,
        "memory/peak_reserved_gib": mem.max_reserved_gib,
        "memory/alloc_retries": mem.num_alloc_retries,
        "time/step_s": w["seconds"] / mp.job_config.metrics.log_freq,
        "time/data_loading_pct": 100 * w["loading_seconds"] / w["seconds"],
    }


def rank_peaks(peak_active_gib: float, device: torch.device) -> dict[str, float]:
    """The largest peak active memory over all ranks since the last log step, and the rank that had it: only
    rank 0 writes TensorBoard, and ranks need not peak alike (a collective, at log steps only)."""
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return {"memory/peak_active_gib_max": peak_active_gib, "memory/peak_active_rank": 0}
    mine = torch.tensor([peak_active_gib], dtype=torch.float64, device=device)
    every = [torch.empty_like(mine) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(every, mine)
    values = torch.cat(every).tolist()  # one readback
    rank = max(range(len(values)), key=values.__getitem__)
    return {"memory/peak_active_gib_max": values[rank], "memory/peak_active_rank": rank}


def log_scalars(logger: BaseLogger, metrics: dict[str, float], step: int) -> None:
    """`logger.log(metrics, step)`, with each TensorBoard writer given one event that holds every
    value (TensorBoard reads each as its own scalar): torch's add_scalar builds and queues an event
    per value, which the routing statistics' hundreds of values turn into host time a step."""
    for lg in each_logger(logger):
        tb = tensorboard_writer(lg)
        writer = None if tb is None else tb.file_writer
        if writer is None:
            lg.log(metrics, step)
            continue
        prefix = "" if lg.tag is None else f"{lg.tag}/"
        values = [Summary.Value(tag=prefix + k, simple_value=float(v)) for k, v in metrics.items()]
        writer.add_summary(Summary(value=values), step)


def to_device_nowait(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on the device without the host waiting: a copy from pageable memory waits
    for all work queued before it (the last step's optimizer), and the GPU then idles while the
    host issues the next forward. Pinned through torch's caching host allocator, which keeps a
    block until its copy is done."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


class StepScalars:
    """The layout of the one tensor a step reads back (`StepReadback`): named values in, named values out, so no
    caller counts positions. A 0-dim value reads back as a float, any other as the tuple of its elements."""

    def __init__(self) -> None:
        self.layout: list[tuple[str, int, bool]] = []  # (name, elements, a 0-dim value)

    def pack(self, named: dict[str, torch.Tensor]) -> torch.Tensor:
        self.layout = [(name, t.numel(), t.dim() == 0) for name, t in named.items()]
        return torch.cat([t.detach().double().reshape(-1) for t in named.values()])

    def unpack(self, values: list[float]) -> dict[str, float | tuple[float, ...]]:
        expected = sum(n for _, n, _ in self.layout)
        if len(values) != expected:
            raise ValueError(f"{len(values)} step values, the layout has {expected}")
        out: dict[str, float | tuple[float, ...]] = {}
        at = 0
        for name, n, scalar in self.layout:
            out[name] = values[at] if scalar else tuple(values[at : at + n])
            at += n
        return out


class StepReadback:
    """A step's scalars (verdict, stop request, loss parts, gradient norm, routing statistics) for the
    host without stalling the GPU: staged on the device once the backward is done, copied
    asynchronously into pinned memory, read after the optimizer step has been issued. The host
    then waits for the backward at most, while the GPU runs the optimizer, instead of for the
    whole step (a plain .item() waits for everything issued before it). On a CPU, the values."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.host: torch.Tensor | None = None
        self.event: torch.cuda.Event | None = None

    def stage(self, values: torch.Tensor) -> None:
        if not self.cuda:
            self.host = values.detach()
            return
        if self.host is None or self.host.shape != values.shape or self.host.dtype != values.dtype:
            self.host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
        self.host.copy_(values.detach(), non_blocking=True)
        self.event = torch.cuda.Event()
        self.event.record()

    def read(self) -> list[float]:
        if self.host is None:
            raise RuntimeError("StepReadback.read before stage")
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()


def flush(mp: MetricsProcessor) -> None:
    """Push logged scalars to disk, so a killed job loses none of the steps it finished."""
    for backend in each_logger(mp.logger):
        writer = getattr(backend, "writer", None)
        if writer is not None:
            writer.flush()


class StepClock:
    """Seconds per training step and the remaining time of the job: the mean step time (not counting
    the first step: compile, warm-up) times the steps left, plus each kind of periodic work
    (validation, checkpoints) at its mean duration times the times it will still run."""

    def __init__(self) -> None:
        self.origin: tuple[float, int] | None = None
        self.last_step = self.total = 0
        self.periodic: dict[str, list[float]] = {}  # kind -> [every, runs, seconds]
        self.window: dict[str, float] = {}  # kind -> seconds since the last log step (take_pauses)

    def start(self, step: int, total: int) -> None:
        self.origin, self.last_step, self.total = None, step, total

    def tick(self, step: int) -> None:
        if self.origin is None:
            self.origin = (time.perf_counter(), step)
        self.last_step = step

    def pause(self, seconds: float, kind: str = "validation", every: int = 0) -> None:
        """Time that is not training: left out of the step time, and counted as `kind`, which runs at
        every multiple of `every` steps (0: not again)."""
        if self.origin is not None:
            self.origin = (self.origin[0] + seconds, self.origin[1])
        runs = self.periodic.setdefault(kind, [every, 0, 0.0])
        runs[0], runs[1], runs[2] = every, runs[1] + 1, runs[2] + seconds
        self.window[kind] = self.window.get(kind, 0.0) + seconds

    def take_pauses(self) -> dict[str, float]:
        """Seconds of each kind of pause since the last call (a log step's window)."""
        window, self.window = self.window, {}
        return window

    def seconds_per_step(self) -> float | None:
        if self.origin is None or self.last_step <= self.origin[1]:
            return None
        return (time.perf_counter() - self.origin[0]) / (self.last_step - self.origin[1])

    def eta_seconds(self) -> float | None:
        per_step = self.seconds_per_step()
        if per_step is None:
            return None
        left = per_step * max(self.total - self.last_step, 0)
        for every, runs, seconds in self.periodic.values():
            if every > 0 and runs:
                to_come = self.total // every - self.last_step // every
                left += seconds / runs * max(to_come, 0)
        return left

    def pace(self, tokens_seen: int) -> str:
        """'1.23 s/step  tokens 1,234,567 (12.5%)': the step time, the tokens seen, the share of the steps done."""
        per_step = self.seconds_per_step()
        done = self.last_step / max(self.total, 1)
        return f"{'?' if per_step is None else f'{per_step:.2f}'} s/step  tokens {tokens_seen:,} ({done:.1%})"

    def eta(self) -> str:
        left = self.eta_seconds()
        if left is None:
            return "?"
        hours, rest = divmod(int(left), 3600)
        return f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s"


def one_tensorboard_run(mp: MetricsProcessor, folder: str, step: int) -> None:
    """TensorBoard writes to `folder` (<dump_folder>/tb) at every start, not to a new timestamped folder
    (torchtitan's), so a preempted and resumed job is one run in TensorBoard. Its events from step + 1
    on are purged (`purge_step`): a job resumed from an earlier checkpoint replaces what the lost
    timeline logged after it. Called once the checkpoint is loaded (`step`: the resumed step)."""
    for lg in each_logger(mp.logger):
        if not isinstance(lg, TensorBoardLogger):
            continue
        old = Path(lg.writer.log_dir)
        lg.writer.close()
        lg.writer = SummaryWriter(folder, max_queue=1000, purge_step=step + 1 if step else None)
        if old != Path(folder):  # torchtitan's writer's folder: remove the empty event file this process made
            _remove_own_events(old)


def discard_tensorboard_run(mp: MetricsProcessor) -> None:
    """A job refused before its first step: close torchtitan's timestamped writer and remove what this
    process put there, so no empty run appears in TensorBoard."""
    for lg in each_logger(mp.logger):
        if isinstance(lg, TensorBoardLogger):
            lg.writer.close()
            folder = Path(lg.writer.log_dir)
            _remove_own_events(folder)
            if not folder.exists() and folder.parent.is_dir() and not any(folder.parent.iterdir()):
                folder.parent.rmdir()  # <dump_folder>/tb, made for this job alone


def _remove_own_events(folder: Path) -> None:
    for p in folder.glob(f"events.out.tfevents.*.{os.getpid()}.*"):
        p.unlink()
    if folder.is_dir() and not any(folder.iterdir()):
        folder.rmdir()
