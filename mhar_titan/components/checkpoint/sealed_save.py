"""Checkpoint writers whose `.metadata` appears only after every rank's files and checksums, in the training loop
or in the background (torchtitan's `[checkpoint] async_mode`).

DCP saves in three collective steps (torch/distributed/checkpoint/state_dict_saver.py, _save_state_dict): every
rank plans, every rank writes its files (`write_data`), then rank 0, once it has gathered every rank's write
results, writes `.metadata` (`finish`: a temporary file renamed into place last). `.metadata` is therefore the
one mark of a complete checkpoint (layout.complete_steps: the load, retention and the tools).

The writers here hash a rank's files inside its `write_data` and write that rank's manifest there, before the
gather; rank 0 writes its own, with the checksum of `.metadata`, inside `finish`, just before the rename. So by
the time `.metadata` exists, every file and every rank's checksums are on disk, whether the save ran in the
loop (`disabled`), in torchtitan's background thread (`async`) or in torch's checkpoint process
(`async_with_pinned_mem`): nothing can see a complete checkpoint whose checksums are still to come, and a job
killed at any moment leaves either a complete, checksummed checkpoint or a folder without `.metadata` (never
loaded, removed by retention later). Each manifest records how many ranks wrote one, so a complete checkpoint
missing one is damaged (checksums.missing_manifests).

A background write in torch's checkpoint process outlives its job when the job is killed; it checks that the
job that asked for it is still there before writing and before `.metadata`, so that it never completes a
checkpoint while a relaunched job may already be writing the same step.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, _FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from mhar_titan.components.checkpoint import testing
from mhar_titan.components.checkpoint.checksums import Entry, file_entries, without_torch_crc32, write_manifest
from mhar_titan.components.checkpoint.dcp_io import PinnedStaging, StreamingFileSystemWriter
from mhar_titan.components.checkpoint.layout import COMPLETE


class SealedWrites:
    """Put before a DCP file system writer (one file per rank, one thread): this rank's checksums inside its
    write, rank 0's with `.metadata`'s inside `finish`, before the rename that completes the checkpoint."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.owner = os.getpid()  # the training process that asked for this save
        self.coordinator = False
        self.rank_files: dict[str, Entry] = {}

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_writer(is_coordinator, *args, **kwargs)
        self.coordinator = is_coordinator

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        self._check_owner("writing")
        testing.before_write(os.fspath(self.path), self.owner)  # a test's hold; nothing otherwise
        with without_torch_crc32():  # our checksums cover every byte (checksums.without_torch_crc32)
            done = super().write_data(plan, planner)
        results = done.wait()
        prefix = plan.storage_data.prefix  # DCP's `__<rank>_`, the rank in the save's process group
        rank = int(prefix.strip("_"))
        step_dir = os.fspath(self.path)
        made = {f"{prefix}{i}{DEFAULT_SUFFIX}" for i in range(self.thread_count)}  # an empty share's file too
        names = {r.storage_data.relative_path for r in results} | {
            n for n in made if os.path.isfile(os.path.join(step_dir, n))
        }
        self.rank_files = file_entries(step_dir, sorted(names))
        if not self.coordinator:  # rank 0's is written with .metadata's checksum, in finish
            write_manifest(step_dir, rank, self.rank_files, ranks=_world())
        return done

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """DCP's own finish, whose last act, renaming `.metadata` into place, first writes rank 0's manifest."""
        self._check_owner("completing")
        fs = self.fs
        self.fs = _SealBeforeRename(fs, lambda tmp: self._seal(tmp, len(results)))
        try:
            super().finish(metadata=metadata, results=results)
        finally:
            self.fs = fs

    def _seal(self, metadata_tmp: str, ranks: int) -> None:
        step_dir = os.fspath(self.path)
        entry = file_entries(step_dir, [os.path.basename(os.fspath(metadata_tmp))])
        write_manifest(step_dir, 0, {COMPLETE: next(iter(entry.values())), **self.rank_files}, ranks=ranks)

    def _check_owner(self, doing: str) -> None:
        """In torch's checkpoint process: refuse to go on once the training process is gone (killed)."""
        if os.getpid() != self.owner and os.getppid() != self.owner:
            raise RuntimeError(
                f"{os.fspath(self.path)}: the training process {self.owner} that asked for this save is gone; "
                f"stopped {doing} (a relaunched job may be writing this step)"
            )


class _SealBeforeRename:
    """A DCP FileSystem whose rename of a `.metadata` into place first calls `before(the temporary file)`."""

    def __init__(self, fs: Any, before: Any):
        self._fs, self._before = fs, before

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fs, name)

    def rename(self, path: Any, new_path: Any) -> None:
        if os.path.basename(os.fspath(new_path)) == COMPLETE:
            self._before(os.fspath(path))
        self._fs.rename(path, new_path)


class SealedStreamingWriter(SealedWrites, StreamingFileSystemWriter):
    """The synchronous save's writer (records streamed through reused page-locked buffers), sealed."""

    def __init__(self, path: str | os.PathLike, staging: PinnedStaging):
        super().__init__(path, staging)


class SealedBackgroundWriter(SealedWrites, _FileSystemWriter):
    """The background saves' writer: torch's file system writer as DCP's async_save builds it from a path
    (state_dict_saver.py, `_storage_setup`; one file per rank, one thread), sealed. Not torch's
    FileSystemWriter, which is also a stager and would replace async_save's own staging; plain data, so that
    torch's checkpoint process receives it pickled."""

    def __init__(self, path: str | os.PathLike):
        super().__init__(path, single_file_per_rank=True, sync_files=True, thread_count=1)


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


class ReusedStager(DefaultStager):
    """torch's stager for `async_with_pinned_mem` with its pinned (or shared) copy of the state reused from save to
    save, as torchtitan means it: torch 2.11's DefaultStager._stage closes its StateDictStager after every staging
    (torch/distributed/checkpoint/staging.py), which empties it, so a job's second background save failed
    (KeyError <class 'type'> in _state_dict_stager.py, on an H100) and no copy was kept. Forked from torch 2.13's
    DefaultStager._stage, which does not close it; the job closes the stager at its end (CheckpointManager.close).
    """

    def _stage(self, state_dict: Any, **kwargs: Any) -> Any:
        if self._config.use_non_blocking_copy:
            with self._staging_stream if self._staging_stream is not None else contextlib.nullcontext():
                state_dict = self._state_dict_stager.stage(state_dict, non_blocking=True)
            if self._staging_stream is not None:
                self._staging_stream.synchronize()
            else:
                torch.accelerator.synchronize()
            return state_dict
        return self._state_dict_stager.stage(state_dict, non_blocking=False)


def pinned_stager() -> ReusedStager:
    """The `async_with_pinned_mem` stager: torchtitan's options (CheckpointManager.save: pinned, shared memory,
    staged by a thread, non-blocking copies) on a GPU; on CPU ranks the same without pinning or non-blocking copies,
    which need an accelerator (there is no device copy to overlap there), so that the mode's background staging and
    checkpoint process run, and are tested, on CPU ranks."""
    gpu = torch.cuda.is_available()
    return ReusedStager(
        StagingOptions(use_pinned_memory=gpu, use_shared_memory=True, use_async_staging=True, use_non_blocking_copy=gpu)
    )


def device_work_done() -> None:
    """Before torch's background staging copies the state: the staging stream does not wait for the compute
    stream, where the step's optimizer update and EMA may still be running (torch/distributed/checkpoint/
    staging.py, DefaultStager._stage), so the host waits for them here."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.current_stream().synchronize()
