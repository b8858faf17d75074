"""Every reach into torchtitan 0.2.2's internals, in one place: a module global we replace, private attributes
we read, state of its metrics processor we reset. Each names the torchtitan file it depends on; `missing()`
lists those that are gone, and tests/test_titan_compat.py fails on any, so that a torchtitan upgrade breaks
loudly here instead of quietly elsewhere. (The CPU shims of mhar_titan/cpu.py and the checkpoint manager's
fork, mhar_titan/components/checkpoint/manager.py, are checked here too; they keep their own code.)
"""

from __future__ import annotations

import importlib
import inspect
import time
from typing import Any

import torchtitan.train as titan_train
from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.metrics import BaseLogger, LoggerContainer, MetricsProcessor, TensorBoardLogger

# (what we rely on, the torchtitan 0.2.2 file, where in it)
REACHES = (
    ("torchtitan.train.CheckpointManager, a module global Trainer.__init__ reads", "torchtitan/train.py", "Trainer"),
    ("LoggerContainer._loggers", "torchtitan/components/metrics.py", "LoggerContainer.__init__"),
    ("TensorBoardLogger.writer and .tag", "torchtitan/components/metrics.py", "TensorBoardLogger.__init__"),
    (
        "MetricsProcessor's log window: time_last_log, ntokens_since_last_log, data_loading_times, "
        "device_memory_monitor, num_flops_per_token, gpu_peak_flops",
        "torchtitan/components/metrics.py",
        "MetricsProcessor.__init__",
    ),
    (
        "CheckpointManager's _async_wait, _create_checkpoint_id, _flattened_model_states_sd, "
        "_purge_stale_checkpoints, purge_queue (our fork's)",
        "torchtitan/components/checkpoint.py",
        "CheckpointManager",
    ),
    ("_op_sac_save_list", "torchtitan/models/llama3/infra/parallelize.py", "module"),
    (
        "device_type and device_module bound by name (the CPU shims)",
        "torchtitan/tools/utils.py and its importers",
        "module",
    ),
    (
        "_compiled_create_block_mask, the global create_attention_mask calls (the CPU shims make it eager)",
        "torchtitan/models/attention.py",
        "module",
    ),
)
_WINDOW = (
    "time_last_log",
    "ntokens_since_last_log",
    "data_loading_times",
    "device_memory_monitor",
    "num_flops_per_token",
    "gpu_peak_flops",
)
_CHECKPOINT = ("_async_wait", "_create_checkpoint_id", "_flattened_model_states_sd", "_purge_stale_checkpoints")
# Modules that bound torchtitan.tools.utils.device_type / device_module by name (mhar_titan/cpu.py rebinds them).
DEVICE_GLOBALS = {
    "torchtitan.tools.utils": ("device_type", "device_module"),
    "torchtitan.components.metrics": ("device_type", "device_module"),
    "torchtitan.distributed.parallel_dims": ("device_type",),
    "torchtitan.distributed.utils": ("device_type", "device_module"),
    "torchtitan.tools.profiling": ("device_module",),
}

BLOCK_MASK_BUILDER = ("torchtitan.models.attention", "_compiled_create_block_mask")


def use_checkpoint_manager(cls: type[CheckpointManager]) -> None:
    """torchtitan's Trainer builds its checkpointer from torchtitan.train's module global `CheckpointManager`."""
    titan_train.CheckpointManager = cls


def each_logger(logger: BaseLogger) -> list[BaseLogger]:
    """The loggers a LoggerContainer holds (its private `_loggers`), or the logger itself."""
    return logger._loggers if isinstance(logger, LoggerContainer) else [logger]


def tensorboard_writer(lg: BaseLogger) -> Any | None:
    """The torch SummaryWriter of a TensorBoardLogger (its `writer`), else None."""
    return lg.writer if isinstance(lg, TensorBoardLogger) else None


def take_log_window(mp: MetricsProcessor) -> dict[str, Any]:
    """What the metrics processor counted since its last log (seconds, tokens, data-loading seconds, peak memory)
    and its FLOP figures; its counters restart, as its own log() restarts them."""
    window = {
        "seconds": time.perf_counter() - mp.time_last_log,
        "tokens": mp.ntokens_since_last_log,
        "loading_seconds": sum(mp.data_loading_times),
        "memory": mp.device_memory_monitor.get_peak_stats(),
        "flops_per_token": mp.num_flops_per_token,
        "peak_flops": mp.gpu_peak_flops,
    }
    mp.ntokens_since_last_log = 0
    mp.data_loading_times.clear()
    mp.time_last_log = time.perf_counter()
    mp.device_memory_monitor.reset_peak_stats()
    return window


def leave_out_of_log_window(mp: MetricsProcessor, seconds: float) -> None:
    """Time that was not training (validation): not counted in the next logged throughput."""
    mp.time_last_log += seconds


def missing() -> list[str]:
    """The reaches above that torchtitan no longer offers, each named with its file."""
    problems = []
    if not isinstance(getattr(titan_train, "CheckpointManager", None), type):
        problems.append(REACHES[0])
    if "self._loggers" not in inspect.getsource(LoggerContainer.__init__):
        problems.append(REACHES[1])
    tb_init = inspect.getsource(TensorBoardLogger.__init__)
    if "self.writer" not in tb_init or "self.tag" not in tb_init:
        problems.append(REACHES[2])
    mp_source = inspect.getsource(MetricsProcessor)
    if any(f"self.{name}" not in mp_source for name in _WINDOW):
        problems.append(REACHES[3])
    if any(not callable(getattr(CheckpointManager, name, None)) for name in _CHECKPOINT) or (
        "self.purge_queue" not in inspect.getsource(CheckpointManager)
    ):
        problems.append(REACHES[4])
    if not hasattr(importlib.import_module("torchtitan.models.llama3.infra.parallelize"), "_op_sac_save_list"):
        problems.append(REACHES[5])
    if any(not hasattr(importlib.import_module(m), n) for m, names in DEVICE_GLOBALS.items() for n in names):
        problems.append(REACHES[6])
    module_name, name = BLOCK_MASK_BUILDER
    attention = importlib.import_module(module_name)
    if not hasattr(attention, name) or name not in inspect.getsource(attention.create_attention_mask):
        problems.append(REACHES[7])
    return [f"{what} ({file}, {where})" for what, file, where in problems]
