"""Start-up checks on the run folder, before any work: is this the run the job claims to continue, and
can its checkpoints be written at all. A wrong answer found hours later (a resume under other
settings, a full disk at the first save) costs the run; found at start-up it costs a minute. The checkpoint
folder's room is checked by components/checkpoint/space.py.
"""

from __future__ import annotations

import json
import os
from typing import Any

from torchtitan.config import JobConfig
from torchtitan.tools.logging import logger

from data.index import share_from_rank0
from mhar_titan.components import fingerprint
from mhar_titan.components.checkpoint.space import check_checkpoint_folder
from mhar_titan.components.run_record import MODEL_ARGS_FILE


def check_resume(
    job_config: JobConfig, current: dict[str, Any], steps: list[int], folder: str, checkpoint_bytes: int
) -> list[str]:
    """Before any load, on every rank: the run in dump_folder is the one this job describes (returns the lines of
    the changes [checkpoint] allow_changes permits; raises listing any other difference), and its checkpoint
    `folder` (with the complete checkpoints `steps`) takes a checkpoint of `checkpoint_bytes`."""
    recorded = fingerprint.read(job_config.job.dump_folder) or {}
    for name in fingerprint.unchecked(recorded, current) if recorded else []:
        logger.warning(f"{name}: not in the run's fingerprint (recorded by an older version): not checked")
    changes = check_run(job_config, current, steps)
    if job_config.checkpoint.enable:
        share_from_rank0(lambda: check_checkpoint_folder(folder, checkpoint_bytes) or {})
    return changes


def check_run(job_config: JobConfig, current: dict[str, Any], steps: list[int]) -> list[str]:
    """`steps`: the complete checkpoints in the run folder. Returns the lines of the changes
    `[checkpoint] allow_changes` permits; raises listing every other difference. A folder with
    checkpoints but no fingerprint.json is refused unless allow_changes has `legacy` (a seed
    checkpoint, step 0 beside model_args.json, is weights to start from and needs no fingerprint)."""
    folder = job_config.job.dump_folder
    if not steps:
        return []
    if not job_config.checkpoint.enable:
        raise ValueError(
            f"{folder} holds checkpoints of a run (steps {steps[0]}..{steps[-1]}); with checkpoint.enable = false "
            "this job would start from the base and mix its logs and recorded settings with that run's: "
            "use another dump_folder, or enable checkpointing to resume it"
        )
    allow = job_config.checkpoint.allow_changes
    recorded = fingerprint.read(folder)
    if recorded is None:
        args = _model_args(folder)
        if not (steps == [0] and args is not None) and fingerprint.LEGACY not in allow:
            raise ValueError(
                f"{folder} holds checkpoints (steps {steps[0]}..{steps[-1]}) but no {fingerprint.FILE}: nothing says "
                "which settings, data and base they were trained with, so this job cannot check it continues "
                "that run. Use another dump_folder; or, for a run from before fingerprints, "
                "--checkpoint.allow_changes legacy (its architecture is still checked against model_args.json)"
            )
        if args is None:
            return [f"{fingerprint.FILE}: absent, resumed as allowed by allow_changes = legacy (nothing checked)"]
        recorded = {**current, "model": fingerprint.model_group(args)}
    return fingerprint.check(recorded, current, allow, f"The run in {folder}")


def _model_args(folder: str) -> dict[str, Any] | None:
    path = os.path.join(folder, MODEL_ARGS_FILE)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)["args"]
