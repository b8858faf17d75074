"""The job's entry, as torchtitan.train.main: parse the config, build the trainer, train (or write a seed
checkpoint), tear down; bad input found before any work is one error line and exit 2."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence

import torch
from torchtitan.tools.logging import init_logger, logger

from mhar_titan import cpu
from mhar_titan.components import endings, run_record
from mhar_titan.components.exit_codes import REFUSED as REFUSED_EXIT_CODE
from mhar_titan.components.hooks import Hook
from mhar_titan.components.run_lock import LockHeld, LockLost
from mhar_titan.config import parse_config
from mhar_titan.train_spec import build_hooks, train_spec
from mhar_titan.trainer import CPTTrainer


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


def _ended(trainer: CPTTrainer, code: int, cause: str) -> None:
    if trainer.job_config.checkpoint.create_seed_checkpoint or torch.distributed.get_rank() != 0:
        return
    endings.record_ending(trainer.job_config.job.dump_folder, code, trainer.step, cause)


def run(argv: list[str], trainer_cls: type[CPTTrainer] = CPTTrainer, hooks: Sequence[Hook] = ()) -> None:
    """Parse, train, and tear down, as torchtitan.train.main does for its Trainer; `hooks` come after the job's own
    (train_spec.build_hooks), in their order (docs/extending.md)."""
    init_logger()
    with refusals():
        config = parse_config(argv)
        job_hooks = [*build_hooks(config), *hooks]
    spec = train_spec()  # registered here, where torchtitan's Trainer will look it up
    if cpu.should_activate():
        cpu.activate([spec])
    trainer: CPTTrainer | None = None
    try:
        with refusals():
            trainer = trainer_cls(config, job_hooks)
        if config.checkpoint.create_seed_checkpoint:
            if torch.distributed.get_world_size() != 1:
                raise ValueError("checkpoint.create_seed_checkpoint needs a single process")
            if not config.checkpoint.enable:
                raise ValueError("checkpoint.create_seed_checkpoint needs checkpoint.enable = true")
            trainer.checkpointer.save(curr_step=0, last_step=True)
            # A seed is weights to start from, not a run: no fingerprint; the job that trains it records one
            # (and compares its architecture with this).
            run_record.write_model_args(config, trainer.model_args)
            logger.info("Created seed checkpoint")
        else:
            trainer.train()
            _ended(trainer, 0, "finished its steps")
    except SystemExit as e:  # a chosen end (a preemption, a source run out, a hook's stop), once the run is ours
        if trainer is not None and isinstance(e.code, int) and not isinstance(e, LockLost):
            _ended(trainer, e.code, type(e).__name__)
        raise
    except Exception as e:  # a crash: said where, for the launcher
        if trainer is not None:
            endings.record_crash(config.job.dump_folder, torch.distributed.get_rank(), trainer.step, e)
        raise
    finally:
        if trainer is not None:
            trainer.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
