"""The trainer's dealings with its run folder, as two hooks (components/hooks.py). `RunFolderLock`: one job per
folder, the lock taken before anything is built (rank 0 holds it, every rank follows its verdict), checked every
step, released when the job ends. `RunFolder`: before any load, whether the folder's run is the one this job
describes (components/run_checks.check_resume) and a checkpoint kept only on the store copied down; after the load,
what a resume applies (the config's optimizer and schedule values, the loader's place) and what each start
records (the fingerprint, the run's record)."""

from __future__ import annotations

from typing import Any

import torch
from torchtitan.tools.logging import logger

from data.index import share_from_rank0
from mhar_titan.components import fingerprint, run_checks, run_record
from mhar_titan.components.endings import RESTARTED, read_endings
from mhar_titan.components.hooks import Hook, Scalar, Step, on_device
from mhar_titan.components.lr_schedule import apply_settings
from mhar_titan.components.optimizer import config_kwargs, group_settings, lr_multiplier
from mhar_titan.components.run_lock import LockLost, RunLock, acquire_everywhere
from mhar_titan.components.tensorboard_scalars import RESTARTS_TAG


class RunFolderLock(Hook):
    """The run folder's lock (components/run_lock.py): a job whose lock another job took over stops at once,
    writing nothing more there."""

    name = "run_lock"

    def __init__(self) -> None:
        self.lock: RunLock | None = None  # rank 0's
        self.folder = ""

    def before_build(self, job_config: Any) -> None:
        job = job_config.job
        self.folder = job.dump_folder
        if torch.distributed.get_rank() == 0:
            self.lock = RunLock(job.dump_folder, job.run_lock_stale_s, job.run_lock_wait_s)
        logger.info(acquire_everywhere(self.lock, share_from_rank0))

    def scalars(self, step: Step) -> dict[str, Scalar]:
        return {"lock_lost": Scalar(on_device(self.lock is not None and self.lock.lost, step.loss), "max")}

    def after_step(self, step: Step) -> None:
        if step.values["lock_lost"]:
            lost = LockLost(step.number, self.folder)
            logger.error(lost.line)
            raise lost

    def close(self) -> None:
        if self.lock is not None:
            self.lock.release()


class RunFolder(Hook):
    """The run checked before any load, and each start recorded after it."""

    name = "run_folder"

    def set_up(self, trainer: Any) -> None:
        self.trainer = trainer
        cfg, data, ckpt = trainer.job_config, trainer.dataloader, trainer.checkpointer
        batch = cfg.training.local_batch_size * trainer.dp_degree * trainer.gradient_accumulation_steps  # global
        self.fingerprint = fingerprint.fingerprint(cfg, trainer.model_args, data.shards, batch, data.contents())
        steps, folder, needed = ckpt.all_steps(), ckpt.folder, ckpt.expected_bytes
        self.changes = run_checks.check_resume(cfg, self.fingerprint, steps, folder, needed)
        ckpt.copy_down(cfg.checkpoint.load_step)  # a step kept only on the store, before any work

    def start(self, step: int) -> None:
        """After the load was checked: what a resume applies, then the fingerprint and the run's record (the
        architecture for tools such as hf export)."""
        cfg = self.trainer.job_config
        if self.changes:
            logger.warning(
                f"resuming with changes allowed by checkpoint.allow_changes = {cfg.checkpoint.allow_changes}:"
                + "".join(f"\n  {line}" for line in self.changes)
            )
        applied = self._resumed(step)
        ended = read_endings(cfg.job.dump_folder)
        restarts = sum(e["class"] in RESTARTED for e in ended)
        self.restarts: float | None = float(restarts) if restarts else None  # logged at the first step, if any
        if torch.distributed.get_rank() != 0:
            return
        fingerprint.record(cfg.job.dump_folder, self.fingerprint, step, self.changes)
        world = torch.distributed.get_world_size()
        run_record.record_start(cfg, self.trainer.model_args, step, world, self.changes + applied)

    def metrics(self, step: Step) -> dict[str, float]:
        """At the first step of a start after a crash or a hang: how many the run was restarted after so far."""
        restarts, self.restarts = getattr(self, "restarts", None), None
        return {} if restarts is None else {RESTARTS_TAG: restarts}

    def _resumed(self, step: int) -> list[str]:
        """After a load: the config's optimizer and schedule values applied from the next step, the loader placed
        for this job's layout; on a fresh start nothing to do."""
        if step == 0:
            return []
        trainer = self.trainer
        settings = group_settings(config_kwargs(trainer.job_config.optimizer), lr_multiplier(trainer.model_parts[0]))
        applied = apply_settings(trainer.lr_schedulers, settings)
        if applied:
            logger.warning(f"applied from step {step + 1}:" + "".join(f"\n  {line}" for line in applied))
        # Every rank's loader has delivered gradient_accumulation_steps batches a step: with this job's
        # ranks and accumulation the same global batch then takes the same streams as before.
        loader = trainer.dataloader
        batches, loader.batches = loader.batches, step * trainer.gradient_accumulation_steps
        if batches != loader.batches:
            logger.info(f"[data] another rank or accumulation layout: loader batch {loader.batches} ({batches})")
        return applied
