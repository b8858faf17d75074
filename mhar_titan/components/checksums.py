"""Checksums of a run's checkpoint files, so a flipped bit is a damaged checkpoint, not a quietly different run.

DCP keeps no checksums. After a save completes, each rank hashes the files it wrote
(`__<rank>_*.distcp`; rank 0 also `.metadata`) and writes `checksums/rank-<rank>.json` inside
the step folder, atomically. A load first verifies every file against those manifests, the
files split over the ranks (each reads 1/world of the checkpoint), and all ranks agree on the
verdict. The hash is xxHash's XXH3-128 (much faster than blake2b on one core; see
docs/performance.md): it detects corruption, it is not a signature against tampering.

A checkpoint without manifests (written before they existed, or a job killed in the moment
between DCP's `.metadata` and its manifests) loads with a warning that it is unverified.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable

import xxhash

from mhar_titan.components.atomic import write_text

ALGORITHM = "xxh3_128"
MANIFEST_DIR = "checksums"
_CHUNK = 16 * 2**20


def file_digest(path: str) -> str:
    """XXH3-128 of a file's bytes, read in 16 MiB chunks."""
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def saved_by(step_dir: str, rank: int) -> list[str]:
    """The files DCP's file system writer wrote for `rank` (it prefixes them `__<rank>_`); rank 0 writes `.metadata`."""
    names = sorted(n for n in os.listdir(step_dir) if re.fullmatch(rf"__{rank}_\d+\.distcp", n))
    return ([".metadata"] if rank == 0 and os.path.isfile(os.path.join(step_dir, ".metadata")) else []) + names


def write_manifest(step_dir: str, rank: int) -> str:
    """Hash this rank's files of a completed save and record them; returns the manifest's path."""
    files = {name: {"bytes": os.path.getsize(p), ALGORITHM: file_digest(p)} for name, p in _paths(step_dir, rank)}
    folder = os.path.join(step_dir, MANIFEST_DIR)
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"rank-{rank:05d}.json")
    write_text(path, json.dumps({"rank": rank, "algorithm": ALGORITHM, "files": files}, indent=1))
    return path


def _paths(step_dir: str, rank: int) -> Iterable[tuple[str, str]]:
    return ((name, os.path.join(step_dir, name)) for name in saved_by(step_dir, rank))


def read_manifests(step_dir: str) -> dict[str, dict[str, int | str]]:
    """{file name: {"bytes", "xxh3_128"}} from every rank's manifest; a manifest that is not ours raises."""
    folder = os.path.join(step_dir, MANIFEST_DIR)
    recorded: dict[str, dict[str, int | str]] = {}
    names = sorted(n for n in os.listdir(folder) if n.endswith(".json")) if os.path.isdir(folder) else []
    for name in names:
        path = os.path.join(folder, name)
        try:
            with open(path) as f:
                manifest = json.load(f)
            if manifest["algorithm"] != ALGORITHM:
                raise ValueError(f"algorithm {manifest['algorithm']!r}, expected {ALGORITHM!r}")
            for file, entry in manifest["files"].items():
                recorded[file] = {"bytes": int(entry["bytes"]), ALGORITHM: str(entry[ALGORITHM])}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{path}: not a checksum manifest ({type(e).__name__}: {e})") from e
    return recorded


def checkpoint_files(step_dir: str) -> list[str]:
    """The files a DCP checkpoint consists of: `.metadata` and the `.distcp` shards."""
    return sorted(n for n in os.listdir(step_dir) if n == ".metadata" or n.endswith(".distcp"))


def verify_share(step_dir: str, rank: int, world: int) -> tuple[list[str], list[str]]:
    """(problems, unverified files) for this rank's share (every world-th file) of the checkpoint.

    A problem is a file whose size or hash differs from its manifest, or a recorded file that is
    gone; an unverified file is one no manifest covers. Unreadable manifests are a problem too.
    """
    try:
        recorded = read_manifests(step_dir)
    except ValueError as e:
        return [str(e)], []
    on_disk = checkpoint_files(step_dir)
    everything = sorted(set(on_disk) | set(recorded))
    problems, unverified = [], []
    for name in everything[rank::world]:
        path = os.path.join(step_dir, name)
        want = recorded.get(name)
        if want is None:
            unverified.append(name)
        elif name not in on_disk:
            problems.append(f"{path}: recorded in the checksums but missing")
        elif os.path.getsize(path) != want["bytes"]:
            problems.append(f"{path}: {os.path.getsize(path)} bytes, {want['bytes']} when saved")
        elif (digest := file_digest(path)) != want[ALGORITHM]:
            problems.append(f"{path}: {ALGORITHM} {digest}, {want[ALGORITHM]} when saved")
    return problems, unverified
