"""Checksums of a run's checkpoint files, so a flipped bit is a damaged checkpoint, not a quietly different run.

DCP keeps no checksums of its own (torch.save's per-record CRC32, which it would otherwise compute,
is turned off while our saves write: see `without_torch_crc32`). Each rank hashes the files it wrote
(`__<rank>_*.distcp`; rank 0 also `.metadata`) and writes `checksums/rank-<rank>.json` inside the step
folder, atomically. Every save now writes them inside DCP's own write, before DCP writes `.metadata`
(sealed_save.py), and each manifest records how many ranks wrote one (`ranks`): a complete
checkpoint lacking one of them is damaged, not unverified. A load first verifies every file
against those manifests, the files split over the ranks (each reads 1/world of the checkpoint),
and all ranks agree on the verdict. The hash is xxHash's XXH3-128 (much faster than blake2b on one
core; see docs/performance.md): it detects corruption, it is not a signature against tampering.

A file is hashed in CHUNK_BYTES pieces, each its own digest, so that several threads share one
rank's file (DCP writes one file a rank, tens of GB at one GPU). Manifests written before that
hold one digest of the whole file; they still verify.

A checkpoint without manifests (written before they existed, or by an older version killed in the moment
between DCP's `.metadata` and its manifests) loads with a warning that it is unverified.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor

import torch
import xxhash

from data.atomic import write_text
from mhar_titan.components.checkpoint.layout import MANIFEST_DIR, checkpoint_files, manifest_path, saved_by

ALGORITHM = "xxh3_128"
CHUNKS = f"{ALGORITHM}_chunks"  # an entry's per-chunk digests, in file order
CHUNK_BYTES = 256 * 2**20  # the unit of work a thread hashes
_READ = 16 * 2**20
_THREADS = 8

Entry = dict[str, int | str | list[str]]


@contextlib.contextmanager
def without_torch_crc32() -> Iterator[None]:
    """torch.save's CRC32 of each record off while a save writes: it made DCP's writes about three times slower
    (docs/performance.md), and our manifests, verified before every load, cover every byte of every file.
    torch.load reads such records as any other. Background saves turn it off where they write (in their thread or
    torch's checkpoint process: sealed_save.py)."""
    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(before)


def _digest(path: str, start: int = 0, length: int | None = None) -> str:
    """XXH3-128 of `length` bytes of a file from `start` (to its end when None), read into one reused buffer."""
    h = xxhash.xxh3_128()
    buf = bytearray(_READ)
    view = memoryview(buf)
    left = length
    with open(path, "rb", buffering=0) as f:
        f.seek(start)
        while left is None or left > 0:
            n = f.readinto(view if left is None or left >= _READ else view[:left])
            if not n:
                break
            h.update(view[:n])
            if left is not None:
                left -= n
    return h.hexdigest()


def file_digest(path: str) -> str:
    """XXH3-128 of a whole file (the manifests written before chunks)."""
    return _digest(path)


def chunk_digests(paths: list[str], chunk_bytes: int) -> dict[str, list[str]]:
    """{path: the XXH3-128 of each `chunk_bytes` piece, in order}, the pieces of all files hashed by a pool of
    threads (xxhash and file reads release the GIL)."""
    pieces = [(p, start) for p in paths for start in range(0, max(os.path.getsize(p), 1), chunk_bytes)]
    threads = max(1, min(_THREADS, os.cpu_count() or 1, len(pieces)))
    with ThreadPoolExecutor(threads) as pool:
        digests = list(pool.map(lambda piece: _digest(piece[0], piece[1], chunk_bytes), pieces))
    out: dict[str, list[str]] = {p: [] for p in paths}
    for (p, _), d in zip(pieces, digests, strict=True):
        out[p].append(d)
    return out


def file_entries(step_dir: str, names: Iterable[str]) -> dict[str, Entry]:
    """{name: its manifest record} for files of a step folder: size and the XXH3-128 of each chunk."""
    paths = {name: os.path.join(step_dir, name) for name in names}
    digests = chunk_digests(list(paths.values()), CHUNK_BYTES)
    return {
        name: {"bytes": os.path.getsize(p), "chunk_bytes": CHUNK_BYTES, CHUNKS: digests[p]} for name, p in paths.items()
    }


def write_manifest(step_dir: str, rank: int, files: dict[str, Entry] | None = None, ranks: int | None = None) -> str:
    """Record this rank's files (`files`, else hash those `saved_by` names now); `ranks`: how many ranks write a
    manifest of this checkpoint, all before its `.metadata` (a sealed save). Returns the manifest's path."""
    files = file_entries(step_dir, saved_by(step_dir, rank)) if files is None else files
    os.makedirs(os.path.join(step_dir, MANIFEST_DIR), exist_ok=True)
    path = manifest_path(step_dir, rank)
    manifest = {"rank": rank, "algorithm": ALGORITHM, "files": files} | ({} if ranks is None else {"ranks": ranks})
    write_text(path, json.dumps(manifest, indent=1))
    return path


def missing_manifests(step_dir: str) -> list[str]:
    """The manifests of a sealed checkpoint that are not there: each manifest written inside DCP's write records
    how many ranks wrote one (`ranks`); older checkpoints record nothing, and then none is missing."""
    folder = os.path.join(step_dir, MANIFEST_DIR)
    ranks = 0
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        try:
            with open(os.path.join(folder, name)) as f:
                declared = json.load(f).get("ranks", 0)
        except (OSError, ValueError, AttributeError):
            continue  # not readable: verify_share names it
        ranks = max(ranks, declared if isinstance(declared, int) else 0)
    return [manifest_path(step_dir, r) for r in range(ranks) if not os.path.isfile(manifest_path(step_dir, r))]


def _entry(entry: dict) -> Entry:
    """A manifest's record of one file: its size and either its chunks' digests or (older manifests) one digest."""
    if CHUNKS in entry:
        chunks = [str(d) for d in entry[CHUNKS]]
        chunk_bytes = int(entry["chunk_bytes"])
        if chunk_bytes < 1 or len(chunks) != max(1, -(-int(entry["bytes"]) // chunk_bytes)):
            raise ValueError(f"{len(chunks)} chunk digests for {entry['bytes']} bytes in chunks of {chunk_bytes}")
        return {"bytes": int(entry["bytes"]), "chunk_bytes": chunk_bytes, CHUNKS: chunks}
    return {"bytes": int(entry["bytes"]), ALGORITHM: str(entry[ALGORITHM])}


def read_manifests(step_dir: str) -> dict[str, Entry]:
    """{file name: its record (`_entry`)} from every rank's manifest; a manifest that is not ours raises."""
    folder = os.path.join(step_dir, MANIFEST_DIR)
    recorded: dict[str, Entry] = {}
    names = sorted(n for n in os.listdir(folder) if n.endswith(".json")) if os.path.isdir(folder) else []
    for name in names:
        path = os.path.join(folder, name)
        try:
            with open(path) as f:
                manifest = json.load(f)
            if manifest["algorithm"] != ALGORITHM:
                raise ValueError(f"algorithm {manifest['algorithm']!r}, expected {ALGORITHM!r}")
            for file, entry in manifest["files"].items():
                recorded[file] = _entry(entry)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{path}: not a checksum manifest ({type(e).__name__}: {e})") from e
    return recorded


def verify_share(step_dir: str, rank: int, world: int) -> tuple[list[str], list[str]]:
    """(problems, unverified files) for this rank's share (every world-th file) of the checkpoint.

    A problem is a file whose size or hash differs from its manifest, or a recorded file that is
    gone; an unverified file is one no manifest covers. Unreadable manifests are a problem too, and (rank 0
    reports it) a manifest that a sealed checkpoint lacks.
    """
    try:
        recorded = read_manifests(step_dir)
    except ValueError as e:
        return [str(e)], []
    if rank == 0 and (missing := missing_manifests(step_dir)):
        return [
            f"{m}: missing (every rank wrote its checksums before the checkpoint was complete)" for m in missing
        ], []
    on_disk = checkpoint_files(step_dir)
    everything = sorted(set(on_disk) | set(recorded))
    problems, unverified, hashed = [], [], {}
    for name in everything[rank::world]:
        path = os.path.join(step_dir, name)
        want = recorded.get(name)
        if want is None:
            unverified.append(name)
        elif name not in on_disk:
            problems.append(f"{path}: recorded in the checksums but missing")
        elif os.path.getsize(path) != want["bytes"]:
            problems.append(f"{path}: {os.path.getsize(path)} bytes, {want['bytes']} when saved")
        elif CHUNKS in want:
            hashed.setdefault(int(want["chunk_bytes"]), []).append((name, path))
        elif (digest := file_digest(path)) != want[ALGORITHM]:
            problems.append(f"{path}: {ALGORITHM} {digest}, {want[ALGORITHM]} when saved")
    for chunk_bytes, files in hashed.items():
        digests = chunk_digests([path for _, path in files], chunk_bytes)
        for name, path in files:
            for i, (got, saved) in enumerate(zip(digests[path], recorded[name][CHUNKS], strict=True)):
                if got != saved:
                    end = min((i + 1) * chunk_bytes, int(recorded[name]["bytes"]))
                    problems.append(f"{path}: {ALGORITHM} of bytes {i * chunk_bytes}-{end} {got}, {saved} when saved")
                    break
    return sorted(problems), unverified
