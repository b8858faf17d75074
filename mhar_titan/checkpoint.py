"""torchtitan's CheckpointManager, with a graft-aware first load from an HF checkpoint.

The routing parameters of the MHAR arm are not in the base checkpoint: they keep
their initialisation (gate 0, so the model is the base model) and are listed in
the load ledger, which every rank checks (a bad checkpoint fails on all ranks,
not as a collective hang) and rank 0 prints and writes to <dump_folder>/load_ledger.json.
"""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torchtitan.components.checkpoint import MODEL, AsyncMode, CheckpointManager
from torchtitan.tools.logging import logger

from mhar_titan.hf import _OUR_ROUTING, build_ledger

LEDGER_FILE = "load_ledger.json"


class CPTCheckpointManager(CheckpointManager):
    def save_now(self, step: int) -> None:
        """A full, resumable checkpoint at `step` whatever the interval (preemption, a stop on bad steps)."""
        if not self.enable or self.load_only:
            logger.warning(f"step {step}: checkpointing is off, nothing saved")
            return
        self._async_wait()
        if os.path.isfile(os.path.join(self._create_checkpoint_id(step), ".metadata")):
            return  # the interval save of this step already wrote it
        logger.info(f"Saving a full checkpoint at step {step} now")
        self.dcp_save(
            self._flattened_model_states_sd(),
            checkpoint_id=self._create_checkpoint_id(step),
            async_mode=AsyncMode.DISABLED,
            enable_garbage_collection=True,
        )
        self._purge_stale_checkpoints()

    def dcp_load(self, state_dict: dict[str, Any], checkpoint_id: str, from_hf: bool, from_quantized: bool) -> None:
        if not from_hf:
            return super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
        ledger = build_ledger(checkpoint_id, {k: v.shape for k, v in state_dict.items()}, self.sd_adapter)
        rank0 = not dist.is_initialized() or dist.get_rank() == 0
        if rank0:
            logger.info(ledger.summary())
            run_dir = os.path.dirname(self.folder)
            os.makedirs(run_dir, exist_ok=True)
            with open(os.path.join(run_dir, LEDGER_FILE), "w") as f:
                f.write(ledger.to_json())
        if not ledger.ok:
            raise ValueError(ledger.summary())
        base = {k: v for k, v in state_dict.items() if not _OUR_ROUTING.match(k)}
        hf_state_dict = self.sd_adapter.to_hf(base)
        dcp.load(hf_state_dict, storage_reader=self.sd_adapter.get_hf_storage_reader(checkpoint_id, from_quantized))
        self.states[MODEL].load_state_dict(self.sd_adapter.from_hf(hf_state_dict))
