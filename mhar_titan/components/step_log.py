"""What a training step logs: TensorBoard scalars (loss and its parts, gradient norm, every LR, data counters and
shares, throughput, memory, routing statistics) and one readable line, from the values the step read back."""

from __future__ import annotations

import torch
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.config import JobConfig
from torchtitan.tools.logging import logger

from data.counters import mixture_shares, stage_shares, token_shares
from data.loader import ParquetDataLoader, gather_counters
from mhar_titan.components.routing_stats import name_routing_stats
from mhar_titan.components.step_metrics import (
    StepClock,
    StepValues,
    flush,
    log_scalars,
    rank_peaks,
    throughput,
)
from mhar_titan.components.step_phases import StepPhases, shares_text
from mhar_titan.model.sources import SITE_NAMES


def mfu_note(job_config: JobConfig) -> str:
    """Under a float8 converter MFU still counts the model's FLOPs against the bf16 peak (torchtitan's; #2451 there):
    a bf16-equivalent figure, which the log line says."""
    return " (bf16-equivalent)" if any("float8" in c for c in job_config.model.converters) else ""


class StepLog:
    def __init__(self, mp: MetricsProcessor, job_config: JobConfig, device: torch.device, n_layers: int,
                 dataloader: ParquetDataLoader, clock: StepClock, phases: StepPhases):  # fmt: skip
        self.mp, self.cfg, self.device, self.n_layers = mp, job_config, device, n_layers
        self.dataloader, self.clock, self.phases = dataloader, clock, phases
        self.mfu_note = mfu_note(job_config)

    def write(self, step: int, v: StepValues, lrs: dict[str, float], tokens_seen: int, skipped: int,
              extra: dict[str, float]) -> None:  # fmt: skip
        """`lrs`: each group's LR as the step applied it (the scheduler has moved on since); `extra`: more scalars
        of a log step (the spike scores). Log steps write the scalars and the line (the loss may come on other
        steps too, for the spike scores), routing statistics their own steps; every rank calls (the counters are
        gathered)."""
        self.clock.tick(step)
        schedule = self.dataloader.schedule
        if schedule.staged and step > 1 and schedule.at(step).start == step:
            stage = schedule.describe(self.dataloader.names)[schedule.at(step).number - 1]
            shares = ", ".join(f"{name} {w:.1%}" for name, w in stage["weights"].items())
            logger.info(f"[data] mixture stage {stage['number']} begins at step {step}: {shares}")
        if v.loss is not None and self.mp.should_log(step):
            metrics = {**self._metrics(step, v, lrs, tokens_seen, skipped), **extra}
            log_scalars(self.mp.logger, metrics, step)
            flush(self.mp)
            logger.info(self._line(step, v, metrics, lrs, tokens_seen))
        if v.stats:
            named = name_routing_stats(torch.tensor(v.stats).reshape(self.n_layers, len(SITE_NAMES), -1))
            log_scalars(self.mp.logger, named, step)

    def _metrics(self, step: int, v: StepValues, lrs: dict[str, float], tokens_seen: int, skipped: int) -> dict:
        counters = gather_counters(self.dataloader)
        metrics = {f"data/{k}": value for k, value in counters.items()}
        metrics.update({**mixture_shares(counters), **token_shares(counters, top=self.cfg.data.token_share_sources)})
        if self.dataloader.schedule.staged:  # the stage this step trained in, and the shares delivered in it
            metrics.update({"data/stage": self.dataloader.schedule.at(step).number, **stage_shares(counters)})
        metrics.update({"train/loss": v.loss, "train/loss_max": v.loss_max, "grad_norm": v.grad_norm,
                        "tokens_seen": tokens_seen, "train/skipped_steps": skipped})  # fmt: skip
        if v.parts:  # CE and z-loss of this step, per valid token over all ranks
            ce, z, tokens = v.parts
            metrics.update({"train/ce": ce / tokens, "train/z_loss": z / tokens})
        metrics.update({f"lr/{name}": lr for name, lr in lrs.items()})
        metrics.update(throughput(self.mp))
        metrics.update(rank_peaks(metrics["memory/peak_active_gib"], self.device))
        metrics.update(self.phases.take(self.clock.take_pauses()))
        return metrics

    def _line(self, step: int, v: StepValues, m: dict[str, float], lrs: dict[str, float], tokens_seen: int) -> str:
        return (
            f"step {step}/{self.cfg.training.steps}  loss {v.loss:.4f}"
            + (f" (ce {m['train/ce']:.4f})" if v.parts else "")
            + f"  lr {next(iter(lrs.values())):.2e}  grad_norm {v.grad_norm:.3f}"
            f"  {m['tokens_per_s']:,.0f} tok/s/dev  {self.clock.pace(tokens_seen)}"
            f"  mfu {m['mfu']:.1f}%{self.mfu_note}  mem {m['memory/peak_reserved_gib']:.1f} GiB  eta {self.clock.eta()}"
            f"  {shares_text(m)}"
        )
