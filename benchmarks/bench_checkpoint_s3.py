"""A checkpoint's copy to object storage and back, as a run keeping its checkpoints there makes them
(components/checkpoint/remote.py): one step folder of `--gib` in `--files` rank files, with its checksum
manifests and `.metadata`, put on moto's S3 server on 127.0.0.1 (benchmarks/s3_store.py), then copied down into
an empty run folder; fails unless the step is complete there and the copy holds the same bytes.

A checkpoint moves in few large requests, so its time goes to bandwidth rather than to each request's latency
(the loader's case: bench_data --latency-ms). The figures are this machine's and moto's, a Python server running
in this process, not a cloud store's.

    python -m benchmarks.bench_checkpoint_s3 [--gib 2 --files 8 --repeat 2]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

from benchmarks import s3_store
from mhar_titan.components.checkpoint import layout
from mhar_titan.components.checkpoint.checksums import chunk_digests, write_manifest
from mhar_titan.components.checkpoint.remote import RemoteCheckpoints

STEP = 1000


def step_folder(root: str, gib: float, files: int) -> str:
    """A step folder shaped as a DCP checkpoint of `files` ranks, filled with random bytes, checksummed."""
    folder = layout.step_dir(os.path.join(root, "run", layout.FOLDER), STEP)
    os.makedirs(folder)
    each = int(gib * 2**30 / files)
    for rank in range(files):
        with open(os.path.join(folder, layout.shard_name(rank)), "wb") as f:
            for start in range(0, each, 64 * 2**20):
                f.write(os.urandom(min(64 * 2**20, each - start)))
        write_manifest(folder, rank, ranks=files)
    with open(os.path.join(folder, layout.COMPLETE), "wb") as f:
        f.write(os.urandom(256 * 1024))
    return folder


def digests(folder: str) -> dict[str, list[str]]:
    names = sorted(os.path.relpath(os.path.join(p, n), folder) for p, _, ns in os.walk(folder) for n in ns)
    found = chunk_digests([os.path.join(folder, n) for n in names], 64 * 2**20)
    return {n: found[os.path.join(folder, n)] for n in names}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, default=2.0, help="the step folder's size")
    p.add_argument("--files", type=int, default=8, help="its rank files")
    p.add_argument("--repeat", type=int, default=2, help="rows, each to a new prefix")
    args = p.parse_args(argv)
    s3_store.require("bench_checkpoint_s3")
    with tempfile.TemporaryDirectory() as tmp, s3_store.moto_endpoint() as endpoint:
        folder = step_folder(tmp, args.gib, args.files)
        size = sum(os.path.getsize(os.path.join(folder, n)) for n in digests(folder))
        want = digests(folder)
        s3_store.use_endpoint(endpoint)
        s3_store.client(endpoint).mkdir("ckpt")
        print(
            f"one step folder, {size / 1e9:.2f} GB in {args.files} rank files, to moto's S3 server and back "
            "(one process, s3fs's concurrency)"
        )
        print("| run | upload s | GB/s | copy down s | GB/s |")
        print("|---|---|---|---|---|")
        for i in range(args.repeat):
            store = RemoteCheckpoints(f"s3://ckpt/run-{i}", os.path.dirname(folder), os.path.join(tmp, "run"))
            began = time.perf_counter()
            store.upload(STEP, 0, 1, keep=set)
            if failure := store.finish():
                raise SystemExit(failure)
            up = time.perf_counter() - began
            if store.complete_steps() != [STEP]:
                raise SystemExit(f"s3://ckpt/run-{i}: step {STEP} is not complete there")
            fresh = os.path.join(tmp, f"fresh-{i}", layout.FOLDER)
            os.makedirs(fresh)
            down = RemoteCheckpoints(f"s3://ckpt/run-{i}", fresh, os.path.dirname(fresh))
            began = time.perf_counter()
            down.fetch(STEP)
            copied = time.perf_counter() - began
            if digests(layout.step_dir(fresh, STEP)) != want:
                raise SystemExit("the copy down differs from the step folder uploaded")
            print(f"| {i + 1} | {up:.1f} | {size / up / 1e9:.3g} | {copied:.1f} | {size / copied / 1e9:.3g} |")


if __name__ == "__main__":
    main()
