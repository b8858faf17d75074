"""Start-up checks on the run folder, before any work: is this the run the job claims to continue, and
can its checkpoints be written at all. A wrong answer found hours later (a resume under other
settings, a full disk at the first save) costs the run; found at start-up it costs a minute.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import uuid
from typing import Any

import torch.nn as nn
from torchtitan.config import JobConfig
from torchtitan.tools.logging import logger

from data.index import share_from_rank0
from mhar_titan.components import fingerprint
from mhar_titan.components.run_record import MODEL_ARGS_FILE

GIB = 2**30


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


def checkpoint_bytes(model: nn.Module, ema: bool) -> int:
    """About what one full checkpoint of `model` takes on disk, all ranks together: each parameter in
    its own dtype, AdamW's two moments in that dtype, and the fp32 EMA (sharded DTensors count whole)."""
    total = 0
    for p in model.parameters():
        total += p.numel() * (3 * p.element_size() + (4 if ema else 0))
    return total


def _existing(path: str) -> str:
    while path and not os.path.exists(path):
        path = os.path.dirname(path.rstrip("/")) or "."
    return path or "."


def check_checkpoint_folder(folder: str, needed: int) -> None:
    """The checkpoint folder can be created and written, and its file system has room for one more
    checkpoint of `needed` bytes (the oldest is deleted only after the new one is complete)."""
    try:
        os.makedirs(folder, exist_ok=True)
        probe = os.path.join(folder, f".write-check-{uuid.uuid4().hex}")
        with open(probe, "wb") as f:
            f.write(b"x")
        os.remove(probe)
    except OSError as e:
        raise OSError(
            e.errno, f"checkpoint folder {folder} is not writable ({type(e).__name__}: {e.strerror or e})"
        ) from e
    free = shutil.disk_usage(folder).free
    if free < needed:
        raise OSError(
            errno.ENOSPC,
            f"checkpoint folder {folder}: {free / GIB:.2f} GiB free, one checkpoint of this run takes about "
            f"{needed / GIB:.2f} GiB (weights, AdamW moments, EMA): the first save would fail. Free space, or set "
            "checkpoint.folder or job.dump_folder on a larger file system",
        )


def _no_space(error: BaseException) -> bool:
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno == errno.ENOSPC:
            return True
        if "No space left on device" in str(error):
            return True
        error = error.__cause__ or error.__context__
    return False


def save_failure(checkpoint_id: str, needed: int, error: BaseException) -> BaseException:
    """What to raise when a checkpoint write failed: an OSError that says the disk is full when it is
    (torch's writer reports it as "unexpected pos" or "file write failed"), else `error` itself."""
    try:
        free = shutil.disk_usage(_existing(checkpoint_id)).free
    except OSError:
        return error
    if not (_no_space(error) or free < needed):
        return error
    cause = [line.strip() for line in str(error).splitlines() if line.strip()][-1:] or [""]
    return OSError(
        errno.ENOSPC,
        f"checkpoint {checkpoint_id} could not be written: No space left on device ({free / GIB:.2f} GiB free, "
        f"a checkpoint takes about {needed / GIB:.2f} GiB). The incomplete folder is never loaded; free space or "
        f"lower checkpoint.keep_latest_k, then launch again to resume [{type(error).__name__}: {cause[0][:200]}]",
    )
