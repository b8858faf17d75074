"""What checkpoint checksums cost: one rank's share of an 8B checkpoint saved with DCP, then hashed and verified.

python -m benchmarks.bench_checksums [--gib 16] [--dir /tmp/bench-ckpt] [--device cuda]

An 8B run checkpoints about 16 bytes a parameter (fp32 weights, two AdamW moments, the fp32 EMA):
128 GB, 16 GB per rank on 8 GPUs. This saves `--gib` of fp32 tensors as one rank would (DCP's file
system writer, fsync on), writes that rank's checksums as a run does after a save (the files are
still in the page cache), verifies them as a resume does, and again after asking the kernel to drop
the files from its cache (a resume on a fresh node), and prints each beside the save's own time.
The hashes' in-memory throughput (XXH3-128 and, for reference, blake2b) comes first.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import time

import torch
import torch.distributed.checkpoint as dcp
import xxhash

from mhar_titan.components.checkpoint.checksums import verify_share, write_manifest
from mhar_titan.components.checkpoint.layout import checkpoint_files


def _throughput(fn, data: bytes) -> float:
    began = time.perf_counter()
    fn(data)
    return len(data) / (time.perf_counter() - began) / 1e9


def _drop_cache(folder: str) -> None:
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            fd = os.open(path, os.O_RDONLY)
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=16.0, help="bytes one rank saves, in GiB")
    parser.add_argument("--dir", default="/tmp/bench-ckpt", help="where to save (removed before and after)")
    parser.add_argument(
        "--device", default="cuda" if torch.cuda.is_available() else "cpu", help="where the tensors live before saving"
    )
    args = parser.parse_args(argv)

    data = os.urandom(512 * 2**20)
    xxh = _throughput(lambda b: xxhash.xxh3_128(b).digest(), data)
    blake = _throughput(lambda b: hashlib.blake2b(b).digest(), data)
    print(f"in memory, one core: xxh3_128 {xxh:.1f} GB/s, blake2b {blake:.2f} GB/s")

    numel = int(args.gib * 2**30 / 4)
    per = 2**28  # 1 GiB tensors, like an 8B model's largest shards
    sizes = [min(per, numel - start) for start in range(0, numel, per)]
    state = {f"t{i}": torch.randn(n, device=args.device) for i, n in enumerate(sizes)}
    nbytes = sum(t.numel() * 4 for t in state.values())
    shutil.rmtree(args.dir, ignore_errors=True)
    began = time.perf_counter()
    dcp.save(state, checkpoint_id=args.dir, no_dist=True)
    save_s = time.perf_counter() - began
    del state
    began = time.perf_counter()
    write_manifest(args.dir, 0)
    hash_s = time.perf_counter() - began
    began = time.perf_counter()
    problems, unverified = verify_share(args.dir, 0, 1)
    warm_s = time.perf_counter() - began
    _drop_cache(args.dir)
    began = time.perf_counter()
    problems_cold, _ = verify_share(args.dir, 0, 1)
    cold_s = time.perf_counter() - began
    files = len(checkpoint_files(args.dir))
    shutil.rmtree(args.dir, ignore_errors=True)
    assert not problems and not unverified and not problems_cold, (problems, unverified, problems_cold)

    gb = nbytes / 1e9
    print(f"one rank's share: {gb:.1f} GB in {files} files, from {args.device}")
    print(f"  DCP save (fsync):             {save_s:6.1f} s  {gb / save_s:5.2f} GB/s")
    ratio = hash_s / save_s
    print(f"  checksums after the save:     {hash_s:6.1f} s  {gb / hash_s:5.2f} GB/s  ({ratio:.2f}x the save)")
    print(f"  verify, files in page cache:  {warm_s:6.1f} s  {gb / warm_s:5.2f} GB/s")
    print(f"  verify, page cache dropped:   {cold_s:6.1f} s  {gb / cold_s:5.2f} GB/s")


if __name__ == "__main__":
    main()
