"""The trainer's dealings with its run folder: the lock at start, what a resume applies and records, and the
stops that end a job short of its steps (preemption, data read to its end); the checks before any load are
components/run_checks.check_resume. A mixin of CPTTrainer (mhar_titan/trainer.py), which holds the loop."""

from __future__ import annotations

import torch
from torchtitan.tools.logging import logger

from data.counters import mixture_counter
from data.index import share_from_rank0
from data.loader import gather_counters
from mhar_titan.components import fingerprint, run_record
from mhar_titan.components.lr_schedule import apply_settings
from mhar_titan.components.optimizer import config_kwargs, group_settings, lr_multiplier
from mhar_titan.components.preemption import REQUEUE_EXIT_CODE, Preempted, SourcesExhausted
from mhar_titan.components.run_lock import RunLock, acquire_everywhere


class RunFolder:
    """Needs torchtitan's Trainer after it in the MRO, and the trainer's `fingerprint`, `checkpointer`,
    `dataloader`, `preemption` and `step`."""

    run_lock: RunLock | None = None

    def init_distributed(self):
        """torchtitan's, then this job takes the run folder's lock (rank 0; all ranks follow its verdict)
        before it builds or reads anything there."""
        dims = super().init_distributed()
        job = self.job_config.job
        if torch.distributed.get_rank() == 0:
            self.run_lock = RunLock(job.dump_folder, job.run_lock_stale_s, job.run_lock_wait_s)
        logger.info(acquire_everywhere(self.run_lock, share_from_rank0))
        return dims

    # -- what a resume applies and records ------------------------------------------------------

    def _resumed(self) -> list[str]:
        """After a load: the config's optimizer and schedule values applied from the next step, the loader
        placed for this job's layout; on a fresh start nothing to do."""
        if self.step == 0:
            return []
        cfg = self.job_config
        settings = group_settings(config_kwargs(cfg.optimizer), lr_multiplier(self.model_parts[0]))
        applied = apply_settings(self.lr_schedulers, settings)
        if applied:
            logger.warning(f"applied from step {self.step + 1}:" + "".join(f"\n  {line}" for line in applied))
        # Every rank's loader has delivered gradient_accumulation_steps batches a step: with this job's
        # ranks and accumulation the same global batch then takes the same streams as before.
        batches, self.dataloader.batches = self.dataloader.batches, self.step * self.gradient_accumulation_steps
        if batches != self.dataloader.batches:
            logger.info(
                f"[data] another rank or accumulation layout: loader batch {self.dataloader.batches} ({batches})"
            )
        if cfg.data.on_source_exhausted == "stop" and self.step < cfg.training.steps:
            if out := self._exhausted_sources():
                raise self._exhausted_exit(out, again=True)
        return applied

    def _record_run(self, changes: list[str]) -> None:
        """After the load was checked: the fingerprint, and the architecture for tools (hf export)."""
        if changes:
            allowed = self.job_config.checkpoint.allow_changes
            logger.warning(
                f"resuming with changes allowed by checkpoint.allow_changes = {allowed}:"
                + "".join(f"\n  {line}" for line in changes)
            )
        applied = self._resumed()
        if torch.distributed.get_rank() != 0:
            return
        fingerprint.record(self.job_config.job.dump_folder, self.fingerprint, self.step, changes)
        world = torch.distributed.get_world_size()
        run_record.record_start(self.job_config, self.model_args, self.step, world, changes + applied)

    def _exhausted_sources(self) -> list[str]:
        """The mixture sources some rank's stream has read to its end (every rank must call)."""
        return [name for name, n in mixture_counter(gather_counters(self.dataloader), "epochs").items() if n]

    def _exhausted_exit(self, sources: list[str], again: bool) -> SourcesExhausted:
        exit_ = SourcesExhausted(self.step, self.job_config.training.steps, sources, again)
        logger.error(exit_.message)
        return exit_

    def _stop_for_requeue(self, reason: str) -> None:
        if not self.job_config.checkpoint.enable:
            # A requeued job would start over from the base: stop without asking for a requeue.
            raise RuntimeError(
                f"step {self.step}: asked to stop ({reason}); checkpointing is off, so nothing was saved and "
                "the job is not requeued (it would start over from step 0)"
            )
        self.checkpointer.save_now(self.step)
        if torch.distributed.get_rank() == 0:
            self.preemption.mark(self.step, reason)
        logger.warning(
            f"step {self.step}: preempted ({reason}); checkpoint written; exiting {REQUEUE_EXIT_CODE} to be requeued"
        )
        raise Preempted(self.step, reason)

    def close(self) -> None:
        """torchtitan's, then the run lock is released (a refused or failed job included, and a job whose background
        save failed as it closed)."""
        try:
            super().close()
        finally:
            if self.run_lock is not None:
                self.run_lock.release()
