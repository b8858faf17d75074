"""The project's Trainer: torchtitan's, plus the state and metrics the recipe adds."""

from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import Any

import torch
from torch.distributed.elastic.multiprocessing.errors import record
from torchtitan.components.dataloader import DataloaderExhaustedError
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.config import JobConfig
from torchtitan.distributed import utils as dist_utils
from torchtitan.tools.logging import logger
from torchtitan.tools.profiling import maybe_enable_memory_snapshot, maybe_enable_profiling
from torchtitan.train import Trainer

from mhar_titan import titan_compat
from mhar_titan.components import fingerprint, run_checks
from mhar_titan.components.bad_steps import BadSteps
from mhar_titan.components.checkpoint import layout, space, testing
from mhar_titan.components.checkpoint.manager import CPTCheckpointManager
from mhar_titan.components.ema import WeightEMA
from mhar_titan.components.preemption import PreemptionWatch
from mhar_titan.components.routing_stats import average_routing_stats, stats_due
from mhar_titan.components.run_lock import lock_lost
from mhar_titan.components.spikes import RunSpikes
from mhar_titan.components.step_log import StepLog
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
from mhar_titan.components.step_phases import StepPhases
from mhar_titan.components.validate import run_validation
from mhar_titan.run_folder import RunFolder

EMA_STATE = "ema"


class CPTTrainer(RunFolder, Trainer):
    """torchtitan's Trainer with the recipe's state and checks: weight EMA, fixed-set validation of the
    raw and EMA weights, skipped non-finite steps, and per-step metrics (loss parts, LR of every
    group, data counters, routing statistics) with a readable log line."""

    def __init__(self, job_config: JobConfig):
        titan_compat.use_checkpoint_manager(CPTCheckpointManager)
        try:
            super().__init__(job_config)
            self._set_up(job_config)
            ckpt = self.checkpointer  # the run checked before anything of it is touched
            steps, folder, needed = ckpt.all_steps(), ckpt.folder, ckpt.expected_bytes
            self.changes = run_checks.check_resume(job_config, self.fingerprint, steps, folder, needed)
            ckpt.copy_down(job_config.checkpoint.load_step)  # a step kept only on the store, before any work
        except BaseException:
            if hasattr(self, "metrics_processor"):
                discard_tensorboard_run(self.metrics_processor)  # no stray tb/<timestamp> of a refused job
            self.close()
            raise

    def _set_up(self, job_config: JobConfig) -> None:
        ema = job_config.ema
        self.ema = WeightEMA(self.model_parts[0], ema.beta, ema.every) if ema.enable else None
        if self.ema is not None:
            self.checkpointer.states[EMA_STATE] = self.ema
        self.bad_steps = BadSteps(job_config.training.max_bad_steps)
        self.tokens_seen = 0  # all ranks' tokens
        self.clock = StepClock()
        self.phases = StepPhases(self.device)
        self.readback, self.scalars = StepReadback(self.device), StepScalars()
        self.step_log = StepLog(self.metrics_processor, job_config, self.device, self.model_args.n_layers,
                                self.dataloader, self.clock, self.phases)  # fmt: skip
        self.model_parts[0].register_forward_hook(self._after_forward)
        self.preemption = PreemptionWatch(job_config.job.dump_folder)
        self.spikes = RunSpikes(job_config.spikes, job_config.job.dump_folder, torch.distributed.get_rank() == 0,
                                logger.warning, lambda: layout.complete_steps(self.checkpointer.folder))  # fmt: skip
        self.checkpointer.kept_steps = self.spikes.kept
        self.stop_reason: str | None = None
        self.exhausted = False  # with [data] on_source_exhausted = "stop", a source was read to its end
        self._asked: str | None = None
        if torch.distributed.get_rank() == 0:
            self.preemption.clear_stale_marker()
        # Every rank counts the tokens of all ranks: each takes local_batch_size x seq_len per microbatch.
        self.dp_mesh = self.parallel_dims.get_mesh("batch") if self.parallel_dims.dp_enabled else None
        self.dp_group = None if self.dp_mesh is None else self.dp_mesh.get_group()
        self.dp_degree = 1 if self.dp_mesh is None else self.dp_mesh.size()
        batch = job_config.training.local_batch_size * self.dp_degree * self.gradient_accumulation_steps  # global
        data = self.dataloader
        self.fingerprint = fingerprint.fingerprint(job_config, self.model_args, data.shards, batch, data.contents())
        self.checkpointer.expected_bytes = space.checkpoint_bytes(self.model_parts[0], ema.enable)

    # -- the loop -----------------------------------------------------------------------------

    @record
    def train(self) -> None:
        """Forked from torchtitan 0.2.2 torchtitan/train.py, Trainer.train: the run checks and step-0
        validation before the loop, and preemption, EMA, checkpoints and every stop decision inside it."""
        cfg = self.job_config
        self._start()
        where = {"global_step": self.step, "base_folder": cfg.job.dump_folder}
        with (
            maybe_enable_profiling(cfg.profiling, **where) as profiler,
            maybe_enable_memory_snapshot(cfg.profiling, **where) as memory,
        ):
            data_iterator = self.batch_generator(self.dataloader)
            testing.inject_resume_fault(self, data_iterator)  # only where a test sets MHAR_TEST_RESUME_FAULT
            first = True
            while self.should_continue_training():
                self.step += 1
                self.gc_handler.run(self.step)
                try:
                    self.train_step(data_iterator)
                except DataloaderExhaustedError:
                    logger.warning("Ran out of data; last step was canceled.")
                    break
                self._save_and_validate()
                short = self.step < cfg.training.steps
                if self.bad_steps.too_many():
                    self.checkpointer.save_now(self.step)
                    raise self.bad_steps.stop_error(self.step)
                if short and self.stop_reason:
                    self._stop_for_requeue(self.stop_reason)
                if short and self.exhausted:
                    self.checkpointer.save_now(self.step)
                    raise self._exhausted_exit(self._exhausted_sources(), again=False)
                for tracer in filter(None, (profiler, memory)):
                    tracer.step()
                if first:  # compile and lazy init are done: shorter timeouts for a faster signal
                    timeout = timedelta(seconds=cfg.comm.train_timeout_seconds)
                    dist_utils.set_pg_timeouts(timeout=timeout, parallel_dims=self.parallel_dims)
                    first = False
        # Every rank done with its collectives before any tears down (a rank leaving early can abort a peer in one);
        # no 2 s sleep on rank 0 as in torchtitan's loop: under torchrun the agent, not rank 0, hosts the store.
        torch.distributed.barrier()
        logger.info("Training completed")

    def _start(self) -> None:
        """The load, one TensorBoard run, the run's record, the EMA's start and the step-0 validation."""
        cfg = self.job_config
        self.checkpointer.load(step=cfg.checkpoint.load_step)
        tb = os.path.join(cfg.job.dump_folder, cfg.metrics.save_tb_folder)
        one_tensorboard_run(self.metrics_processor, tb, self.step)
        self._record_run(self.changes)
        if self.ema is not None:
            self.ema.start()  # after the load: a restored EMA stays, otherwise it starts from the loaded weights
        self.spikes.start(self.step)
        if cfg.validation.enable and cfg.validation.at_start and self.step == 0:
            self.validate()  # the base, before any update (a resume does not repeat it): each arm's reference
        logger.info(f"Training starts at step {self.step + 1}")
        self.clock.start(self.step, cfg.training.steps)

    def _save_and_validate(self) -> None:
        cfg = self.job_config
        began = time.perf_counter()
        self.checkpointer.save(self.step, last_step=(self.step == cfg.training.steps))
        if cfg.checkpoint.enable and self.step % cfg.checkpoint.interval == 0:  # its time goes into the ETA
            self.clock.pause(time.perf_counter() - began, "checkpoint", cfg.checkpoint.interval)
        if cfg.validation.enable and self.validator.should_validate(self.step):
            self.validate()

    def train_step(self, data_iterator) -> None:
        """Forked from torchtitan 0.2.2 torchtitan/train.py, Trainer.train_step: global token counts, a
        bad step (non-finite loss or norm, agreed by every rank) skipped rather than applied."""
        self.optimizers.zero_grad()
        self.phases.mark("fetch")
        batch_from = self.dataloader.batches
        microbatches = [next(data_iterator) for _ in range(self.gradient_accumulation_steps)]
        self.phases.mark("data")
        self.tokens_seen += sum(labels.numel() for _, labels in microbatches) * self.dp_degree
        loss, grad_norm, flags = self._forward_backward(microbatches)
        self.readback.stage(self.scalars.pack(flags, grad_norm, *self._logged_values(loss, self.loss_fn.take_parts())))
        if self.skip_on_device:
            # The optimizer skips a bad step itself (fused AdamW's found_inf, as under a GradScaler), so it is
            # issued before the host knows the verdict: the host's reading of the step overlaps the update.
            for opt in self.optimizers.optimizers:
                opt.found_inf = flags[0]
            self.checkpointer.maybe_wait_for_staging()
            self.optimizers.step()
        v = self.scalars.unpack(self.readback.read())
        if v.lock_lost:
            raise lock_lost(self.step, self.job_config.job.dump_folder)
        self.stop_reason = (self._asked or "another rank was asked to stop") if v.stop else None
        self.exhausted = v.exhausted
        if not v.bad:
            if not self.skip_on_device:
                self.checkpointer.maybe_wait_for_staging()
                self.optimizers.step()
            if self.ema is not None:
                self.ema.update(self.step)
            self.bad_steps.applied()
            if marks := self.spikes.observe(self.step, v.loss, v.grad_norm):
                log_scalars(self.metrics_processor.logger, marks, self.step)
        else:
            self.optimizers.zero_grad()
            batches = (batch_from, self.dataloader.batches)
            self.bad_steps.skip(self.step, loss.item(), v.grad_norm, batches, self.dp_group)
        self.phases.mark("optimizer")
        applied = {g["name"]: g["lr"] for g in self.optimizers.optimizers[0].param_groups}  # this step's LR
        self.lr_schedulers.step()  # the schedule follows the step count, applied or not
        self.step_log.write(self.step, v, applied, self.tokens_seen, self.bad_steps.skipped, self.spikes.metrics())

    def _forward_backward(self, microbatches: list) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This rank's share of the global mean loss, the clipped gradient norm, and the step's agreed flags."""
        dev = self.device
        local_tokens = to_device_nowait(sum((labels != IGNORE_INDEX).sum() for _, labels in microbatches), dev)
        global_tokens = local_tokens.clone()  # summed on the device (torchtitan's dist_sum reads it back: a sync)
        if self.dp_group is not None:
            torch.distributed.all_reduce(global_tokens, group=self.dp_group)
        self._collect_routing_stats(stats_due(self.job_config.mhar, self.step))
        losses = []
        for input_dict, labels in microbatches:
            input_dict = {k: to_device_nowait(v, dev) if torch.is_tensor(v) else v for k, v in input_dict.items()}
            loss = self.forward_backward_step(
                input_dict=input_dict, labels=to_device_nowait(labels, dev), global_valid_tokens=global_tokens
            )
            losses.append(loss.detach())
        self._collect_routing_stats(False)
        self.phases.mark("backward")
        params = [p for m in self.model_parts for p in m.parameters()]
        grad_norm = dist_utils.clip_grad_norm_(params, self.job_config.training.max_norm, foreach=True, pp_mesh=None,
                                               ep_enabled=self.parallel_dims.ep_enabled)  # fmt: skip
        loss = torch.stack(losses).sum()
        return loss, grad_norm, self._agree(loss, grad_norm, loss * global_tokens / local_tokens)

    @property
    def skip_on_device(self) -> bool:
        """Every optimizer can skip a step on the device (fused Adam and AdamW honour `found_inf`; foreach can't)."""
        return all(getattr(opt, "_step_supports_amp_scaling", False) for opt in self.optimizers.optimizers)

    def _after_forward(self, *_) -> None:
        if torch.is_grad_enabled():  # a training forward, not validation
            self.phases.mark("forward")

    def _agree(self, loss: torch.Tensor, grad_norm: torch.Tensor, own_mean: torch.Tensor) -> torch.Tensor:
        """The step's FLAGS (components/step_metrics.py), agreed by one MAX all-reduce on the device: any rank's
        loss or gradient norm non-finite, any rank asked to stop (a signal, or the STOP file, which rank 0 alone
        looks for), the largest rank's own mean loss, the run lock lost (rank 0 holds it), a mixture source read
        to its end under on_source_exhausted = "stop"."""
        self._asked = self.preemption.local_request(check_file=torch.distributed.get_rank() == 0)
        out = self.job_config.data.on_source_exhausted == "stop" and bool(self.dataloader.exhausted())
        lost = self.run_lock is not None and self.run_lock.lost
        bad = ~torch.isfinite(loss) | ~torch.isfinite(grad_norm)
        flags = StepScalars.flags(loss, bad=bad, stop=self._asked is not None, loss_max=own_mean, lock_lost=lost,
                                  exhausted=out)  # fmt: skip
        if torch.distributed.get_world_size() > 1:
            torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
        return flags

    def _logged_values(self, loss: torch.Tensor, parts: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        """(the loss and its parts summed over the data-parallel ranks, on log steps: [loss, ce, z-term, tokens]
        or [loss]; the routing statistics averaged over them, on their steps), on the device, else None."""
        sums = stats = None
        if self.metrics_processor.should_log(self.step) or self.spikes.enabled:  # spikes: every step's loss
            sums = loss.double().reshape(1) if parts is None else torch.cat([loss.double().reshape(1), parts.double()])
            if self.dp_group is not None:
                torch.distributed.all_reduce(sums, group=self.dp_group)
        if stats_due(self.job_config.mhar, self.step) and self.model_parts[0].routing_stats is not None:
            stats = average_routing_stats(self.model_parts[0].routing_stats, self.dp_mesh)
        return sums, stats

    def _collect_routing_stats(self, on: bool) -> None:
        """Ask the model for its routing statistics on this step's forwards (log steps only)."""
        if self.job_config.mhar.enable:
            self.model_parts[0].collect_routing_stats = on

    def validate(self) -> None:
        """Every validation set with the raw and EMA weights to TensorBoard and, on rank 0, every batch's CE to
        validation/step-N.json; its time is left out of the training throughput and counted in the ETA."""
        self.optimizers.zero_grad()  # the last step's gradients are not read again: validation gets their memory
        self.checkpointer.maybe_wait_for_staging()  # a background save still copying the weights the EMA swaps
        began = time.perf_counter()
        folder = os.path.join(self.job_config.job.dump_folder, "validation")
        record = folder if torch.distributed.get_rank() == 0 else None
        metrics = run_validation(self.validator, self.model_parts, self.step, self.ema, record)
        log_scalars(self.metrics_processor.logger, metrics, self.step)
        flush(self.metrics_processor)
        spent = time.perf_counter() - began
        titan_compat.leave_out_of_log_window(self.metrics_processor, spent)
        self.clock.pause(spent, "validation", self.job_config.validation.freq)
        logger.info(f"validation at step {self.step}: " + "  ".join(f"{k} {v:.4f}" for k, v in metrics.items()))

    # -- checkpointed trainer state -------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        # ntokens_seen: all ranks' tokens (torchtitan keeps one rank's), so it survives a change of rank count.
        state = {"step": self.step, "ntokens_seen": self.tokens_seen, "skipped_steps": self.bad_steps.skipped}
        return {**state, **self.spikes.state()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.tokens_seen = int(state_dict["ntokens_seen"])
        self.bad_steps.skipped = int(state_dict.get("skipped_steps", 0))
        self.spikes.load(state_dict)
