"""Room for a run's checkpoints: one checkpoint's size, a checkpoint folder checked at start-up (writable, with room
for one more checkpoint), and a failed save said to be a full disk when it is. A full disk found at the first save,
hours in, costs the run; found at start-up it costs a minute.
"""

from __future__ import annotations

import errno
import os
import shutil
import uuid

import torch.nn as nn

GIB = 2**30


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
