"""How fast one rank saves and loads its checkpoint share with DCP, by the writer's settings, side by side.

python -m benchmarks.bench_checkpoint_io [--gib 12] [--tensor-mib 1024] [--dir /tmp/bench-ckpt] [--threads 1,4,8]
    [--readers 1,8] [--no-load] [--d2h] [--device cuda]

A run's save is DCP's file system writer over the rank's state (fp32 tensors on the GPU). One GPU of the
preflight saves 45 GB a checkpoint, a rank of an 8-GPU 8B run 16 GB, and the job waits for it. This
saves `--gib` of fp32 tensors (`--tensor-mib` each: 1 GiB is about an 8B model's largest, 224 MiB its MLP
matrices) from `--device`:
  - with torch.save's CRC32 of each record, as torchtitan saves (one writer thread);
  - without it (`without_torch_crc32`), with torch's writer for each `--threads`;
  - without it, as our checkpoint manager saves: `StreamingFileSystemWriter`, each record written as it is
    copied, GPU tensors through reused page-locked buffers (twice: the first save allocates the buffers);
and loads each back into tensors on the device (the resume's path), checking the values: with torch's
reader, and with ours (`ParallelFileSystemReader`) for each `--readers` thread count. Each row gives seconds
and GB/s, and the ratio to the first row.

`--d2h` times instead the pieces of one tensor's save (`--tensor-mib`, on the GPU): its copy to fresh and to
reused page-locked memory (`.to("cpu", non_blocking=True)`, as torch's writer copies), to pageable memory, into
a page-locked buffer, and its write to `--dir` raw and through torch.save.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import time

import torch
import torch.distributed.checkpoint as dcp

from mhar_titan.components.checkpoint.checksums import without_torch_crc32
from mhar_titan.components.checkpoint.dcp_io import ParallelFileSystemReader, PinnedStaging, StreamingFileSystemWriter


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _args(argv: list[str] | None) -> tuple[argparse.Namespace, list[int], list[int]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=12.0, help="bytes one rank saves, in GiB")
    parser.add_argument("--dir", default="/tmp/bench-ckpt", help="where to save (removed before and after)")
    parser.add_argument("--tensor-mib", type=int, default=1024, help="the size of each tensor, in MiB")
    parser.add_argument("--threads", default="1,4,8", help="writer threads to try without the CRC32")
    parser.add_argument("--readers", default="1,8", help="threads of our reader to load each save with")
    parser.add_argument("--no-load", action="store_true", help="time the saves only")
    parser.add_argument("--d2h", action="store_true", help="time the pieces of one tensor's save instead")
    parser.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="where the tensors live (default: cuda if any)",
    )
    args = parser.parse_args(argv)
    try:
        threads = [int(n) for n in args.threads.split(",")]
        readers = [int(n) for n in args.readers.split(",")]
    except ValueError:
        parser.error(f"--threads {args.threads!r}, --readers {args.readers!r}: comma-separated integers, e.g. 1,4,8")
    if not threads or not readers or min(threads + readers) < 1 or args.gib <= 0 or args.tensor_mib < 1:
        parser.error(f"--threads, --readers, --gib and --tensor-mib: positive numbers (--gib {args.gib})")
    return args, threads, readers


def main(argv: list[str] | None = None) -> None:
    args, threads, readers = _args(argv)
    if args.d2h:
        return _pieces(args.tensor_mib, args.device, args.dir)
    numel = int(args.gib * 2**30 / 4)
    per = args.tensor_mib * 2**18
    gen = torch.Generator(device=args.device).manual_seed(0)
    state = {
        f"t{i}": torch.rand(min(per, numel - s), device=args.device, generator=gen)
        for i, s in enumerate(range(0, numel, per))
    }
    gb = sum(t.numel() * 4 for t in state.values()) / 1e9
    staging = PinnedStaging()

    def torch_writer(n: int) -> dcp.FileSystemWriter:
        return dcp.FileSystemWriter(args.dir, thread_count=n)

    cases = [("CRC32 (torch's default)", 1, contextlib.nullcontext, torch_writer)]
    cases += [("no CRC32", n, without_torch_crc32, torch_writer) for n in threads]
    ours = [lambda _: StreamingFileSystemWriter(args.dir, staging)] * 2
    cases += [(f"ours, save {i + 1}", 1, without_torch_crc32, w) for i, w in enumerate(ours)]
    print(f"one rank's share: {gb:.1f} GB of fp32 in {len(state)} tensors on {args.device}, to {args.dir}")
    loads = [("torch's reader", lambda: dcp.FileSystemReader(args.dir))]
    loads += [(f"ours, {n} threads", lambda n=n: ParallelFileSystemReader(args.dir, n)) for n in readers]
    print(
        f"{'save':24s} {'threads':>7s} {'save s':>7s} {'GB/s':>6s} {'x':>5s}  {'load':18s} {'load s':>7s} "
        f"{'GB/s':>6s} {'x':>5s}"
    )
    first = None
    for name, threads, crc, writer in cases:
        shutil.rmtree(args.dir, ignore_errors=True)
        _sync(args.device)
        began = time.perf_counter()
        with crc():
            dcp.save(state, storage_writer=writer(threads), no_dist=True)
        save_s = time.perf_counter() - began
        if args.no_load:
            first = first or (save_s, 1.0)
            print(f"{name:24s} {threads:7d} {save_s:7.1f} {gb / save_s:6.2f} {first[0] / save_s:5.2f}")
        for reader_name, reader in [] if args.no_load else loads:
            load_s = _load(state, reader(), args.device, f"{name}, {threads} threads, {reader_name}")
            first = first or (save_s, load_s)
            print(
                f"{name:24s} {threads:7d} {save_s:7.1f} {gb / save_s:6.2f} {first[0] / save_s:5.2f}  "
                f"{reader_name:18s} {load_s:7.1f} {gb / load_s:6.2f} {first[1] / load_s:5.2f}"
            )
    shutil.rmtree(args.dir, ignore_errors=True)


def _pieces(mib: int, device: str, folder: str) -> None:
    """One tensor's copy to the host and write, each piece timed on its own."""
    tensor = torch.rand(mib * 2**18, device=device)
    gb = tensor.numel() * 4 / 1e9
    pinned = torch.empty(tensor.shape, pin_memory=device.startswith("cuda"))
    pieces = [
        ("to(cpu, non_blocking), first", lambda: tensor.to("cpu", non_blocking=True)),
        ("to(cpu, non_blocking), again", lambda: tensor.to("cpu", non_blocking=True)),
        ("cpu(), pageable", lambda: tensor.cpu()),
        ("cpu(), pageable, again", lambda: tensor.cpu()),
        ("copy into a page-locked buffer", lambda: pinned.copy_(tensor)),
        ("the same, again", lambda: pinned.copy_(tensor)),
    ]
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "piece")

    def raw() -> None:
        with open(path, "wb") as f:
            f.write(memoryview(pinned.numpy()).cast("B"))

    pieces += [(f"write to {folder}, raw", raw), (f"write to {folder}, torch.save", lambda: torch.save(pinned, path))]
    print(f"one tensor of {gb:.2f} GB of fp32 on {device}")
    for name, piece in pieces:
        _sync(device)
        began = time.perf_counter()
        piece()
        _sync(device)
        print(f"{name:40s} {time.perf_counter() - began:7.3f} s")
    os.remove(path)


def _load(state: dict[str, torch.Tensor], reader: dcp.FileSystemReader, device: str, case: str) -> float:
    """Seconds to read the save back into fresh tensors on the device; the values are checked."""
    back = {k: torch.empty_like(v) for k, v in state.items()}
    _sync(device)
    began = time.perf_counter()
    dcp.load(back, storage_reader=reader, no_dist=True)
    _sync(device)
    seconds = time.perf_counter() - began
    if not all(torch.equal(back[k], state[k]) for k in state):
        raise SystemExit(f"{case}: the loaded tensors differ from the saved ones")
    return seconds


if __name__ == "__main__":
    main()
