"""torchtitan's CheckpointManager, with a graft-aware first load from an HF checkpoint, a base load
that checkpointing being off cannot skip, checksummed saves verified before every load, a fallback
to the previous checkpoint when the newest is damaged, a retention policy that counts only
complete checkpoints (last `keep_latest_k`, plus every `keep_every`-th step), and non-tensor
state read back as data only.

A checkpoint is complete once DCP has written its `.metadata`, which it does last, after every rank's files
and checksums (sealed_save.py, layout.py): a job killed mid-write leaves a folder without it, which is never
loaded and is removed later. Saves run in the loop or, with torchtitan's `[checkpoint] async_mode`, in the
background; a background save is waited for before the next save, a stop's save (preemption, bad steps, a
source read to its end), the last step's save and the job's end (the run lock is held until then).

The routing parameters of the MHAR arm are not in the base checkpoint: they keep
their initialisation (gate 0, so the model is the base model) and are listed in
the load ledger, which every rank checks (a bad checkpoint fails on all ranks,
not as a collective hang) and rank 0 prints and writes to <dump_folder>/load_ledger.json.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torchtitan.components.checkpoint import MODEL, AsyncMode, CheckpointManager
from torchtitan.tools.logging import logger
from torchtitan.tools.utils import GarbageCollection

from data.atomic import write_text
from data.collectives import gather_objects
from data.index import share_from_rank0
from mhar_titan.components.checkpoint import sealed_save, testing
from mhar_titan.components.checkpoint.checksums import verify_share, without_torch_crc32
from mhar_titan.components.checkpoint.dcp_io import ParallelFileSystemReader, PinnedStaging
from mhar_titan.components.checkpoint.layout import (
    FOLDER,
    TEMPORARY,
    complete_steps,
    is_complete,
    retained,
    step_folders,
    step_of,
    temporary_steps,
)
from mhar_titan.components.checkpoint.remote import RemoteCheckpoints, is_url
from mhar_titan.components.checkpoint.sealed_save import ReusedStager, SealedBackgroundWriter, SealedStreamingWriter
from mhar_titan.components.checkpoint.space import checkpoint_bytes, save_failure
from mhar_titan.components.ema import STATE as EMA_STATE
from mhar_titan.components.signals import shielded
from mhar_titan.model.state_dict_adapter import OUR_ROUTING

LEDGER_FILE = "load_ledger.json"


class DamagedCheckpoint(ValueError):
    """A checkpoint file differs from the checksum recorded when it was saved."""


# Entries added to the trainer's state after runs had been checkpointed without them: a checkpoint that lacks one
# loads, and the entry keeps the state the job started with (the log says so).
OPTIONAL_ENTRIES = ("train_state.spikes", "train_state.compute_gpu_seconds")


class DataOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, except that non-tensor entries (step counters, LR scheduler and
    optimizer settings, data-stream states) are unpickled by torch.load(weights_only=True), which
    builds plain data and tensors only: a crafted entry cannot run code. What it built is saved again
    and handed to DCP's own load_bytes (torch/distributed/checkpoint/default_planner.py), which
    then unpickles only what we wrote."""

    def set_up_planner(self, state_dict: Any, metadata: Any = None, is_coordinator: bool = False) -> None:
        super().set_up_planner(state_dict, metadata, is_coordinator)
        saved = {} if metadata is None else metadata.state_dict_metadata
        self.absent = [k for k in OPTIONAL_ENTRIES if k in self.state_dict and k not in saved]
        for key in self.absent:
            del self.state_dict[key]

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except Exception as e:  # pickle.UnpicklingError and friends: report which entry
            raise ValueError(
                f"checkpoint entry {read_item.dest_index.fqn!r} is not plain data ({type(e).__name__}); "
                "refusing to unpickle it"
            ) from e
        clean = io.BytesIO()
        torch.save(obj, clean)
        clean.seek(0)
        super().load_bytes(read_item, clean)


def _rank_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def _cause(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()][-1:] or [""]
    return f"{type(error).__name__}: {lines[0][:300]}"


def verify_checkpoint(checkpoint_id: str) -> None:
    """Every rank checks its share of the files against their checksums and all agree; raises
    DamagedCheckpoint naming the files that differ, warns about files without a recorded checksum."""
    rank, world = _rank_world()
    began = time.perf_counter()
    try:
        mine = verify_share(checkpoint_id, rank, world)
    except OSError as e:  # reported, not raised here: the other ranks wait in the gather below
        mine = ([f"{checkpoint_id}: {type(e).__name__}: {e}"], [])
    everyone = gather_objects(mine)
    problems = [p for share in everyone for p in share[0]]
    unverified = sorted(n for share in everyone for n in share[1])
    if problems:
        raise DamagedCheckpoint(f"{len(problems)} damaged files: " + "; ".join(problems[:4]))
    if unverified:
        logger.warning(
            f"{checkpoint_id}: {len(unverified)} files have no recorded checksum ({', '.join(unverified[:4])}): "
            "a checkpoint from before checksums, or a job stopped between the save and its checksums; loading it "
            "unverified"
        )
    else:
        logger.info(f"{checkpoint_id}: checksums verified in {time.perf_counter() - began:.1f} s")


class CPTCheckpointManager(CheckpointManager):
    remote: RemoteCheckpoints | None = None  # the store's copy, with [checkpoint] folder a URL

    def __init__(self, *args: Any, **kwargs: Any):
        cfg = kwargs["checkpoint_config"]
        url = cfg.folder if is_url(cfg.folder) else ""  # kept on a store, written first in the run folder
        cfg = kwargs["checkpoint_config"] = dataclasses.replace(cfg, folder=FOLDER) if url else cfg
        super().__init__(*args, **kwargs)
        self.keep_every = getattr(cfg, "keep_every", 0)
        self.pinned_staging = PinnedStaging()  # the synchronous saves', kept from save to save
        self.pending: str | None = None  # the checkpoint a background save is writing
        if self.enable and self.async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM and not torch.cuda.is_available():
            self.stager = sealed_save.pinned_stager()  # before torchtitan's save makes its own, which needs a GPU
        self.kept_steps: set[int] = set()  # kept out of retention besides the policy's (the checkpoint before a spike)
        self.temporary = temporary_steps(self.folder) if self.enable else set()  # the clock's checkpoints
        self._forced_step: int | None = None  # save_temporary's step, which _should_save lets through
        self._told_links: set[int] = set()
        if not self.enable:
            # torchtitan sets its load policy only with checkpointing on; the base load needs it either way.
            self.folder = os.path.join(kwargs.get("base_folder", ""), cfg.folder)
            self.sd_adapter = kwargs.get("sd_adapter")
            self.initial_load_path = cfg.initial_load_path
            self.initial_load_in_hf = cfg.initial_load_in_hf
            self.initial_load_in_hf_quantized = cfg.initial_load_in_hf_quantized
            self.initial_load_model_only = cfg.initial_load_model_only
            self.exclude_from_loading = cfg.exclude_from_loading
        run_dir = kwargs.get("base_folder", "")
        self.remote = RemoteCheckpoints(url, self.folder, run_dir) if url and self.enable else None
        self.remote_steps: list[int] = []  # complete on the store, as found at start-up

    @property
    def expected_bytes(self) -> int:
        """About what one full checkpoint of this run takes on disk (the model's weights, AdamW's moments, the EMA
        where a hook registered one): the room checked at start-up, and a full disk's message."""
        return checkpoint_bytes(self.states[MODEL].model[0], ema=EMA_STATE in self.states)

    def keep(self, steps: set[int]) -> None:
        """Keep these complete checkpoints out of retention (the checkpoint before a spike)."""
        self.kept_steps |= steps

    def all_steps(self) -> list[int]:
        """The run's complete checkpoints, in its folder and (kept on a store) there, the store's prefix checked
        and claimed for this run first (components/checkpoint/remote.py); a collective."""
        local = complete_steps(self.folder)
        if self.remote is None:
            return local
        self.remote_steps = share_from_rank0(lambda: {"steps": self.remote.attach()})["steps"]
        return sorted(set(local) | set(self.remote_steps))

    def copy_down(self, load_step: int = -1) -> None:
        """At start-up, once the run is checked: the step the load will take first (`load_step`, or the newest of the
        run folder and the store), copied from the store if the run folder lacks it, so that a store failing here
        stops the job before any work (a collective)."""
        local = complete_steps(self.folder)
        step = load_step if load_step != -1 else max(local + self.remote_steps, default=-1)
        if self.remote is not None and step in self.remote_steps and step not in local:
            share_from_rank0(lambda: self.remote.fetch(step) or {})

    def retained(self, complete: list[int]) -> set[int]:
        """The complete steps retention keeps (layout.retained): the last keep_latest_k regular ones (all if <= 0),
        every keep_every-th, the newest temporary one while no regular one is newer, and kept_steps."""
        return retained(complete, self.temporary, self.keep_latest_k, self.keep_every, self.kept_steps)

    def save_temporary(self, step: int) -> None:
        """A temporary checkpoint at `step` (the clock's, `[checkpoint] interval_minutes`): written as the interval's
        are (in the background where async_mode says, checksummed, `.metadata` last, copied to the store), listed
        in the checkpoint folder's TEMPORARY file first, and removed once a newer checkpoint is complete."""
        if not self.enable or self.load_only or self._should_save(step):
            return  # no checkpoints, or the interval's own save of this step
        self.temporary.add(step)
        if dist.get_rank() == 0:
            self._write_temporary()
        self._forced_step = step
        try:
            self.save(step)
        finally:
            self._forced_step = None

    def _should_save(self, curr_step: int, last_step: bool = False) -> bool:
        forced = self.enable and not self.load_only and curr_step == self._forced_step
        return forced or super()._should_save(curr_step, last_step)

    def _regular(self, step: int, saving: bool) -> None:
        """A regular checkpoint at a step the list names (a temporary one of an earlier timeline, which a crash cut
        before it was written) is not temporary."""
        if saving and step in self.temporary:
            self.temporary.discard(step)
            if dist.get_rank() == 0:
                self._write_temporary()

    def _write_temporary(self) -> None:
        os.makedirs(self.folder, exist_ok=True)
        write_text(os.path.join(self.folder, TEMPORARY), json.dumps({"steps": sorted(self.temporary)}))

    def _upload(self, checkpoint_id: str, saved: Any = None) -> None:
        """A saved step's copy to the store, in the background (nothing without one)."""
        if self.remote is not None and (step := step_of(os.path.basename(checkpoint_id))) is not None:
            self.remote.upload(step, *_rank_world(), self.retained, saved)

    def load(self, step: int = -1) -> bool:
        """The run's latest complete checkpoint, verified; if damaged or unreadable, the one before it
        (and says so); with none, the base (whether or not periodic checkpoints are on). Logs which
        weights the run starts from. Forked from torchtitan 0.2.2 torchtitan/components/checkpoint.py,
        CheckpointManager.load (and _find_load_step for the step-N folders)."""
        if step != -1:  # --checkpoint.load_step: that one or nothing
            if not self.enable:
                raise ValueError(f"checkpoint.load_step = {step} needs checkpoint.enable = true")
            checkpoint_id = self._create_checkpoint_id(step)
            self.copy_down(step)
            if is_complete(checkpoint_id):
                verify_checkpoint(checkpoint_id)
            loaded = super().load(step)
            logger.info(f"The run resumes from its checkpoint {checkpoint_id} (step {step})")
            return loaded
        local = complete_steps(self.folder) if self.enable else []
        candidates = sorted(set(local) | set(self.remote_steps))[::-1]
        for i, candidate in enumerate(candidates):
            checkpoint_id = self._create_checkpoint_id(candidate)
            error: BaseException | None = None
            self.copy_down(candidate)  # on the store alone (a fallback past the newest): copied into the run folder
            try:
                if is_complete(checkpoint_id):
                    verify_checkpoint(checkpoint_id)
                super().load(step=candidate)
            except (Exception, CheckpointException) as e:  # DCP's is a BaseException
                error = e
            # A rank that failed on its own (a data stream's state it alone reads) must not leave the
            # others training on a checkpoint it could not load: every rank takes the same decision.
            failures = gather_objects(None if error is None else _cause(error))
            if not any(failures):
                logger.info(f"The run resumes from its checkpoint {checkpoint_id} (step {candidate})")
                if self.remote is not None and candidate not in self.remote_steps:
                    self._upload(checkpoint_id)  # written before a failed or cut upload: put there now
                return True
            cause = next(f for f in failures if f)
            if i + 1 == len(candidates):
                if error is not None:
                    raise error
                raise RuntimeError(f"checkpoint {checkpoint_id} could not be loaded on another rank: {cause}")
            logger.warning(
                f"checkpoint {checkpoint_id} could not be loaded ({cause}); falling back to step {candidates[i + 1]}"
            )
        return self._load_base()

    def _load_base(self) -> bool:
        """The first start's load, as torchtitan's CheckpointManager.load does it when the checkpoint
        folder does not exist (components/checkpoint.py), but also when the folder holds no complete
        checkpoint, and with periodic checkpoints off."""
        from_hf = self.initial_load_in_hf
        path = self.initial_load_path or (self.sd_adapter.hf_assets_path if from_hf and self.sd_adapter else "")
        if not path:
            logger.warning(
                "The run starts from a random initialisation: no checkpoint of its own and no base "
                "(set checkpoint.initial_load_in_hf with model.hf_assets_path, or checkpoint.initial_load_path)"
            )
            return False
        if not os.path.isdir(path):
            raise ValueError(f"base {path!r} (checkpoint.initial_load_path or model.hf_assets_path): not a folder")
        model_only = from_hf or self.initial_load_model_only
        if not from_hf and is_complete(path):
            verify_checkpoint(path)
        self.dcp_load(
            self._states_to_load(model_only),
            checkpoint_id=path,
            from_hf=from_hf,
            from_quantized=self.initial_load_in_hf_quantized,
        )
        kind = "HF safetensors" if from_hf else "DCP" + (", model only" if model_only else "")
        logger.info(f"The run starts from the base {path} ({kind}) at step 0")
        return True

    def _purge_stale_checkpoints(self) -> None:
        """Forked from torchtitan 0.2.2 torchtitan/components/checkpoint.py, CheckpointManager.
        _purge_stale_checkpoints: counts complete checkpoints only, and keeps every keep_every-th and kept_steps."""
        if (self.keep_latest_k <= 0 and not self.temporary) or dist.get_rank() != 0 or not os.path.isdir(self.folder):
            return
        complete = complete_steps(self.folder)
        keep = self.retained(complete) | (self.remote.in_flight if self.remote is not None else set())
        newest = complete[-1] if complete else -1
        present = step_folders(self.folder)
        # complete ones beyond the policy, and unfinished writes older than the newest complete one
        purged = set()
        for step in sorted(s for s in present if s not in keep and (s in complete or s < newest)):
            path = self._create_checkpoint_id(step)
            if os.path.islink(path):  # placed by hand (moved to other storage): neither the link nor its target
                if step not in self._told_links:
                    self._told_links.add(step)
                    logger.info(f"{path} is a symbolic link (to {os.readlink(path)}): retention leaves it alone")
                continue
            self.purge_queue.put(path)
            purged.add(step)
        # the list forgets the folders on their way out and those gone before (not one a background save is about
        # to create: newer than any complete checkpoint)
        listed = {s for s in self.temporary if s not in purged and (s in present or s > newest)}
        if listed != self.temporary:
            self.temporary = listed
            self._write_temporary()

    def save(self, curr_step: int, last_step: bool = False) -> None:
        """torchtitan's, then retention after a last-step save too (torchtitan's returns before it)."""
        self._regular(curr_step, self._should_save(curr_step, last_step) and curr_step != self._forced_step)
        super().save(curr_step, last_step)
        if last_step and self.enable and not self.load_only:
            self._purge_stale_checkpoints()

    def save_now(self, step: int) -> None:
        """A full, resumable checkpoint at `step` whatever the interval (preemption, a stop on bad steps), once a
        background save still writing is complete: written in the loop, as the job ends after it."""
        if not self.enable or self.load_only:
            logger.warning(f"step {step}: checkpointing is off, nothing saved")
            return
        self._async_wait()
        if is_complete(self._create_checkpoint_id(step)):
            return  # the interval save of this step already wrote it
        logger.info(f"Saving a full checkpoint at step {step} now")
        self._regular(step, True)
        self.dcp_save(
            self._flattened_model_states_sd(),
            checkpoint_id=self._create_checkpoint_id(step),
            async_mode=AsyncMode.DISABLED,
            enable_garbage_collection=True,
        )
        self._purge_stale_checkpoints()

    def dcp_save(
        self,
        state_dict: dict[str, Any],
        checkpoint_id: str,
        async_mode: AsyncMode,
        enable_garbage_collection: bool = False,
        to_hf: bool = False,
    ) -> Any:
        """torchtitan's save, through sealed writers (sealed_save.py: every rank's checksums are on disk before
        `.metadata` completes the checkpoint; no torch.save CRC32, which they make redundant): a synchronous save
        written record by record, its GPU tensors through reused page-locked buffers; a background one as
        torchtitan starts it (`_background_save`)."""
        try:
            if to_hf:
                ret = super().dcp_save(state_dict, checkpoint_id, async_mode, enable_garbage_collection, to_hf)
            elif async_mode != AsyncMode.DISABLED:
                ret = self._background_save(state_dict, checkpoint_id, async_mode)
            else:  # torchtitan 0.2.2 CheckpointManager.dcp_save's synchronous DCP branch, our writer
                began = time.perf_counter()
                with without_torch_crc32():
                    writer = SealedStreamingWriter(checkpoint_id, self.pinned_staging)
                    ret = dcp.save(state_dict, storage_writer=writer, checkpoint_id=checkpoint_id)
                logger.info(f"{checkpoint_id}: written and checksummed in {time.perf_counter() - began:.1f} s")
                self._upload(checkpoint_id)
                if enable_garbage_collection:
                    GarbageCollection.collect("GC collection invoked by checkpointer.")
        except (Exception, CheckpointException) as e:  # a full disk reads "unexpected pos" there: say it
            failure = save_failure(checkpoint_id, self.expected_bytes, e)
            if failure is e:
                raise
            raise failure from e
        return ret

    def _background_save(self, state_dict: dict[str, Any], checkpoint_id: str, async_mode: AsyncMode) -> Any:
        """Forked from torchtitan 0.2.2 torchtitan/components/checkpoint.py, CheckpointManager.dcp_save's two
        asynchronous branches: the same dcp.async_save calls, with a sealed writer (a path alone would get
        torch's), and, before staging on a stream of its own, the step's device work finished."""
        writer = SealedBackgroundWriter(checkpoint_id)
        if async_mode == AsyncMode.ASYNC:  # staged in this thread into fresh host memory, written by a thread
            ret = dcp.async_save(state_dict, storage_writer=writer, checkpoint_id=checkpoint_id, process_group=self.pg)
        else:  # staged by a thread into pinned shared memory kept from save to save, written by torch's process
            if not isinstance(self.stager, ReusedStager):  # torchtitan's, just made at the first save: ours instead
                self.stager.close()
                self.stager = sealed_save.pinned_stager()
            sealed_save.device_work_done()
            with shielded():  # torch's checkpoint process, started at the first save, lives through a SIGTERM
                ret = dcp.async_save(
                    state_dict,
                    storage_writer=writer,
                    checkpoint_id=checkpoint_id,
                    process_group=self.pg,
                    async_checkpointer_type=AsyncCheckpointerType.PROCESS,
                    async_stager=self.stager,
                )
        self.pending = checkpoint_id
        self._upload(checkpoint_id, getattr(ret, "upload_completion", ret))
        testing.after_launch(checkpoint_id)  # a test's preemption; nothing otherwise
        return ret

    def _async_wait(self) -> None:
        """torchtitan's wait for the background save (its files, checksums and `.metadata`), saying how long the
        job waited for one still writing, and a full disk as such when the background write failed on one."""
        future, pending = getattr(self, "save_future", None), self.pending
        waiting = future is not None and not future.done()
        began = time.perf_counter()
        if waiting:
            testing.announce(pending)
        try:
            super()._async_wait()
        except (Exception, CheckpointException) as e:
            failure = save_failure(str(pending), self.expected_bytes, e)
            if failure is e:
                raise
            raise failure from e
        finally:
            if waiting:
                testing.release(pending)
        if waiting:
            logger.info(f"waited {time.perf_counter() - began:.1f} s for the background save of {pending} to finish")

    def close(self) -> None:
        """A background save still writing finishes first: the job (and with it the run lock, released after
        this) ends with that checkpoint complete or, if it failed, said. Then torchtitan's close."""
        failure = None
        error = sys.exc_info()[1]  # the job's own failure, if it ends in one: said before any wait, not after
        remote = getattr(self, "remote", None)
        busy = getattr(self, "save_future", None) is not None or (remote is not None and remote.busy())
        if isinstance(error, Exception) and busy and getattr(self, "enable", False):
            logger.error(
                f"the job failed ({type(error).__name__}: {str(error)[:2000]}); finishing its checkpoints first"
            )
        if getattr(self, "enable", False) and getattr(self, "save_future", None) is not None:
            try:
                self._async_wait()
            except (Exception, CheckpointException) as e:
                failure = e
            self.save_future = None
        upload = remote.finish() if remote is not None else None  # the last upload, after the save it copies
        super().close()
        ending_well = sys.exc_info()[1] is None  # the job fails now; else its own error stands
        if failure is not None:
            pending = getattr(self, "pending", None)
            logger.error(
                f"the background save of {pending} failed ({_cause(failure)}): it is not complete and will not be "
                "loaded; the run resumes from the checkpoint before it"
            )
            if ending_well:
                raise failure
        if upload is not None:
            logger.error(f"{upload}: the store lacks the run's last checkpoint (the run folder has it)")
            if ending_well:
                raise RuntimeError(upload)

    def dcp_load(self, state_dict: dict[str, Any], checkpoint_id: str, from_hf: bool, from_quantized: bool) -> None:
        """Forked from torchtitan 0.2.2 torchtitan/components/checkpoint.py, CheckpointManager.dcp_load: the
        DCP branch reads non-tensor entries as data only and tensors on several threads; the HF branch keeps the
        graft's load ledger."""
        if not from_hf:  # torchtitan's DCP load, with non-tensor entries read as data only
            planner = DataOnlyLoadPlanner()
            dcp.load(state_dict, storage_reader=ParallelFileSystemReader(checkpoint_id), planner=planner)
            if planner.absent:
                logger.info(
                    f"{checkpoint_id} has no {', '.join(planner.absent)} (saved before it was kept): started afresh"
                )
            if MODEL in self.states:
                self.states[MODEL].load_state_dict(state_dict)
            return
        # The train spec's adapter, mhar_titan.hf.ledger.LedgerStateDictAdapter, builds the ledger (components
        # do not import hf): what the load does with each tensor, from the safetensors headers alone.
        ledger = self.sd_adapter.ledger(checkpoint_id, {k: v.shape for k, v in state_dict.items()})
        rank0 = not dist.is_initialized() or dist.get_rank() == 0
        if rank0:
            logger.info(ledger.summary())
            run_dir = os.path.dirname(self.folder)
            os.makedirs(run_dir, exist_ok=True)
            with open(os.path.join(run_dir, LEDGER_FILE), "w") as f:
                f.write(ledger.to_json())
        if not ledger.ok:
            raise ValueError(ledger.summary())
        base = {k: v for k, v in state_dict.items() if not OUR_ROUTING.match(k)}
        hf_state_dict = self.sd_adapter.to_hf(base)
        dcp.load(hf_state_dict, storage_reader=self.sd_adapter.get_hf_storage_reader(checkpoint_id, from_quantized))
        self.states[MODEL].load_state_dict(self.sd_adapter.from_hf(hf_state_dict))
