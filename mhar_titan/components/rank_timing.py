"""Each rank's time at every log step, the slowest rank and its lag, and a straggler warned once: a slow GPU or node
paces every step of its arm and bends the pair's speed ratio, and nothing else names it while the run goes on.

Per rank, a step of the log window: `step_s` (the host's wall time, alike on every rank: the collectives wait for
the slowest), `data_s` (waiting for the batches) and `compute_s`, the device time of the layers' forwards on the
log step (CUDA events around each block, recorded after FSDP has waited for the block's weights and so free of the
other ranks' pace; wall time on a CPU). A rank whose `data_s + compute_s` is above the median of all ranks by more
than `[stragglers] share` in `[stragglers] windows` log windows in a row is warned once, with its host; each log step
also says whether any rank was that far above (`ranks/straggling`), which the pair's report uses to give the speed
ratio over the windows where neither arm had a straggler.

One all-gather of three numbers a rank at each log step; nothing on the other steps.
"""

from __future__ import annotations

import socket
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from torchtitan.tools.logging import logger

from data.collectives import gather_objects
from mhar_titan.components.hooks import Hook, Step

MEASURES = ("step_s", "data_s", "compute_s")


def rank_tag(measure: str, rank: int) -> str:
    """`ranks_compute_s/rank003`: a chart group a measure, a chart a rank."""
    return f"ranks_{measure}/rank{rank:03d}"


def slowest(own: list[list[float]]) -> tuple[int, float, float]:
    """(rank, its data + compute seconds, their median over the ranks) of the rank with the most."""
    totals = [row[1] + row[2] for row in own]
    rank = max(range(len(totals)), key=lambda r: totals[r])
    return rank, totals[rank], statistics.median(totals)


class RankTiming(Hook):
    """The ranks' times at each log step in TensorBoard and the log line; a straggler warned once."""

    name = "rank_timing"

    def __init__(self, share: float, windows: int):
        if not share > 0:
            raise ValueError(f"[stragglers] share = {share} must be > 0 (a fraction of the median, e.g. 0.1)")
        if windows < 1:
            raise ValueError(f"[stragglers] windows = {windows} must be >= 1")
        self.share, self.windows = share, windows
        self.in_a_row: dict[int, int] = {}
        self.warned: set[int] = set()
        self.measuring = False
        self.marks: list[tuple[Any, Any]] = []
        self.window_began, self.steps, self.data_s = time.perf_counter(), 0, 0.0

    def set_up(self, trainer: Any) -> None:
        self.cuda = trainer.device.type == "cuda"
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        model = trainer.model_parts[0]
        layers = model.layers.values() if isinstance(model.layers, torch.nn.ModuleDict) else model.layers
        for layer in layers:  # after fully_shard's own pre-forward hook: the block's weights are there
            layer.register_forward_pre_hook(self._began)
            layer.register_forward_hook(self._ended)
        self.hosts = gather_objects(socket.gethostname())

    def _stamp(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _began(self, *_: Any) -> None:
        if self.measuring and torch.is_grad_enabled():  # a training forward (validation runs without grad)
            self.marks.append((self._stamp(), None))

    def _ended(self, *_: Any) -> None:
        if self.measuring and torch.is_grad_enabled() and self.marks and self.marks[-1][1] is None:
            self.marks[-1] = (self.marks[-1][0], self._stamp())

    def _compute_s(self) -> float:
        """The recorded forwards' seconds (their events completed: the step's values were read back after them)."""
        if self.cuda:
            return sum(a.elapsed_time(b) for a, b in self.marks if b is not None) / 1e3
        return sum(b - a for a, b in self.marks if b is not None)

    def before_step(self, step: Step) -> None:
        self.measuring, self.marks = step.log, []
        self.fetch = time.perf_counter()

    def after_data(self, step: Step) -> None:
        self.data_s += time.perf_counter() - self.fetch
        self.steps += 1

    def metrics(self, step: Step) -> dict[str, float]:
        if not step.log:
            return {}
        now = time.perf_counter()
        n = max(self.steps, 1)
        mine = [(now - self.window_began) / n, self.data_s / n, self._compute_s()]
        self.window_began, self.steps, self.data_s, self.measuring = now, 0, 0.0, False
        rows = [mine]
        if self.world > 1:  # on the device NCCL needs (gloo: the host)
            own = torch.tensor(mine, dtype=torch.float64, device="cuda" if self.cuda else "cpu")
            parts = [torch.empty_like(own) for _ in range(self.world)]
            dist.all_gather(parts, own)
            rows = torch.stack(parts).tolist()
        out_metrics = {rank_tag(m, r): rows[r][i] for r in range(len(rows)) for i, m in enumerate(MEASURES)}
        rank, total, median = slowest(rows)
        lag = total / median - 1 if median > 0 else 0.0
        over = {r for r, row in enumerate(rows) if median > 0 and (row[1] + row[2]) > median * (1 + self.share)}
        self.in_a_row = {r: self.in_a_row.get(r, 0) + 1 for r in over}
        for r, count in self.in_a_row.items():
            if count >= self.windows and r not in self.warned:
                self.warned.add(r)
                row = rows[r]
                logger.warning(
                    f"step {step.number}: rank {r} on host {self.hosts[r]} is a straggler: data + compute "
                    f"{row[1] + row[2]:.3f} s a step, {(row[1] + row[2]) / median - 1:+.0%} against the median of "
                    f"{median:.3f} s over the ranks, for {count} log windows in a row ([stragglers] share "
                    f"{self.share:g}, windows {self.windows})"
                )
        out_metrics.update(
            {
                "ranks/slowest": float(rank),
                "ranks/lag": lag,
                "ranks/straggling": float(bool(over)),
                "ranks/stragglers_warned": float(len(self.warned)),
            }
        )
        return out_metrics

    def line(self, step: Step, metrics: dict[str, float]) -> str:
        if "ranks/slowest" not in metrics or self.world == 1:
            return ""
        return f"slowest rank {int(metrics['ranks/slowest'])} ({metrics['ranks/lag']:+.0%})"
