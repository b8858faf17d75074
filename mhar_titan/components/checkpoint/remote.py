"""Checkpoints kept in object storage: `[checkpoint] folder = "s3://bucket/runs/control"`.

Each checkpoint is written and sealed in the run folder as any other (`<dump_folder>/checkpoint/step-N`: DCP's
files, every rank's checksums, `.metadata` last; sealed_save.py, layout.py), so a save holds the loop no longer
than on disk. It is then copied to the store in the background. A bucket has no rename, so the copy keeps the
disk's rule the object-store way:

- every rank puts its share of the step's files (all but `.metadata`), each checked by size, and says so in the
  job's key-value store; rank 0 waits for every rank, puts the run's records beside the steps, then `.metadata`
  last. A step there is complete once it holds `.metadata`, as on disk: a job killed or a store failing midway
  leaves a step without it, which is never loaded and which retention removes later;
- retention there follows the run's policy (keep_latest_k, keep_every, the checkpoint before a spike), deleting
  a step's `.metadata` first;
- one upload at a time, in the order of the saves, none holding the training loop; the job's end waits for the
  last, and fails if the last failed.

A relaunch whose run folder lacks a checkpoint the store has (a lost node, a fresh one) copies it into the run
folder before loading it (rank 0; its checksums are verified before the load as any checkpoint's), and the run's
records with it when the run folder has none, so the fingerprint checks the job before anything is loaded.

`_RUN.json` claims the prefix for one run (created by a conditional write); the run folder keeps the run's id in
`remote.json`. A prefix holding another run, or anything that is not a run's, is refused at start-up in one line.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from torchtitan.tools.logging import logger

from data.atomic import clean_stale, sibling, write_text
from data.store import StoreError, classify, create_exclusive, filesystem, objects, remove_prefix, store_call
from mhar_titan.components.checkpoint import testing
from mhar_titan.components.checkpoint.layout import COMPLETE, STEP_GLOB, complete_steps, step_folder, step_of

CLAIM = "_RUN.json"
LOCAL_RECORD = "remote.json"
FINGERPRINT = "fingerprint.json"  # components/fingerprint.FILE, the record a relaunch is checked against
RUN_FILES = (
    FINGERPRINT,
    "model_args.json",
    "config.resolved.toml",
    "environment.json",
    "starts.jsonl",
    "spikes.jsonl",
    "load_ledger.json",
)
WAIT_S = 3600.0  # rank 0 waiting for the other ranks' shares of one step
_POLL_S = 0.1
SAY_WAITING_S = 30.0  # the job's end says it still waits for the last upload this often


def is_url(folder: str) -> bool:
    return "://" in folder


def _files(folder: str) -> list[str]:
    """Every file below `folder`, relative, sorted."""
    out = []
    for parent, _, names in os.walk(folder):
        out += [os.path.relpath(os.path.join(parent, n), folder) for n in names]
    return sorted(out)


def _store(world: int) -> Any:
    """The job's key-value store (torchrun's), through which ranks say their share is up; None alone."""
    if world == 1 or not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.distributed_c10d._get_default_store()


class RemoteCheckpoints:
    """The store's copy of a run's checkpoints: `attach` at start-up (rank 0), `fetch` a step the run folder lacks
    (rank 0), `upload` each saved step (every rank), `finish` at the job's end (every rank)."""

    def __init__(self, url: str, local_folder: str, run_dir: str):
        self.url = url.rstrip("/")
        self.local, self.run_dir = local_folder, run_dir
        self.fs, self.root = filesystem(self.url)
        self.in_flight: set[int] = set()  # steps being uploaded: local retention leaves them
        self.failure: str | None = None  # the last upload's failure
        self._last: threading.Thread | None = None
        self._sequence = 0  # uploads asked for by this job, the same on every rank

    def _path(self, *names: str) -> str:
        return "/".join([self.root, *names])

    def _names(self) -> list[str]:
        """The top-level names of the objects below the prefix (folder entries without objects are none)."""
        return sorted(
            {name.split("/")[0] for name in store_call(self.url, "listing", lambda: objects(self.fs, self.root))}
        )

    # -- start-up, on rank 0 --------------------------------------------------------------------

    def attach(self) -> list[int]:
        """The store's complete steps, after checking that its prefix holds this run (or nothing, then claimed for
        it); the run's records copied into a run folder that has none. Raises ValueError naming what differs."""
        names = self._names()
        record_path = os.path.join(self.run_dir, LOCAL_RECORD)
        mine = _read_json(record_path) if os.path.isfile(record_path) else {}
        same_url = mine.get("url") == self.url
        if CLAIM in names:
            try:
                claim = json.loads(self.fs.cat_file(self._path(CLAIM)))
                claim["run_id"]
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{self.url}/{CLAIM}: not a run's claim ({type(e).__name__}: {e})") from e
            if same_url and mine.get("run_id") != claim["run_id"]:
                raise ValueError(
                    f"{self.url} holds the checkpoints of another run ({_who(claim)}) than the run "
                    f"in {self.run_dir} (run {mine.get('run_id')}): use another [checkpoint] folder"
                )
            own_run = os.path.isfile(os.path.join(self.run_dir, FINGERPRINT)) or bool(complete_steps(self.local))
            if not same_url and own_run:
                raise ValueError(
                    f"{self.url} holds the checkpoints of a run ({_who(claim)}), and {self.run_dir} "
                    "holds a run of its own: use another [checkpoint] folder, or an empty dump_folder "
                    "to resume the run kept there"
                )
            run_id = claim["run_id"]
        elif names:
            listed = ", ".join(names[:4]) + (" ..." if len(names) > 4 else "")
            raise ValueError(
                f"{self.url} holds {listed} but no {CLAIM}: not a run's checkpoints; use an empty "
                "prefix for [checkpoint] folder"
            )
        else:
            run_id = mine["run_id"] if same_url else uuid.uuid4().hex
            self._claim(run_id)
        os.makedirs(self.run_dir, exist_ok=True)
        write_text(record_path, json.dumps({"url": self.url, "run_id": run_id}, indent=1))
        steps = self.complete_steps()
        if steps and not os.path.isfile(os.path.join(self.run_dir, FINGERPRINT)):
            copied = self._fetch_records()
            logger.info(f"{self.url}: the run's records ({', '.join(copied)}) copied into {self.run_dir}")
        return steps

    def _claim(self, run_id: str) -> None:
        claim = {
            "run_id": run_id,
            "host": socket.gethostname(),
            "dump_folder": os.path.abspath(self.run_dir),
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        data = json.dumps(claim, indent=1).encode()
        try:
            store_call(self.url, f"creating {CLAIM} there", lambda: create_exclusive(self.fs, self._path(CLAIM), data))
        except FileExistsError as e:
            raise ValueError(f"{self.url}: another run claimed it just now") from e
        except StoreError:
            raise
        except Exception as e:  # noqa: BLE001  anything else the store says: named, one line
            raise StoreError(f"{self.url}: cannot create {CLAIM} there ({type(e).__name__}: {e})") from e

    def _fetch_records(self) -> list[str]:
        present = set(self._names())
        copied = [name for name in RUN_FILES if name in present]
        for name in copied:
            write_text(os.path.join(self.run_dir, name), self.fs.cat_file(self._path(name)).decode())
        return copied

    def complete_steps(self) -> list[int]:
        """Steps whose `.metadata` is on the store, ascending."""
        found = self.fs.glob(self._path(STEP_GLOB, COMPLETE))
        return sorted(s for p in found if (s := step_of(p.rstrip("/").split("/")[-2])) is not None)

    def fetch(self, step: int) -> None:
        """Copy a complete step into the run folder (a sibling renamed into place once whole); rank 0. A failure is a
        StoreError naming the step, with nothing left behind."""
        target = os.path.join(self.local, step_folder(step))
        clean_stale(target, ("download",), "a copy from the store of", logger.info)
        partial = sibling(target, "download")
        began = time.perf_counter()
        try:
            self._copy_down(self._path(step_folder(step)), partial)
        except Exception as e:  # noqa: BLE001  the store's or the network's, in botocore's and aiohttp's own types
            shutil.rmtree(partial, ignore_errors=True)
            raise StoreError(
                f"{self.url}/{step_folder(step)}: copying it into {target} failed ({type(e).__name__}: "
                f"{str(e)[:300]}); nothing was loaded",
                classify(e) or "unreachable",
            ) from e
        shutil.rmtree(target, ignore_errors=True)  # an unfinished local write of this step, if any
        os.rename(partial, target)
        size = sum(os.path.getsize(p) for p in _files_abs(target))
        logger.info(
            f"{self.url}/{step_folder(step)}: copied into {target} ({size / 1e9:.2f} GB in "
            f"{time.perf_counter() - began:.1f} s)"
        )

    def _copy_down(self, remote: str, partial: str) -> None:
        relative = objects(self.fs, remote)
        paths = [os.path.join(partial, r) for r in relative]
        for p in paths:
            os.makedirs(os.path.dirname(p), exist_ok=True)
        self.fs.get([f"{remote}/{r}" for r in relative], paths)
        for r, p in zip(relative, paths, strict=True):
            if (size := self.fs.info(f"{remote}/{r}")["size"]) != os.path.getsize(p):
                raise OSError(f"{r}: {os.path.getsize(p)} bytes copied, {size} on the store")

    # -- every rank --------------------------------------------------------------------------------

    def upload(
        self, step: int, rank: int, world: int, keep: Callable[[list[int]], set[int]], saved: Any = None
    ) -> None:
        """Put this rank's share of `step` on the store in the background, after the uploads asked for before it
        and (a background save) once `saved`, the save's future, is done. `keep`: the retention policy."""
        self._sequence += 1
        self.in_flight.add(step)
        args = (step, rank, world, keep, saved, self._last, self._sequence)
        self._last = threading.Thread(target=self._run, args=args, name=f"upload-step-{step}", daemon=True)
        self._last.start()

    def _run(self, step: int, rank: int, world: int, keep: Callable, saved: Any, before: Any, n: int) -> None:
        if before is not None:
            before.join()
        try:
            if saved is not None:
                saved.result()
        except BaseException:  # noqa: BLE001  the save failed, which the checkpoint manager reports: nothing to put
            self.in_flight.discard(step)
            return
        began, store, key = time.perf_counter(), _store(world), f"mhar_titan/upload/{n}"
        name = step_folder(step)
        folder = os.path.join(self.local, name)
        try:
            testing.fail_upload(step, rank)  # a test's failure; nothing otherwise
            self._put(folder, name, [f for f in _files(folder) if f != COMPLETE][rank::world])
            if rank != 0:
                store.add(f"{key}/done", 1)
            else:
                self._wait_for_ranks(store, key, world)
                self._put(self.run_dir, "", [f for f in RUN_FILES if os.path.isfile(os.path.join(self.run_dir, f))])
                self._put(folder, name, [COMPLETE])
                self.purge(keep)
                logger.info(f"{self.url}/{name}: complete on the store ({time.perf_counter() - began:.1f} s)")
            self.failure = None
        except Exception as e:  # noqa: BLE001  any failure: said here, raised at the job's end if it was the last
            cause = f"the upload failed on rank {rank} ({type(e).__name__}: {e})"
            self.failure = str(e) if isinstance(e, _OtherRank) else f"{self.url}/{name}: {cause}"
            logger.error(f"{self.failure}; the checkpoint stays complete in {folder}")
            if store is not None and rank != 0:
                store.set(f"{key}/failed", self.failure)
                store.add(f"{key}/done", 1)
        finally:
            self.in_flight.discard(step)

    def _put(self, folder: str, prefix: str, names: list[str]) -> None:
        if not names:
            return
        remote = [self._path(prefix, n) if prefix else self._path(n) for n in names]
        local = [os.path.join(folder, n) for n in names]
        where = f"{self.url}/{prefix}" if prefix else self.url
        store_call(where, f"uploading {len(names)} files", lambda: self.fs.put(local, remote))
        for lp, rp in zip(local, remote, strict=True):
            if (size := self.fs.info(rp)["size"]) != os.path.getsize(lp):
                raise OSError(f"{rp}: {size} bytes on the store, {os.path.getsize(lp)} on disk")

    def _wait_for_ranks(self, store: Any, key: str, world: int) -> None:
        if store is None:
            return
        deadline = time.monotonic() + WAIT_S
        while store.add(f"{key}/done", 0) < world - 1:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the other ranks' shares were not up after {WAIT_S:.0f} s")
            time.sleep(_POLL_S)
        if store.check([f"{key}/failed"]):
            raise _OtherRank(store.get(f"{key}/failed").decode())

    def purge(self, keep: Callable[[list[int]], set[int]]) -> None:
        """Retention on the store (rank 0, after a step is complete there): complete steps beyond the policy, and
        unfinished ones older than the newest complete; each step's `.metadata` deleted first."""
        complete = self.complete_steps()
        kept, newest = keep(complete), (complete[-1] if complete else -1)
        present = [step for name in self._names() if (step := step_of(name)) is not None]
        for step in sorted(s for s in present if s not in kept and (s in complete or s < newest)):
            if step in complete:
                self.fs.rm_file(self._path(step_folder(step), COMPLETE))
            remove_prefix(self.fs, self._path(step_folder(step)))  # its folder entries too, where a server keeps them
            logger.info(f"{self.url}/{step_folder(step)}: removed (retention)")

    def busy(self) -> bool:
        """Whether an upload is still running."""
        return self._last is not None and self._last.is_alive()

    def finish(self) -> str | None:
        """At the job's end: wait for the last upload, saying so every SAY_WAITING_S; its failure, if it failed.
        The wait ends: each of the upload's requests is bounded (data/store.py), and so are their attempts."""
        began = time.monotonic()
        while self._last is not None and self._last.is_alive():
            waited = time.monotonic() - began
            steps = ", ".join(step_folder(s) for s in sorted(self.in_flight)) or "the last checkpoint"
            said = f" ({waited:.0f} s so far)" if waited else ""
            logger.info(f"waiting for the upload of {steps} to {self.url} to finish{said}")
            self._last.join(SAY_WAITING_S)
        failure, self.failure = self.failure, None  # said once, however often the job's end is reached
        return failure


class _OtherRank(OSError):
    """Another rank's upload of the step failed: its message."""


def _who(claim: dict[str, Any]) -> str:
    where = f"{claim.get('dump_folder')} on {claim.get('host')}"
    return f"run {claim.get('run_id')}, begun {claim.get('created')} in {where}"


def _read_json(path: str) -> dict[str, Any]:
    with open(path) as f:
        return json.load(f)


def _files_abs(folder: str) -> list[str]:
    return [os.path.join(folder, f) for f in _files(folder)]
