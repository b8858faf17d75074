"""The spike monitor in a job, as a hook (components/hooks.py): each applied step's loss, gradient norm and every
value a hook of the job names in its `spike_scored`, scored as they happen (components/spikes.py: the score and
the record), said, recorded by rank 0, and marked in TensorBoard; the checkpoint before a spike kept out of
retention where asked; the windows checkpointed with the trainer's state, so a resumed job scores as the
uninterrupted one did."""

from __future__ import annotations

from typing import Any

import torch
from torchtitan.tools.logging import logger

from mhar_titan.components.checkpoint.layout import complete_steps
from mhar_titan.components.hooks import Hook, Step
from mhar_titan.components.spikes import TAGS, SpikeMonitor, append, cut_back, newest_before


class RunSpikes(Hook):
    """The monitor in a job: scores each applied step, says so, records the spikes (rank 0), keeps the checkpoint
    before each out of retention where asked (rank 0, which purges), and restores all of that at a resume. Scores
    the loss and the gradient norm, and every value a hook of the job names in its `spike_scored`. With `[spikes]
    enable = false` it does nothing."""

    name = "spikes"

    def __init__(self, settings: Any):
        self.settings = settings
        self.enabled, self.keep_before = settings.enable, settings.keep_checkpoint_before
        self.monitor = SpikeMonitor(settings.window, settings.min_history, settings.threshold)
        self.marks: dict[str, float] = {}

    def set_up(self, trainer: Any) -> None:
        tags = TAGS + tuple(tag for hook in trainer.hooks for tag in hook.spike_scored if tag not in TAGS)
        s = self.settings
        self.monitor = SpikeMonitor(s.window, s.min_history, s.threshold, tags)
        self.folder, self.rank0 = trainer.job_config.job.dump_folder, torch.distributed.get_rank() == 0
        self.checkpointer = trainer.checkpointer

    def start(self, step: int) -> None:
        """After the load: the record cut back to the step resumed from, and the checkpoints it keeps."""
        if self.enabled and self.rank0:
            kept = {s.kept_checkpoint for s in cut_back(self.folder, step) if s.kept_checkpoint is not None}
            self.checkpointer.keep(kept)

    def after_step(self, step: Step) -> None:
        """An applied step's global values scored; said, recorded and marked for TensorBoard if they spiked."""
        self.marks = {}
        if not (self.enabled and step.applied):
            return
        spikes = self.monitor.observe(step.number, {tag: step.values[tag] for tag in self.monitor.tags})
        if spikes and self.rank0:
            before = newest_before(complete_steps(self.checkpointer.folder), step.number) if self.keep_before else None
            for s in spikes:
                s.kept_checkpoint = before
            self.checkpointer.keep({before} - {None})
            append(self.folder, spikes)
        for s in spikes:
            logger.warning(s.line(self.monitor.threshold, self.monitor.window))
        self.marks = {f"spikes/{s.tag}": s.value for s in spikes}
        self.marks.update({f"spikes/{s.tag}_spike_score": s.score for s in spikes})

    def metrics(self, step: Step) -> dict[str, float]:
        """A spike's value and score at its step; the counts and this step's scores on log steps."""
        return {**self.marks, **(self.monitor.metrics() if step.log and self.enabled else {})}

    def state_dict(self) -> dict[str, Any]:
        """The trainer's checkpointed entry (none with scoring off)."""
        return {"spikes": self.monitor.state()} if self.enabled else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.enabled:
            self.monitor.load(state["spikes"])
