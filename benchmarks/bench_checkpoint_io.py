"""How fast one rank saves and loads its checkpoint share with DCP, by the writer's settings, side by side.

python -m benchmarks.bench_checkpoint_io [--gib 12] [--dir /tmp/bench-ckpt] [--threads 1,4,8] [--device cuda]

A run's save is DCP's file system writer over the rank's state (fp32 tensors on the GPU). One GPU of the
preflight saves 45 GB a checkpoint, a rank of an 8-GPU 8B run 16 GB, and the job waits for it. This
saves `--gib` of fp32 tensors (1 GiB each, the size of an 8B model's largest) from `--device`:
  - with torch.save's CRC32 of each record, as torchtitan saves (one writer thread);
  - without it, as our checkpoint manager saves (`without_torch_crc32`), for each `--threads`;
and loads each back into tensors on the device (the resume's path), checking the values. Each row gives
seconds and GB/s, and the ratio to the first row.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import time

import torch
import torch.distributed.checkpoint as dcp

from mhar_titan.components.checksums import without_torch_crc32


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=12.0, help="bytes one rank saves, in GiB")
    parser.add_argument("--dir", default="/tmp/bench-ckpt", help="where to save (removed before and after)")
    parser.add_argument("--threads", default="1,4,8", help="writer threads to try without the CRC32")
    parser.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="where the tensors live (default: cuda if any)",
    )
    args = parser.parse_args(argv)
    try:
        threads = [int(n) for n in args.threads.split(",")]
    except ValueError:
        parser.error(f"--threads {args.threads!r}: comma-separated positive integers, e.g. 1,4,8")
    if not threads or min(threads) < 1 or args.gib <= 0:
        parser.error(f"--threads {args.threads!r} and --gib {args.gib}: positive numbers")

    numel = int(args.gib * 2**30 / 4)
    per = 2**28
    gen = torch.Generator(device=args.device).manual_seed(0)
    state = {
        f"t{i}": torch.rand(min(per, numel - s), device=args.device, generator=gen)
        for i, s in enumerate(range(0, numel, per))
    }
    gb = sum(t.numel() * 4 for t in state.values()) / 1e9
    cases = [("CRC32 (torch's default)", 1, contextlib.nullcontext)]
    cases += [("no CRC32 (ours)", n, without_torch_crc32) for n in threads]
    print(f"one rank's share: {gb:.1f} GB of fp32 in {len(state)} tensors on {args.device}, to {args.dir}")
    print(f"{'save':28s} {'threads':>7s} {'save s':>7s} {'GB/s':>6s} {'x':>5s} {'load s':>7s} {'GB/s':>6s} {'x':>5s}")
    first = None
    for name, threads, crc in cases:
        shutil.rmtree(args.dir, ignore_errors=True)
        _sync(args.device)
        began = time.perf_counter()
        with crc():
            dcp.save(state, storage_writer=dcp.FileSystemWriter(args.dir, thread_count=threads), no_dist=True)
        save_s = time.perf_counter() - began
        back = {k: torch.empty_like(v) for k, v in state.items()}
        began = time.perf_counter()
        dcp.load(back, checkpoint_id=args.dir, no_dist=True)
        _sync(args.device)
        load_s = time.perf_counter() - began
        if not all(torch.equal(back[k], state[k]) for k in state):
            raise SystemExit(f"{name}, {threads} threads: the loaded tensors differ from the saved ones")
        del back
        first = first or (save_s, load_s)
        print(
            f"{name:28s} {threads:7d} {save_s:7.1f} {gb / save_s:6.2f} {first[0] / save_s:5.2f} "
            f"{load_s:7.1f} {gb / load_s:6.2f} {first[1] / load_s:5.2f}"
        )
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
