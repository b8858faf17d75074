"""The project's Trainer: torchtitan's, plus the state and metrics the recipe adds."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
import torchtitan.train as titan_train
from torch.distributed.elastic.multiprocessing.errors import record
from torchtitan.components.dataloader import DataloaderExhaustedError
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.config import JobConfig
from torchtitan.distributed import utils as dist_utils
from torchtitan.tools.logging import init_logger, logger
from torchtitan.tools.profiling import maybe_enable_memory_snapshot, maybe_enable_profiling
from torchtitan.train import Trainer

from data.loader import gather_counters, mixture_shares, token_shares
from mhar_titan import cpu
from mhar_titan.components import fingerprint, run_checks, run_record
from mhar_titan.components.checkpoint import CPTCheckpointManager
from mhar_titan.components.ema import WeightEMA
from mhar_titan.components.preemption import PreemptionWatch
from mhar_titan.components.routing_stats import average_routing_stats, name_routing_stats
from mhar_titan.components.run_lock import LOCK_FILE, LockHeld
from mhar_titan.components.step_metrics import (
    MemoryPhases,
    StepClock,
    StepReadback,
    discard_tensorboard_run,
    flush,
    log_scalars,
    one_tensorboard_run,
    rank_peaks,
    throughput,
    to_device_nowait,
)
from mhar_titan.components.tensorboard_scalars import PRIMARY_TAGS, set_tags
from mhar_titan.components.validate import write_validation_batches
from mhar_titan.config import parse_config
from mhar_titan.run_folder import RunFolder
from mhar_titan.train_spec import train_spec

EMA_STATE = "ema"
REFUSED_EXIT_CODE = 2  # bad input, found before any work


class CPTTrainer(RunFolder, Trainer):
    """torchtitan's Trainer with the recipe's state and checks: weight EMA, fixed-set validation of the
    raw and EMA weights, skipped non-finite steps, and per-step metrics (loss parts, LR of every
    group, data counters, routing statistics) with a readable log line."""

    def __init__(self, job_config: JobConfig):
        # torchtitan's Trainer builds its checkpointer from this module global.
        titan_train.CheckpointManager = CPTCheckpointManager
        try:
            super().__init__(job_config)
            self._set_up(job_config)
            self.changes = self._check_run()  # before anything of the run's is touched
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
        self.bad_steps_in_a_row = 0
        self.skipped_steps = 0
        self.tokens_seen = 0  # all ranks' tokens
        self.clock = StepClock()
        self.memory_phases = MemoryPhases(self.device)
        self.readback = StepReadback(self.device)
        self.model_parts[0].register_forward_hook(self._after_forward)
        self.preemption = PreemptionWatch(job_config.job.dump_folder)
        self.stop_reason: str | None = None
        self.exhausted = False  # with [data] on_source_exhausted = "stop", a source was read to its end
        self._asked: str | None = None
        if torch.distributed.get_rank() == 0:
            self.preemption.clear_stale_marker()
        # Every rank counts the tokens of all ranks: each takes local_batch_size x seq_len per microbatch.
        self.dp_degree = self._batch_mesh().size() if self.parallel_dims.dp_enabled else 1
        t = job_config.training
        global_batch = t.local_batch_size * self.dp_degree * self.gradient_accumulation_steps
        self.fingerprint = fingerprint.fingerprint(
            job_config, self.model_args, self.dataloader.shards, global_batch, self.dataloader.contents()
        )
        self.checkpointer.expected_bytes = run_checks.checkpoint_bytes(self.model_parts[0], ema.enable)

    # -- the loop -----------------------------------------------------------------------------

    @record
    def train(self) -> None:
        """Forked from torchtitan 0.2.2 torchtitan/train.py, Trainer.train: the run checks and step-0
        validation before the loop, and preemption, EMA and checkpoint handling inside it."""
        cfg = self.job_config
        self.checkpointer.load(step=cfg.checkpoint.load_step)
        one_tensorboard_run(
            self.metrics_processor, os.path.join(cfg.job.dump_folder, cfg.metrics.save_tb_folder), self.step
        )
        self._record_run(self.changes)
        if self.ema is not None:
            self.ema.start()  # after the load: a restored EMA stays, otherwise it starts from the loaded weights
        if cfg.validation.enable and cfg.validation.at_start and self.step == 0:
            self.validate()  # the base, before any update (a resume does not repeat it): each arm's reference
        logger.info(f"Training starts at step {self.step + 1}")
        self.clock.start(self.step, cfg.training.steps)
        where = {"global_step": self.step, "base_folder": cfg.job.dump_folder}
        with (
            maybe_enable_profiling(cfg.profiling, **where) as profiler,
            maybe_enable_memory_snapshot(cfg.profiling, **where) as memory,
        ):
            data_iterator = self.batch_generator(self.dataloader)
            first = True
            while self.should_continue_training():
                self.step += 1
                self.gc_handler.run(self.step)
                try:
                    self.train_step(data_iterator)
                except DataloaderExhaustedError:
                    logger.warning("Ran out of data; last step was canceled.")
                    break
                began = time.perf_counter()
                self.checkpointer.save(self.step, last_step=(self.step == cfg.training.steps))
                if cfg.checkpoint.enable and self.step % cfg.checkpoint.interval == 0:  # its time goes into the ETA
                    self.clock.pause(time.perf_counter() - began, "checkpoint", cfg.checkpoint.interval)
                if cfg.validation.enable and self.validator.should_validate(self.step):
                    self.validate()
                if self.bad_steps_in_a_row >= cfg.training.max_bad_steps:
                    self.checkpointer.save_now(self.step)
                    raise RuntimeError(
                        f"step {self.step}: {self.bad_steps_in_a_row} non-finite steps in a row "
                        f"(training.max_bad_steps = {cfg.training.max_bad_steps}); stopped with a checkpoint "
                        "of the last good weights, optimizer and EMA (the data order has moved past the bad batches)"
                    )
                if self.step < cfg.training.steps and self.stop_reason:
                    self._stop_for_requeue(self.stop_reason)
                if self.exhausted and self.step < cfg.training.steps:
                    self.checkpointer.save_now(self.step)
                    raise self._exhausted_exit(self._exhausted_sources(), again=False)
                if profiler:
                    profiler.step()
                if memory:
                    memory.step()
                if first:  # compile and lazy init are done: shorter timeouts for a faster signal
                    dist_utils.set_pg_timeouts(
                        timeout=timedelta(seconds=cfg.comm.train_timeout_seconds), parallel_dims=self.parallel_dims
                    )
                    first = False
        # Every rank done with its collectives before any tears down, and rank 0 last out, as in
        # torchtitan's loop: a rank leaving early can abort a peer still closing its gloo pairs.
        torch.distributed.barrier()
        if torch.distributed.get_rank() == 0:
            time.sleep(2)
        logger.info("Training completed")

    def train_step(self, data_iterator) -> None:
        """Forked from torchtitan 0.2.2 torchtitan/train.py, Trainer.train_step: global token counts, a
        bad step (non-finite loss or norm, agreed by every rank) skipped rather than applied."""
        self.optimizers.zero_grad()
        batch_from = self.dataloader.batches
        microbatches = [next(data_iterator) for _ in range(self.gradient_accumulation_steps)]
        self.tokens_seen += sum(labels.numel() for _, labels in microbatches) * self.dp_degree
        dev = self.device
        local_tokens = to_device_nowait(sum((labels != IGNORE_INDEX).sum() for _, labels in microbatches), dev)
        global_tokens = local_tokens.clone()  # summed on the device (torchtitan's dist_sum reads it back: a sync)
        if self.parallel_dims.dp_enabled:
            torch.distributed.all_reduce(global_tokens, group=self._batch_mesh().get_group())
        self._collect_routing_stats(self._routing_stats_due())
        losses = []
        for input_dict, labels in microbatches:
            input_dict = {k: to_device_nowait(v, dev) if torch.is_tensor(v) else v for k, v in input_dict.items()}
            loss = self.forward_backward_step(
                input_dict=input_dict, labels=to_device_nowait(labels, dev), global_valid_tokens=global_tokens
            )
            losses.append(loss.detach())
        self._collect_routing_stats(False)
        self.memory_phases.mark("backward")
        grad_norm = dist_utils.clip_grad_norm_(
            [p for m in self.model_parts for p in m.parameters()],
            self.job_config.training.max_norm,
            foreach=True,
            pp_mesh=None,
            ep_enabled=self.parallel_dims.ep_enabled,
        )
        loss = torch.stack(losses).sum()  # this rank's share of the global mean
        flags = self._agree(loss, grad_norm, loss * global_tokens / local_tokens)
        logged, n_loss = self._logged_values(loss, self.loss_fn.take_parts())
        self.readback.stage(torch.cat([flags.double(), grad_norm.detach().double().reshape(1), logged]))
        if self.skip_on_device:
            # The optimizer skips a bad step itself (fused AdamW's found_inf, as under a GradScaler), so it is
            # issued before the host knows the verdict: the host's reading of the step overlaps the update.
            for opt in self.optimizers.optimizers:
                opt.found_inf = flags[0]
            self.checkpointer.maybe_wait_for_staging()
            self.optimizers.step()
        bad_any, stop_any, loss_max, lost_any, out_any, norm, *values = self.readback.read()
        if lost_any:
            raise RuntimeError(
                f"step {self.step}: {os.path.join(self.job_config.job.dump_folder, LOCK_FILE)} was taken over by "
                "another job (this job's heartbeat had stalled past [job] run_lock_stale_s); stopping without "
                "writing anything more to the run folder"
            )
        self.stop_reason = (self._asked or "another rank was asked to stop") if stop_any else None
        self.exhausted = bool(out_any)
        if not bad_any:
            if not self.skip_on_device:
                self.checkpointer.maybe_wait_for_staging()
                self.optimizers.step()
            if self.ema is not None:
                self.ema.update(self.step)
            self.bad_steps_in_a_row = 0
        else:
            self.optimizers.zero_grad()
            self._report_bad_step(loss, norm, batch_from)
        self.memory_phases.mark("optimizer")
        applied = {g["name"]: g["lr"] for g in self.optimizers.optimizers[0].param_groups}  # this step's LR
        self.lr_schedulers.step()  # the schedule follows the step count, applied or not
        self._log_step(norm, loss_max, values[:n_loss], values[n_loss:], applied)

    @property
    def skip_on_device(self) -> bool:
        """Every optimizer can skip a step on the device (torch's fused Adam and AdamW honour
        `found_inf`); the foreach and for-loop implementations need the host's decision first."""
        return all(getattr(opt, "_step_supports_amp_scaling", False) for opt in self.optimizers.optimizers)

    def _after_forward(self, *_) -> None:
        if torch.is_grad_enabled():  # a training forward, not validation
            self.memory_phases.mark("forward")

    def _batch_mesh(self):
        return self.parallel_dims.get_mesh("batch")

    def _agree(self, loss: torch.Tensor, grad_norm: torch.Tensor, own_mean: torch.Tensor) -> torch.Tensor:
        """[any rank's loss or the gradient norm non-finite, any rank asked to stop (a signal, or the
        STOP file, which rank 0 alone looks for), the largest rank's own mean loss, the run lock lost
        (rank 0 holds it), a mixture source read to its end under on_source_exhausted = "stop"], on the
        device, by one MAX all-reduce a step; built there (new_full: no host copy, which would wait for the GPU)."""
        self._asked = self.preemption.local_request(check_file=torch.distributed.get_rank() == 0)
        bad = ~torch.isfinite(loss) | ~torch.isfinite(grad_norm)
        asked = loss.new_full((), float(self._asked is not None))
        lost = loss.new_full((), float(self.run_lock is not None and self.run_lock.lost))
        out = self.job_config.data.on_source_exhausted == "stop" and bool(self.dataloader.exhausted())
        flags = torch.stack([bad.float(), asked, own_mean.float(), lost, loss.new_full((), float(out))])
        if torch.distributed.get_world_size() > 1:
            torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
        return flags

    def _logged_values(self, loss: torch.Tensor, parts: torch.Tensor | None) -> tuple[torch.Tensor, int]:
        """On log steps, the loss and its parts summed over the data-parallel ranks ([loss, ce, z-term,
        tokens], or [loss]); on routing-statistics steps, then the statistics averaged over them; on
        the device, with the number of loss values."""
        values = [loss.new_zeros(0, dtype=torch.float64)]  # nothing, on steps that log nothing
        mesh = self._batch_mesh() if self.parallel_dims.dp_enabled else None
        if self.metrics_processor.should_log(self.step):
            sums = loss.double().reshape(1) if parts is None else torch.cat([loss.double().reshape(1), parts.double()])
            if mesh is not None:
                torch.distributed.all_reduce(sums, group=mesh.get_group())
            values.append(sums)
        n_loss = values[-1].numel()
        stats = self.model_parts[0].routing_stats if self._routing_stats_due() else None
        if stats is not None:
            values.append(average_routing_stats(stats, mesh).double().flatten())
        return torch.cat(values), n_loss

    def _routing_stats_due(self) -> bool:
        """At step 1 (as torchtitan's metrics) and every `stats_freq` steps: charts start at the start."""
        mhar = self.job_config.mhar
        return mhar.enable and mhar.stats_freq > 0 and (self.step == 1 or self.step % mhar.stats_freq == 0)

    def _collect_routing_stats(self, on: bool) -> None:
        """Ask the model for its routing statistics on this step's forwards (log steps only)."""
        if self.job_config.mhar.enable:
            self.model_parts[0].collect_routing_stats = on

    def _report_bad_step(self, loss: torch.Tensor, grad_norm: torch.Tensor, batch_from: int) -> None:
        self.bad_steps_in_a_row += 1
        self.skipped_steps += 1
        where = {"loss": loss.item(), "batches": (batch_from, self.dataloader.batches)}
        everyone = [where]
        if self.parallel_dims.dp_enabled:
            everyone = [None] * self._batch_mesh().size()
            torch.distributed.all_gather_object(everyone, where, group=self._batch_mesh().get_group())
        ranks = "; ".join(
            f"rank {r}: loss share {w['loss']:.4g}, loader batches {w['batches'][0]}..{w['batches'][1] - 1}"
            for r, w in enumerate(everyone)
        )
        logger.warning(
            f"step {self.step}: non-finite loss or gradient (grad norm {float(grad_norm):.4g}); step skipped "
            f"({self.bad_steps_in_a_row} in a row, {self.skipped_steps} in all). {ranks}"
        )

    def _log_step(
        self, grad_norm: float, loss_max: float, loss_values: list[float], stats: list[float], lrs: dict[str, float]
    ) -> None:
        """TensorBoard scalars and one readable line, at every log step, from the step's values read
        back from the device (`_logged_values`); the routing statistics on their steps."""
        self.clock.tick(self.step)
        if loss_values:
            self._write_metrics(loss_values[0], loss_max, grad_norm, loss_values[1:], lrs)
        if stats:
            named = name_routing_stats(torch.tensor(stats).reshape(self.model_args.n_layers, 2, -1))
            log_scalars(self.metrics_processor.logger, named, self.step)

    def _write_metrics(
        self, loss_v: float, loss_max: float, grad_norm: float, part_sums: list[float], lrs: dict[str, float]
    ) -> None:
        """`lrs`: each group's LR as the step applied it (the scheduler has moved on since)."""
        mp = self.metrics_processor
        counters = gather_counters(self.dataloader)
        metrics = {f"data/{k}": v for k, v in counters.items()}
        metrics.update({**mixture_shares(counters), **token_shares(counters)})
        metrics.update(
            {
                "train/loss": loss_v,
                "train/loss_max": loss_max,
                "grad_norm": grad_norm,
                "tokens_seen": self.tokens_seen,
                "train/skipped_steps": self.skipped_steps,
            }
        )
        if part_sums:  # CE and z-loss of this step, per valid token over all ranks
            ce, z, tokens = part_sums
            metrics.update({"train/ce": ce / tokens, "train/z_loss": z / tokens})
        metrics.update({f"lr/{name}": lr for name, lr in lrs.items()})
        metrics.update(throughput(mp))
        metrics.update(rank_peaks(metrics["memory/peak_active_gib"], self.device))
        metrics.update(self.memory_phases.take())
        log_scalars(mp.logger, metrics, self.step)
        flush(mp)
        logger.info(
            f"step {self.step}/{self.job_config.training.steps}  loss {loss_v:.4f}"
            + (f" (ce {metrics['train/ce']:.4f})" if part_sums else "")
            + f"  lr {next(iter(lrs.values())):.2e}  grad_norm {grad_norm:.3f}"
            f"  {metrics['tokens_per_s']:,.0f} tok/s/dev  {self.clock.pace(self.tokens_seen)}"
            f"  mfu {metrics['mfu']:.1f}%  mem {metrics['memory/peak_reserved_gib']:.1f} GiB  eta {self.clock.eta()}"
        )

    def validate(self) -> None:
        """Per validation set val/<name>/ce and val/<name>/ce_ema to TensorBoard (the first set also as val/ce
        and val/ce_ema); every batch's CE to validation/step-N.json for paired comparison."""
        began = time.perf_counter()
        values = {"raw": self.validator.validate(self.model_parts, self.step)}
        batches = {"raw": dict(self.validator.per_batch)}
        if self.ema is not None:
            with self.ema.swapped_in():
                values["ema"] = self.validator.validate(self.model_parts, self.step)
            batches["ema"] = dict(self.validator.per_batch)
        first = self.validator.names[0]
        metrics = {PRIMARY_TAGS[kind]: v[first] for kind, v in values.items()}
        for name in self.validator.names:
            metrics.update({set_tags(name)[kind]: v[name] for kind, v in values.items()})
        log_scalars(self.metrics_processor.logger, metrics, self.step)
        flush(self.metrics_processor)
        if torch.distributed.get_rank() == 0:
            folder = os.path.join(self.job_config.job.dump_folder, "validation")
            write_validation_batches(folder, self.step, batches, self.validator.names[0])
        spent = time.perf_counter() - began
        self.metrics_processor.time_last_log += spent  # keep validation out of the training throughput
        self.clock.pause(spent, "validation", self.job_config.validation.freq)
        logger.info(f"validation at step {self.step}: " + "  ".join(f"{k} {v:.4f}" for k, v in metrics.items()))

    # -- checkpointed trainer state -------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        # ntokens_seen: all ranks' tokens (torchtitan keeps one rank's), so it survives a change of rank count.
        return {"step": self.step, "ntokens_seen": self.tokens_seen, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.tokens_seen = int(state_dict["ntokens_seen"])
        self.skipped_steps = int(state_dict.get("skipped_steps", 0))


@contextlib.contextmanager
def refusals() -> Iterator[None]:
    """Bad input found before any work (a config value, a run that is not this job's, a locked folder, a
    checkpoint folder without room): one error line, exit 2, no traceback (MHAR_TRACEBACK=1 shows it)."""
    try:
        yield
    except (ValueError, OSError, LockHeld) as e:
        if os.environ.get("MHAR_TRACEBACK"):
            raise
        logger.error(f"{type(e).__name__}: {e}")
        # torchtitan's Trainer.__init__ is wrapped by torchelastic's @record, which already wrote the
        # traceback for torchrun's failure summary: the line above says it all.
        error_file = os.environ.get("TORCHELASTIC_ERROR_FILE", "")
        if os.path.isfile(error_file):
            os.remove(error_file)
        raise SystemExit(REFUSED_EXIT_CODE) from None


def run(argv: list[str], trainer_cls: type[CPTTrainer] = CPTTrainer) -> None:
    """Parse, train, and tear down, as torchtitan.train.main does for its Trainer."""
    init_logger()
    with refusals():
        config = parse_config(argv)
    spec = train_spec()  # registered here, where torchtitan's Trainer will look it up
    if cpu.should_activate():
        cpu.activate([spec])
    trainer: CPTTrainer | None = None
    try:
        with refusals():
            trainer = trainer_cls(config)
        if config.checkpoint.create_seed_checkpoint:
            if torch.distributed.get_world_size() != 1:
                raise ValueError("checkpoint.create_seed_checkpoint needs a single process")
            if not config.checkpoint.enable:
                raise ValueError("checkpoint.create_seed_checkpoint needs checkpoint.enable = true")
            if trainer.ema is not None:
                trainer.ema.start()
            trainer.checkpointer.save(curr_step=0, last_step=True)
            # A seed is weights to start from, not a run: no fingerprint; the job that trains it records one
            # (and compares its architecture with this).
            run_record.write_model_args(config, trainer.model_args)
            logger.info("Created seed checkpoint")
        else:
            trainer.train()
    finally:
        if trainer is not None:
            trainer.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
