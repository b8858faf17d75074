"""The project's Trainer: torchtitan's, plus the state and metrics the recipe adds."""

from __future__ import annotations

import dataclasses
import json
import os

import torch
import torchtitan.train as titan_train
from torchtitan.config import ConfigManager, JobConfig
from torchtitan.tools.logging import init_logger, logger
from torchtitan.train import Trainer

from data.loader import gather_counters
from mhar_titan import cpu
from mhar_titan.checkpoint import CPTCheckpointManager
from mhar_titan.routing_stats import gather_routing_stats
from mhar_titan.train_spec import MODEL_NAME, train_spec

CONFIG_MODULE = "mhar_titan.config"
MODEL_ARGS_FILE = "model_args.json"
_CONFIG_MODULE_FLAGS = ("--job.custom_config_module", "--job.custom-config-module")


class CPTTrainer(Trainer):
    """torchtitan's Trainer, plus routing statistics; the recipe's EMA state hooks in here too."""

    def __init__(self, job_config: JobConfig):
        # torchtitan's Trainer builds its checkpointer from this module global.
        titan_train.CheckpointManager = CPTCheckpointManager
        super().__init__(job_config)
        self._write_model_args()

    def _write_model_args(self) -> None:
        """The architecture and [mhar] settings beside the checkpoints, so tools can rebuild the model."""
        if torch.distributed.get_rank() != 0:
            return
        os.makedirs(self.job_config.job.dump_folder, exist_ok=True)
        path = os.path.join(self.job_config.job.dump_folder, MODEL_ARGS_FILE)
        info = {"hf_assets_path": self.job_config.model.hf_assets_path, "args": dataclasses.asdict(self.model_args)}
        with open(path, "w") as f:
            json.dump(info, f, indent=2)

    def train_step(self, data_iterator) -> None:
        super().train_step(data_iterator)
        self._log_routing_stats()
        self._log_data_counters()

    def _log_data_counters(self) -> None:
        """Data counters (summed over ranks), the loss parts and every group's LR, at each log step."""
        if not self.metrics_processor.should_log(self.step):
            self.loss_fn.take_parts()  # parts are per step
            return
        metrics = {f"data/{k}": v for k, v in gather_counters(self.dataloader).items()}
        parts = self.loss_fn.take_parts()
        if parts is not None:  # CE and z-loss of this step, per valid token over all ranks
            if self.parallel_dims.dp_enabled:
                torch.distributed.all_reduce(parts, group=self.parallel_dims.get_mesh("batch").get_group())
            ce, z, tokens = parts.tolist()
            metrics.update({"train/ce": ce / tokens, "train/z_loss": z / tokens, "train/loss": (ce + z) / tokens})
        for group in self.optimizers.optimizers[0].param_groups:
            metrics[f"lr/{group['name']}"] = group["lr"]
        self.metrics_processor.logger.log(metrics, self.step)

    def _log_routing_stats(self) -> None:
        mhar = self.job_config.mhar
        if not mhar.enable or mhar.stats_freq == 0 or self.step % mhar.stats_freq:
            return
        model = self.model_parts[0]
        if model.routing_stats is None:
            return
        mesh = self.parallel_dims.get_optional_mesh("batch") if self.parallel_dims.dp_enabled else None
        self.metrics_processor.logger.log(gather_routing_stats(model.routing_stats, mesh), self.step)


def parse_config(argv: list[str]) -> JobConfig:
    """torchtitan's TOML + CLI parsing, with this project's config sections merged in."""
    if not any(arg.split("=", 1)[0] in _CONFIG_MODULE_FLAGS for arg in argv):
        argv = [*argv, f"--job.custom_config_module={CONFIG_MODULE}"]
    config = ConfigManager().parse_args(argv)
    if config.model.name != MODEL_NAME:
        raise ValueError(f"[model] name = {config.model.name!r}: train_cpt.py trains {MODEL_NAME!r}")
    return config


def run(argv: list[str]) -> None:
    """Parse, train, and tear down, as torchtitan.train.main does for its Trainer."""
    init_logger()
    config = parse_config(argv)
    if cpu.should_activate():
        cpu.activate([train_spec()])
    trainer: CPTTrainer | None = None
    try:
        trainer = CPTTrainer(config)
        if config.checkpoint.create_seed_checkpoint:
            if torch.distributed.get_world_size() != 1:
                raise ValueError("checkpoint.create_seed_checkpoint needs a single process")
            if not config.checkpoint.enable:
                raise ValueError("checkpoint.create_seed_checkpoint needs checkpoint.enable = true")
            trainer.checkpointer.save(curr_step=0, last_step=True)
            logger.info("Created seed checkpoint")
        else:
            trainer.train()
    finally:
        if trainer is not None:
            trainer.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
