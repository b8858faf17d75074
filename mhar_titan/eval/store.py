"""The watcher's results, kept in the pair folder (`<pair>/eval/store/`): one JSON file per arm, step, weights and
task, written whole or not at all (data/atomic.write_text) once its evaluation has finished, so a watcher
killed at any moment leaves only finished results, and a restart evaluates exactly what is missing.

`settings.json` (written with the first record) holds the settings the store was made with (tasks and their
shots, limit, dtype, batch size, device, weights, the base, lm-eval's and transformers' versions); every record
repeats them with the identity of the checkpoint it read. A watcher with other settings is refused with each
difference named, so results of two settings never mix in one table; so is a record that is not what its
name says, or not readable (named, never skipped). A write_text temporary (`.<name>.tmp`) is what a kill
mid-write leaves: removed, and said so.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple
from urllib.parse import quote

from data.atomic import write_text
from mhar_titan.components.run_lock import LOCK_FILE

SETTINGS = "settings.json"
TENSORBOARD = "tensorboard.json"  # the (weights, step) pairs already written to the TensorBoard run
RECORD_FIELDS = ("key", "settings", "checkpoint", "scores", "evaluated")


class Key(NamedTuple):
    """One result: an arm (control, mhar, or base at step 0) at a step, with raw or EMA weights, on one task."""

    arm: str
    step: int
    weights: str
    task: str

    def file_name(self) -> str:
        return f"step-{self.step:08d}.{self.arm}.{self.weights}.{quote(self.task, safe='')}.json"

    def __str__(self) -> str:
        if self.arm == "base":
            return f"base, step 0, task {self.task}"
        return f"{self.arm} arm, {self.weights} weights, step {self.step}, task {self.task}"


class StoreError(ValueError):
    """The store cannot be used as it is: other settings, or a record that is not one (named)."""


class Store:
    """The records of one pair; `refresh()` reads the ones written since the last call (a record never changes)."""

    def __init__(self, folder: Path, log: Callable[[str], None] = print):
        self.folder, self.log = folder, log
        self.settings: dict[str, Any] | None = None
        self.records: dict[Key, dict[str, Any]] = {}
        self._read: set[str] = set()

    def check_settings(self, settings: dict[str, Any]) -> None:
        """The store's settings: a new store's are written with its first record (a command refused before that
        leaves none); other settings than an existing store's are refused, each difference named."""
        path = self.folder / SETTINGS
        if not path.exists():
            self.settings = json.loads(json.dumps(settings))
            return
        try:
            recorded = json.loads(path.read_text())["settings"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise StoreError(f"{path}: unreadable store settings ({type(e).__name__}: {e})") from e
        current = json.loads(json.dumps(settings))
        diffs = differences(recorded, current)
        if diffs:
            raise StoreError(
                f"{path}: the store holds results evaluated with other settings ({'; '.join(diffs)}); evaluate with "
                f"the store's settings, or move {self.folder} aside to start another store"
            )
        self.settings = recorded

    def refresh(self) -> dict[Key, dict[str, Any]]:
        """Every record, the new ones read and checked; a file that is not a valid record raises, naming it."""
        for name in sorted(os.listdir(self.folder)):
            if name in self._read or name in (SETTINGS, TENSORBOARD) or name.startswith(LOCK_FILE):
                continue
            path = self.folder / name
            if name.startswith(".") and name.endswith(".tmp"):  # write_text's temporary: a kill mid-write
                self.log(f"[eval] {path}: removed, a record write that a kill interrupted (it is evaluated again)")
                path.unlink(missing_ok=True)
                continue
            record = self._check(path)
            self.records[Key(**record["key"])] = record
            self._read.add(name)
        return self.records

    def _check(self, path: Path) -> dict[str, Any]:
        try:
            record = json.loads(path.read_text())
            missing = [f for f in RECORD_FIELDS if f not in record]
            if missing:
                raise ValueError(f"no {', '.join(missing)}")
            key = Key(**record["key"])
        except (OSError, ValueError, TypeError) as e:
            raise StoreError(f"{path}: not a record of this store ({type(e).__name__}: {e}); move it aside") from e
        if key.file_name() != path.name:
            raise StoreError(f"{path}: holds the record of {key}, whose file is {key.file_name()}; move it aside")
        diffs = differences(self.settings or {}, record["settings"])
        if diffs:
            raise StoreError(f"{path}: evaluated with other settings than the store's ({'; '.join(diffs)})")
        return record

    def add(self, key: Key, checkpoint: dict[str, Any], scores: dict[str, Any], seconds: float) -> None:
        """One finished evaluation, written atomically; a second record of the same key is refused (never two)."""
        path = self.folder / key.file_name()
        if key in self.records or path.exists():
            raise StoreError(f"{path}: {key} is already in the store; it is evaluated once")
        if not (self.folder / SETTINGS).exists():
            write_text(self.folder / SETTINGS, json.dumps({"settings": self.settings, "created": time.time()}) + "\n")
        record = {
            "key": key._asdict(),
            "settings": self.settings,
            "checkpoint": checkpoint,
            "scores": scores,
            "evaluated": {"finished": time.time(), "seconds": round(seconds, 3), "pid": os.getpid()},
        }
        write_text(path, json.dumps(record) + "\n")
        self.records[key] = json.loads(json.dumps(record))
        self._read.add(path.name)

    def logged(self) -> set[tuple[str, int]]:
        """The (weights, step) pairs whose scalars the TensorBoard run already has."""
        path = self.folder / TENSORBOARD
        return {(w, int(s)) for w, s in json.loads(path.read_text())} if path.exists() else set()

    def mark_logged(self, logged: set[tuple[str, int]]) -> None:
        write_text(self.folder / TENSORBOARD, json.dumps(sorted(logged)) + "\n")


def differences(recorded: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Each setting that differs, as "name: X in the store, Y now"."""
    out = []
    for name in sorted(set(recorded) | set(current)):
        if recorded.get(name) != current.get(name):
            out.append(f"{name}: {_show(recorded.get(name))} in the store, {_show(current.get(name))} now")
    return out


def _show(value: Any) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_show(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return ",".join(_show(v) for v in value)
    return "none" if value is None else str(value)
