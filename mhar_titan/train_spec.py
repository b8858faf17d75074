"""The project's torchtitan train spec and its model flavors, and the job's hooks.

One spec for both arms of the pair: the control and the MHAR run train the
same code and differ only in their config.
"""

from __future__ import annotations

import copy

from torchtitan.components.tokenizer import build_hf_tokenizer
from torchtitan.config import JobConfig
from torchtitan.protocols.train_spec import TrainSpec, get_train_spec, register_train_spec

from data.loader import build_parquet_dataloader
from mhar_titan.components.alerts import Alerts
from mhar_titan.components.bad_steps import BadSteps
from mhar_titan.components.checkpoint import testing
from mhar_titan.components.clock_checkpoints import ClockCheckpoints
from mhar_titan.components.compute_clock import ComputeClock
from mhar_titan.components.data_progress import DataProgress
from mhar_titan.components.ema import EMA
from mhar_titan.components.hooks import Hook
from mhar_titan.components.loss import build_loss_fn
from mhar_titan.components.lr_schedule import build_lr_schedulers
from mhar_titan.components.optimizer import build_optimizers
from mhar_titan.components.param_norms import ParameterNorms
from mhar_titan.components.preemption import Preemption
from mhar_titan.components.rank_timing import RankTiming
from mhar_titan.components.routing_stats import RoutingStatistics
from mhar_titan.components.run_folder import RunFolder, RunFolderLock
from mhar_titan.components.run_spikes import RunSpikes
from mhar_titan.components.step_log import StepLog
from mhar_titan.components.step_phases import TimeShares
from mhar_titan.components.validate import Validation, build_fixed_set_validator
from mhar_titan.components.watchdog import Watchdog
from mhar_titan.config import MODEL_NAME
from mhar_titan.hf.ledger import LedgerStateDictAdapter
from mhar_titan.model.args import FLAVORS
from mhar_titan.model.model import MHARTransformer
from mhar_titan.model.parallelize import parallelize


def build_train_spec() -> TrainSpec:
    return TrainSpec(
        model_cls=MHARTransformer,
        model_args=copy.deepcopy(FLAVORS),  # the trainer and cpu.py mutate them
        parallelize_fn=parallelize,
        pipelining_fn=None,  # MHAR sources span the whole depth: no pipeline stages
        build_optimizers_fn=build_optimizers,
        build_lr_schedulers_fn=build_lr_schedulers,
        build_dataloader_fn=build_parquet_dataloader,
        build_tokenizer_fn=build_hf_tokenizer,
        build_loss_fn=build_loss_fn,
        build_validator_fn=build_fixed_set_validator,
        state_dict_adapter=LedgerStateDictAdapter,  # the model's, with the HF load's ledger
    )


def train_spec() -> TrainSpec:
    """The registered spec (registering it on first use)."""
    try:
        return get_train_spec(MODEL_NAME)
    except ValueError:
        register_train_spec(MODEL_NAME, build_train_spec())
        return get_train_spec(MODEL_NAME)


def build_hooks(job_config: JobConfig) -> list[Hook]:
    """The concerns the trainer hosts, in the order it calls them at every phase: the run lock first (a job that lost
    its folder writes nothing more there), the watchdog next; the stops in their precedence (non-finite steps,
    preemption, a source read to its end) and the clock's checkpoint after them, the data's check before a resume is
    recorded; validation after the EMA it swaps in; the log line's parts in the line's order; test seams last."""
    ema = EMA(job_config.ema)
    saving = job_config.checkpoint
    clock = [ClockCheckpoints(saving.interval_minutes)] if saving.enable and saving.interval_minutes > 0 else []
    watch, alert = job_config.watchdog, job_config.alerts
    watchdog = [Watchdog(watch.floor_s, watch.factor, watch.first_step_s)] if watch.enable else []
    spikes = RunSpikes(job_config.spikes)
    alerts = [Alerts(alert.webhook, alert.events, spikes)] if alert.webhook else []
    if watchdog and alerts:
        watchdog[0].on_hang.append(alerts[0].hung)
    hooks = [
        RunFolderLock(),
        *watchdog,
        ema,
        BadSteps(job_config.training.max_bad_steps),
        spikes,
        Preemption(),
        DataProgress(),
        *clock,  # after the stops: a stop's checkpoint comes first
        RunFolder(),
        RoutingStatistics(job_config.mhar),
        ParameterNorms(job_config.norms.freq),
        Validation(ema),
        StepLog(),
        TimeShares(),
        ComputeClock(),
        RankTiming(job_config.stragglers.share, job_config.stragglers.windows),
        *alerts,  # after the spikes it reports
    ]
    if fault := testing.resume_fault():
        hooks.append(testing.ResumeFault(fault))
    if hangs := testing.hangs():
        hooks.append(testing.Hang(hangs))
    if crashes := testing.crashes():
        hooks.append(testing.Crash(crashes))
    if slow := testing.slow_rank():
        hooks.append(testing.SlowRank(*slow))
    return hooks
