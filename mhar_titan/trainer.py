"""The project's Trainer: torchtitan's loop, with each concern the recipe adds (the run folder, the EMA, non-finite
steps, spikes, preemption, the data's progress, routing statistics, validation, the step's log and time shares) a
hook (components/hooks.py) that the loop calls at each phase; train_spec.build_hooks lists them."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Sequence
from datetime import timedelta

import torch
from torch.distributed.elastic.multiprocessing.errors import record
from torchtitan.components.dataloader import DataloaderExhaustedError
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.config import JobConfig
from torchtitan.distributed import ParallelDims
from torchtitan.distributed import utils as dist_utils
from torchtitan.tools.logging import logger
from torchtitan.tools.profiling import maybe_enable_memory_snapshot, maybe_enable_profiling
from torchtitan.train import Trainer

from mhar_titan import titan_compat
from mhar_titan.components.checkpoint.manager import CPTCheckpointManager
from mhar_titan.components.hooks import SKIP_STEP, Hook, Hooks, Request, SaveNow, Scalar, Step, reduce_scalars
from mhar_titan.components.step_metrics import (
    StepClock,
    StepReadback,
    StepScalars,
    discard_tensorboard_run,
    flush,
    log_scalars,
    one_tensorboard_run,
    to_device_nowait,
)


class CPTTrainer(Trainer):
    """torchtitan's Trainer, whose loop calls the job's hooks at each phase and reads every step's device values back
    once, without stalling the device."""

    def __init__(self, job_config: JobConfig, hooks: Sequence[Hook]):
        self.hooks = Hooks(list(hooks))  # before torchtitan's __init__, whose init_distributed calls them
        titan_compat.use_checkpoint_manager(CPTCheckpointManager)
        try:
            super().__init__(job_config)
            self.tokens_seen = 0  # all ranks' tokens
            self.clock = StepClock()
            self.readback, self.step_scalars = StepReadback(self.device), StepScalars()
            self.dp_mesh = self.parallel_dims.get_mesh("batch") if self.parallel_dims.dp_enabled else None
            self.dp_group = None if self.dp_mesh is None else self.dp_mesh.get_group()
            self.dp_degree = 1 if self.dp_mesh is None else self.dp_mesh.size()
            self.data_iterator: Iterator | None = None
            self.collective_timeout_s = job_config.comm.train_timeout_seconds  # from the 2nd step; a hook may raise it
            self.hooks.set_up(self)
        except BaseException:
            if hasattr(self, "metrics_processor"):
                discard_tensorboard_run(self.metrics_processor)  # no stray tb/<timestamp> of a refused job
            self.close()
            raise

    def init_distributed(self) -> ParallelDims:
        """torchtitan's, then the hooks that claim what the job needs before anything is built (the run lock)."""
        dims = super().init_distributed()
        self.hooks.each("before_build", self.job_config)
        return dims

    # -- the loop -----------------------------------------------------------------------------

    @record
    def train(self) -> None:
        """Forked from torchtitan 0.2.2 torchtitan/train.py, Trainer.train: the hooks' start after the load, and after
        each step's checkpoint their requests (stop, checkpoint now)."""
        cfg = self.job_config
        self.checkpointer.load(step=cfg.checkpoint.load_step)
        tb = os.path.join(cfg.job.dump_folder, cfg.metrics.save_tb_folder)
        one_tensorboard_run(self.metrics_processor, tb, self.step)
        self.data_iterator = self.batch_generator(self.dataloader)
        self.hooks.each("start", self.step)
        logger.info(f"Training starts at step {self.step + 1}")
        self.clock.start(self.step, cfg.training.steps)
        where = {"global_step": self.step, "base_folder": cfg.job.dump_folder}
        with (
            maybe_enable_profiling(cfg.profiling, **where) as profiler,
            maybe_enable_memory_snapshot(cfg.profiling, **where) as memory,
        ):
            first = True
            while self.should_continue_training():
                self.step += 1
                self.gc_handler.run(self.step)
                try:
                    step = self.train_step(self.data_iterator)
                except DataloaderExhaustedError:
                    logger.warning("Ran out of data; last step was canceled.")
                    break
                self._save(step)
                self.hooks.each("after_save", step)
                self._carry_out(self.hooks.request(step), step)
                for tracer in filter(None, (profiler, memory)):
                    tracer.step()
                if first:  # compile and lazy init are done: shorter timeouts for a faster signal
                    timeout = timedelta(seconds=self.collective_timeout_s)
                    dist_utils.set_pg_timeouts(timeout=timeout, parallel_dims=self.parallel_dims)
                    first = False
        # Every rank done with its collectives before any tears down (a rank leaving early can abort a peer in one);
        # no 2 s sleep on rank 0 as in torchtitan's loop: under torchrun the agent, not rank 0, hosts the store.
        torch.distributed.barrier()
        logger.info("Training completed")

    def train_step(self, data_iterator: Iterator) -> Step:
        """Forked from torchtitan 0.2.2 torchtitan/train.py, Trainer.train_step: global token counts, the hooks at each
        phase, one readback of the step's device values, and no update where a hook agreed to skip it (SKIP_STEP)."""
        cfg = self.job_config
        step = Step(self.step, last=self.step == cfg.training.steps, log=self.metrics_processor.should_log(self.step))
        self.optimizers.zero_grad()
        self.hooks.each("before_step", step)
        first_batch = self.dataloader.batches
        microbatches = [next(data_iterator) for _ in range(self.gradient_accumulation_steps)]
        step.batches = (first_batch, self.dataloader.batches)
        self.hooks.each("after_data", step)
        self.tokens_seen += sum(labels.numel() for _, labels in microbatches) * self.dp_degree
        own_mean = self._forward_backward(microbatches, step)
        self._read_back(step, own_mean)
        if not step.applied:
            self.optimizers.zero_grad()
        elif not self.skip_on_device:
            self.checkpointer.maybe_wait_for_staging()
            self.optimizers.step()
        step.lrs = {g["name"]: g["lr"] for g in self.optimizers.optimizers[0].param_groups}  # this step's LR
        self.hooks.each("after_step", step)
        self.lr_schedulers.step()  # the schedule follows the step count, applied or not
        self.clock.tick(step.number)
        self._log(step)
        return step

    def _forward_backward(self, microbatches: list, step: Step) -> torch.Tensor:
        """Sets the step's loss (this rank's share of the global mean loss) and clipped gradient norm; returns this
        rank's own mean loss."""
        dev = self.device
        local_tokens = to_device_nowait(sum((labels != IGNORE_INDEX).sum() for _, labels in microbatches), dev)
        global_tokens = local_tokens.clone()  # summed on the device (torchtitan's dist_sum reads it back: a sync)
        if self.dp_group is not None:
            torch.distributed.all_reduce(global_tokens, group=self.dp_group)
        losses = []
        for input_dict, labels in microbatches:
            input_dict = {k: to_device_nowait(v, dev) if torch.is_tensor(v) else v for k, v in input_dict.items()}
            loss = self.forward_backward_step(
                input_dict=input_dict, labels=to_device_nowait(labels, dev), global_valid_tokens=global_tokens
            )
            losses.append(loss.detach())
        self.hooks.each("after_backward", step)
        params = [p for m in self.model_parts for p in m.parameters()]
        ep = self.parallel_dims.ep_enabled
        step.grad_norm = dist_utils.clip_grad_norm_(
            params, self.job_config.training.max_norm, foreach=True, pp_mesh=None, ep_enabled=ep
        )
        step.loss = torch.stack(losses).sum()
        return step.loss * global_tokens / local_tokens

    def _read_back(self, step: Step, own_mean: torch.Tensor) -> None:
        """The step's device values (the loss summed over the data-parallel ranks with its parts, the largest rank's
        own mean loss, the gradient norm, and every hook's), combined by one collective per kind and copied to the
        host without a sync. Where every optimizer can skip a step on the device (fused AdamW's `found_inf`, as under
        a GradScaler), the update is issued before the host reads them, so the host's reading overlaps it."""
        own = {"loss": Scalar(step.loss, "sum"), "loss_max": Scalar(own_mean, "max")}
        own["grad_norm"] = Scalar(step.grad_norm)
        if (parts := self.loss_fn.take_parts()) is not None:
            own["loss_parts"] = Scalar(parts, "sum")  # CE, z-term, valid tokens
        step.device = reduce_scalars(self.hooks.scalars(step, own), self.dp_group)
        self.readback.stage(self.step_scalars.pack(step.device))
        if self.skip_on_device:
            if SKIP_STEP in step.device:
                for opt in self.optimizers.optimizers:
                    opt.found_inf = step.device[SKIP_STEP]
            self.checkpointer.maybe_wait_for_staging()
            self.optimizers.step()
        step.values = self.step_scalars.unpack(self.readback.read())
        step.applied = not step.values.get(SKIP_STEP, 0.0)

    @property
    def skip_on_device(self) -> bool:
        """Every optimizer can skip a step on the device (fused Adam and AdamW honour `found_inf`; foreach can't)."""
        return all(getattr(opt, "_step_supports_amp_scaling", False) for opt in self.optimizers.optimizers)

    def _log(self, step: Step) -> None:
        """Every hook's scalars of the step in one TensorBoard event; on log steps, flushed, and the log line."""
        metrics = self.hooks.metrics(step)
        if metrics:
            log_scalars(self.metrics_processor.logger, metrics, step.number)
        if step.log:
            flush(self.metrics_processor)
            logger.info(self.hooks.line(step, metrics))

    def _save(self, step: Step) -> None:
        """The interval checkpoint (and the last step's); its time goes into the ETA, not the step time."""
        cfg = self.job_config
        began = time.perf_counter()
        self.checkpointer.save(step.number, last_step=step.last)
        if cfg.checkpoint.enable and step.number % cfg.checkpoint.interval == 0:
            self.clock.pause(time.perf_counter() - began, "checkpoint", cfg.checkpoint.interval)

    def _carry_out(self, requests: list[Request], step: Step) -> None:
        """The hooks' requests in their order: a checkpoint now, or the first stop (its checkpoint, then its error)."""
        for request in requests:
            if isinstance(request, SaveNow) and request.temporary:
                began = time.perf_counter()
                self.checkpointer.save_temporary(step.number)
                self.clock.pause(time.perf_counter() - began, "checkpoint", self.job_config.checkpoint.interval)
                continue
            if isinstance(request, SaveNow):
                self.checkpointer.save_now(step.number)
                continue
            if request.checkpoint:
                self.checkpointer.save_now(step.number)
            if request.after_checkpoint is not None:
                request.after_checkpoint()
            raise request.error

    # -- checkpointed trainer state -------------------------------------------------------------

    def state_dict(self) -> dict:
        # ntokens_seen: all ranks' tokens (torchtitan keeps one rank's), so it survives a change of rank count.
        return self.hooks.state_dict({"step": self.step, "ntokens_seen": self.tokens_seen})

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self.tokens_seen = int(state_dict["ntokens_seen"])
        self.hooks.each("load_state_dict", state_dict)

    def close(self) -> None:
        """torchtitan's (the checkpointer finishes a background save), then every hook's (the run lock last)."""
        try:
            super().close()
        finally:
            self.hooks.close()
