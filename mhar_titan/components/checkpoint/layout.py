"""A run's checkpoints as they lie on disk (and on a store, under the same names), spelled out here alone.

`<dump_folder>/checkpoint/step-N` (torchtitan's names) holds DCP's rank files (`__<rank>_<i>.distcp`), every rank's
checksums (`checksums/rank-<rank>.json`) and, written last, DCP's `.metadata`: a step folder is complete once it
holds `.metadata` (components/checkpoint/sealed_save.py), the one rule for the load, retention, the store's copy
and the tools. A job killed mid-write leaves a folder without it, which is never loaded and is removed later.

The standard library only, so that the tools (eval, hf, preflight, compare, benchmarks) find checkpoints without
loading torch or torchtitan.
"""

from __future__ import annotations

import json
import os
import re

FOLDER = "checkpoint"  # a run folder's checkpoints (torchtitan's default [checkpoint] folder): written there first
STEP_PREFIX = "step-"  # torchtitan's name of a step's checkpoint folder, step-N
STEP_GLOB = f"{STEP_PREFIX}*"
COMPLETE = ".metadata"  # DCP's (torch/distributed/checkpoint/filesystem.py, _metadata_fn), written last
SHARD_SUFFIX = ".distcp"  # DCP's rank files, `__<rank>_<i>.distcp` (filesystem.py, DEFAULT_SUFFIX)
MANIFEST_DIR = "checksums"  # in a step folder: each rank's checksums, rank-<rank>.json
TEMPORARY = "temporary.json"  # in the checkpoint folder: {"steps": [...]}, the steps saved as temporary checkpoints
_STEP = re.compile(re.escape(STEP_PREFIX) + r"(\d+)")


def step_folder(step: int) -> str:
    return f"{STEP_PREFIX}{step}"


def step_of(name: str) -> int | None:
    """The step of a step folder's name; None for any other name (`step-3.waiting-12`, `step-x`)."""
    m = _STEP.fullmatch(name)
    return int(m[1]) if m else None


def step_dir(folder: str, step: int) -> str:
    return os.path.join(folder, step_folder(step))


def is_complete(step_dir: str) -> bool:
    """DCP has written the checkpoint's `.metadata`, which it does last."""
    return os.path.isfile(os.path.join(step_dir, COMPLETE))


def step_folders(folder: str) -> list[int]:
    """The steps with a folder in `folder`, complete or not (a write still running, or cut), ascending."""
    names = os.listdir(folder) if os.path.isdir(folder) else []
    return sorted(step for name in names if (step := step_of(name)) is not None)


def complete_steps(folder: str) -> list[int]:
    """Steps with a complete checkpoint (DCP's `.metadata` written), ascending."""
    names = os.listdir(folder) if os.path.isdir(folder) else []
    return sorted(s for n in names if (s := step_of(n)) is not None and is_complete(os.path.join(folder, n)))


def temporary_steps(folder: str) -> set[int]:
    """The steps saved as temporary checkpoints (by the clock, `[checkpoint] interval_minutes`), as the folder's
    TEMPORARY file lists them; none without one."""
    try:
        with open(os.path.join(folder, TEMPORARY)) as f:
            return {int(step) for step in json.load(f)["steps"]}
    except FileNotFoundError:
        return set()


def retained(
    complete: list[int], temporary: set[int], keep_latest_k: int, keep_every: int = 0, kept: set[int] = frozenset()
) -> set[int]:
    """The complete steps retention keeps: of the regular checkpoints the last `keep_latest_k` (all if <= 0) and every
    `keep_every`-th; of the temporary ones the newest, while no regular one is newer; and `kept` (the checkpoint
    before a spike)."""
    regular = [s for s in complete if s not in temporary]
    keep = set(regular[-keep_latest_k:] if keep_latest_k > 0 else regular)
    if keep_every > 0:
        keep |= {s for s in regular if s % keep_every == 0}
    newest = max((s for s in complete if s in temporary), default=None)
    if newest is not None and newest > max(regular, default=-1):
        keep.add(newest)
    return keep | set(kept)


def shard_name(rank: int, index: int = 0) -> str:
    """DCP's name of a rank's file (its file system writer prefixes them `__<rank>_`)."""
    return f"__{rank}_{index}{SHARD_SUFFIX}"


def saved_by(step_dir: str, rank: int) -> list[str]:
    """The files DCP's file system writer wrote for `rank` (it prefixes them `__<rank>_`); rank 0 writes `.metadata`."""
    shard = re.compile(rf"__{rank}_\d+{re.escape(SHARD_SUFFIX)}")
    names = sorted(n for n in os.listdir(step_dir) if shard.fullmatch(n))
    return ([COMPLETE] if rank == 0 and is_complete(step_dir) else []) + names


def checkpoint_files(step_dir: str) -> list[str]:
    """The files a DCP checkpoint consists of: `.metadata` and the `.distcp` shards."""
    return sorted(n for n in os.listdir(step_dir) if n == COMPLETE or n.endswith(SHARD_SUFFIX))


def manifest_path(step_dir: str, rank: int) -> str:
    return os.path.join(step_dir, MANIFEST_DIR, f"rank-{rank:05d}.json")
