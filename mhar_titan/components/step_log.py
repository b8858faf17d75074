"""What a training step logs, as a hook (components/hooks.py): on log steps, TensorBoard scalars (the loss and its
parts, the largest rank's loss, the gradient norm, every group's LR, tokens seen, throughput, MFU, memory) and the
log line's head, from the values the step read back. The other hooks add their own scalars and parts of the line
(the data's counters, spikes, routing statistics, time shares)."""

from __future__ import annotations

from typing import Any

from torchtitan.config import JobConfig

from mhar_titan.components.hooks import Hook, Step
from mhar_titan.components.step_metrics import rank_peaks, throughput


def mfu_note(job_config: JobConfig) -> str:
    """Under a float8 converter MFU still counts the model's FLOPs against the bf16 peak (torchtitan's; #2451 there):
    a bf16-equivalent figure, which the log line says."""
    return " (bf16-equivalent)" if any("float8" in c for c in job_config.model.converters) else ""


class StepLog(Hook):
    name = "step_log"

    def set_up(self, trainer: Any) -> None:
        self.trainer = trainer
        self.mfu_note = mfu_note(trainer.job_config)

    def metrics(self, step: Step) -> dict[str, float]:
        """On log steps (every rank: the memory peaks are gathered)."""
        if not step.log:
            return {}
        v, t = step.values, self.trainer
        metrics = {
            "train/loss": v["loss"],
            "train/loss_max": v["loss_max"],
            "grad_norm": v["grad_norm"],
            "tokens_seen": t.tokens_seen,
        }
        if "loss_parts" in v:  # CE and z-loss of this step, per valid token over all ranks
            ce, z, tokens = v["loss_parts"]
            metrics.update({"train/ce": ce / tokens, "train/z_loss": z / tokens})
        metrics.update({f"lr/{name}": lr for name, lr in step.lrs.items()})
        metrics.update(throughput(t.metrics_processor))
        metrics.update(rank_peaks(metrics["memory/peak_active_gib"], t.device))
        return metrics

    def line(self, step: Step, m: dict[str, float]) -> str:
        v, clock = step.values, self.trainer.clock
        return (
            f"step {step.number}/{self.trainer.job_config.training.steps}  loss {v['loss']:.4f}"
            + (f" (ce {m['train/ce']:.4f})" if "loss_parts" in v else "")
            + f"  lr {next(iter(step.lrs.values())):.2e}  grad_norm {v['grad_norm']:.3f}"
            f"  {m['tokens_per_s']:,.0f} tok/s/dev  {clock.pace(self.trainer.tokens_seen)}"
            f"  mfu {m['mfu']:.1f}%{self.mfu_note}  mem {m['memory/peak_reserved_gib']:.1f} GiB  eta {clock.eta()}"
        )
