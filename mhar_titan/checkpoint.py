"""torchtitan's CheckpointManager, with a graft-aware first load from an HF checkpoint, a
fallback to the previous checkpoint when the newest cannot be read, and a retention policy
that counts only complete checkpoints (last `keep_latest_k`, plus every `keep_every`-th step).

A checkpoint is complete once DCP has written its `.metadata`, which it does last: a job
killed mid-write leaves a folder without it, which is never loaded and is removed later.

The routing parameters of the MHAR arm are not in the base checkpoint: they keep
their initialisation (gate 0, so the model is the base model) and are listed in
the load ledger, which every rank checks (a bad checkpoint fails on all ranks,
not as a collective hang) and rank 0 prints and writes to <dump_folder>/load_ledger.json.
"""

from __future__ import annotations

import os
import re
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torchtitan.components.checkpoint import MODEL, AsyncMode, CheckpointManager
from torchtitan.tools.logging import logger

from mhar_titan.hf import _OUR_ROUTING, build_ledger

LEDGER_FILE = "load_ledger.json"
_COMPLETE = (".metadata", "model.safetensors.index.json")  # written last by DCP / by an HF export


def complete_steps(folder: str) -> list[int]:
    """Steps with a complete checkpoint (DCP `.metadata`, or an HF export's index), ascending."""
    steps = []
    for name in os.listdir(folder) if os.path.isdir(folder) else []:
        m = re.fullmatch(r"step-(\d+)", name)
        if m and any(os.path.isfile(os.path.join(folder, name, f)) for f in _COMPLETE):
            steps.append(int(m[1]))
    return sorted(steps)


class CPTCheckpointManager(CheckpointManager):
    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.keep_every = getattr(kwargs["checkpoint_config"], "keep_every", 0)

    def load(self, step: int = -1) -> bool:
        """The latest complete checkpoint; if it cannot be read, the one before it (and says so)."""
        if not self.enable or step != -1 or not os.path.isdir(self.folder):
            return super().load(step)
        candidates = complete_steps(self.folder)[::-1]
        for i, candidate in enumerate(candidates):
            try:
                return super().load(step=candidate)
            except (Exception, CheckpointException) as e:  # DCP's is a BaseException
                if i + 1 == len(candidates):
                    raise
                cause = [line.strip() for line in str(e).splitlines() if line.strip()][-1:] or [type(e).__name__]
                logger.warning(
                    f"checkpoint {self._create_checkpoint_id(candidate)} could not be loaded "
                    f"({type(e).__name__}: {cause[0][:300]}); falling back to step {candidates[i + 1]}"
                )
        return super().load(step)  # no complete checkpoint: torchtitan's first-start path

    def _purge_stale_checkpoints(self) -> None:
        if self.keep_latest_k <= 0 or dist.get_rank() != 0 or not os.path.isdir(self.folder):
            return
        complete = complete_steps(self.folder)
        keep = set(complete[-self.keep_latest_k :])
        if self.keep_every > 0:
            keep |= {s for s in complete if s % self.keep_every == 0}
        newest = complete[-1] if complete else -1
        present = [int(m[1]) for name in os.listdir(self.folder) if (m := re.fullmatch(r"step-(\d+)", name))]
        # complete ones beyond the policy, and unfinished writes older than the newest complete one
        for step in sorted(s for s in present if s not in keep and (s in complete or s < newest)):
            self.purge_queue.put(self._create_checkpoint_id(step))

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
