"""The preflight's probe: a torchrun worker that checks, on every rank, what a long pair will run on.

    torchrun --standalone --nnodes 1 --nproc-per-node N -m mhar_titan.preflight.probe --out DIR \\
        --dim D --num-heads H --max-sources S --tokens T [--gemm-hidden F]

Each rank joins the process group (nccl on its GPU, LOCAL_RANK; gloo on CPU, where the caller sets
TRITON_INTERPRET=1 so the kernels run in Triton's interpreter) and records
a. its environment: versions, driver, GPU, memory, host (`environment`);
b. the fused routing kernels against the torch reference at the run's geometry (kernel_check.py);
c. a GEMM's TFLOP/s and the collectives' bandwidth (hardware.py);
and, with --attention, whether the attention backward is repeatable bit for bit (determinism.py, stage d's reading);
in DIR/rank-R.json (written whole or not at all, after each section). Then every rank meets at a barrier, so that when
torchrun returns every file is there. An exception is recorded in the file ("error", and in the
stage's section) and the rank exits 1. The judging is probe_report.py's (re-exported here for the
driver): `probe_stages` reads the files, so a failed rank still shows in the table with its error,
and `gpu_memory_bytes` gives the plan its memory per GPU.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from data.atomic import write_text
from mhar_titan.model.sources import BASE_SOURCES
from mhar_titan.preflight.determinism import attention_repeatable
from mhar_titan.preflight.hardware import measure
from mhar_titan.preflight.kernel_check import check_kernels
from mhar_titan.preflight.probe_report import gpu_memory_bytes, probe_stages

__all__ = ["environment", "gpu_memory_bytes", "init", "main", "parse_args", "probe_stages", "run"]

# Long enough for the slowest rank's first kernel compiles (about a minute on a GPU) before the
# hardware stage's first collective, short enough that a dead rank ends the job.
PG_TIMEOUT = datetime.timedelta(minutes=15)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m mhar_titan.preflight.probe",
        description="One rank of the preflight probe (run under torchrun): environment, routing kernels, hardware.",
    )
    parser.add_argument("--out", type=Path, required=True, help="folder for rank-R.json")
    parser.add_argument("--dim", type=int, required=True, help="the model width")
    parser.add_argument("--num-heads", type=int, required=True, help="routing heads ([mhar] num_heads)")
    parser.add_argument(
        "--max-sources",
        type=int,
        required=True,
        help="the most sources a site reads, the null included (SourceLayout.max_sources, [mhar] num_blocks + 1: "
        f"9 for the marin8b configs); every count from {len(BASE_SOURCES)} (the null and the embedding) is checked",
    )
    parser.add_argument(
        "--sites", type=int, default=2, help="routing sites a checked call routes together (a block's: 2 per layer)"
    )
    parser.add_argument("--tokens", type=int, required=True, help="tokens per checked call and GEMM rows")
    parser.add_argument(
        "--attention",
        default=None,
        help="BATCH,HEADS,SEQ,HEAD_DIM of the model's attention: checks whether its backward is repeatable bit for "
        "bit (determinism.py); default: not checked",
    )
    parser.add_argument(
        "--block-elements",
        type=int,
        default=None,
        help="parameters of one transformer block, the collectives' size (default: 4 dim^2 + 3 dim x gemm-hidden)",
    )
    parser.add_argument(
        "--gemm-hidden", type=int, default=None, help="GEMM output width (default: 14336 on a GPU, 3.5 x dim on CPU)"
    )
    args = parser.parse_args(argv)
    for name in ("dim", "num_heads", "tokens", "sites"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    if args.max_sources < len(BASE_SOURCES):
        parser.error(f"--max-sources {args.max_sources}: at least {len(BASE_SOURCES)} (the null and the embedding)")
    if args.dim % args.num_heads:
        parser.error(f"--num-heads {args.num_heads} must divide --dim {args.dim}")
    if args.attention is not None:
        try:
            args.attention = [int(x) for x in args.attention.split(",")]
        except ValueError:
            args.attention = []
        if len(args.attention) != 4 or min(args.attention) < 1:
            parser.error("--attention: four positive integers, BATCH,HEADS,SEQ,HEAD_DIM")
    return args


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _driver_version(local_rank: int) -> tuple[str | None, str | None]:
    """(The NVIDIA driver's version, where it came from): nvidia-smi's, else the CUDA driver API
    version torch reports (e.g. 13000 for CUDA 13.0)."""
    try:
        query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader", "-i", str(local_rank)]
        done = subprocess.run(query, capture_output=True, text=True, timeout=30, check=True)
        if done.stdout.strip():
            return done.stdout.strip().splitlines()[0], "nvidia-smi"
    except (OSError, subprocess.SubprocessError):
        pass
    get = getattr(torch._C, "_cuda_getDriverVersion", None)
    return (str(get()), "CUDA driver API (torch)") if get else (None, None)


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _host_memory() -> tuple[int, int]:
    """(Total, available) bytes of host memory: /proc/meminfo's MemAvailable where there is one."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return total, int(line.split()[1]) * 1024
    except OSError:
        pass
    return total, os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def environment(rank: int, local_rank: int, world_size: int, device: torch.device) -> dict[str, Any]:
    """Stage a on this rank: what the job will run on (versions by importlib.metadata)."""
    start = time.perf_counter()
    env: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": _version("torch") or torch.__version__,
        "torch_cuda": torch.version.cuda,
        "triton": _version("triton"),
        "torchtitan": _version("torchtitan"),
        "device": device.type,
        "hostname": socket.gethostname(),
        "rank": rank,
        "local_rank": local_rank,
        "world_size": world_size,
        "triton_interpret": os.environ.get("TRITON_INTERPRET"),
    }
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        driver, source = _driver_version(local_rank)
        env |= {
            "driver": driver,
            "driver_source": source,
            "gpu_name": torch.cuda.get_device_name(device),
            "memory_kind": "gpu",
            "memory_total_bytes": total,
            "memory_free_bytes": free,
        }
    else:
        total, free = _host_memory()
        env |= {
            "driver": None,
            "driver_source": None,
            "gpu_name": None,
            "cpu_name": _cpu_name(),
            "memory_kind": "host",
            "memory_total_bytes": total,
            "memory_free_bytes": free,
        }
    env["seconds"] = time.perf_counter() - start
    return env


def init(local_rank: int) -> torch.device:
    """The process group: nccl on this rank's GPU, gloo on CPU."""
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", timeout=PG_TIMEOUT, device_id=device)
        return device
    dist.init_process_group("gloo", timeout=PG_TIMEOUT)
    return torch.device("cpu")


def _section(record: dict[str, Any], name: str, fn: Callable[[], dict[str, Any]]) -> None:
    """Run one stage's part on this rank; an exception becomes the section's "error" (and the rank's)."""
    start = time.perf_counter()
    try:
        record[name] = fn()
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
        record[name] = {"error": error, "traceback": traceback.format_exc(), "seconds": time.perf_counter() - start}
        record.setdefault("error", f"{name}: {error}")


def run(args: argparse.Namespace) -> int:
    """This rank's probe: the three sections, the file, the barrier; 0 when nothing raised."""
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"rank-{rank}.json"
    record: dict[str, Any] = {
        "rank": rank,
        "local_rank": local_rank,
        "world_size": world_size,
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
    }
    start = time.perf_counter()
    try:
        device = init(local_rank)
    except Exception as e:
        record["error"] = f"process group: {type(e).__name__}: {e}"
        record["traceback"] = traceback.format_exc()
        write_text(path, json.dumps(record, indent=1))
        return 1
    record["init_seconds"] = time.perf_counter() - start
    sections = {
        "environment": lambda: environment(rank, local_rank, world_size, device),
        "kernels": lambda: check_kernels(args.dim, args.num_heads, args.max_sources, args.tokens, device, args.sites),
        "hardware": lambda: measure(args.tokens, args.dim, args.gemm_hidden, device, args.block_elements),
    }
    if args.attention:
        sections["attention"] = lambda: attention_repeatable(*args.attention, device)
    for name, fn in sections.items():
        _section(record, name, fn)
        record["seconds"] = time.perf_counter() - start
        # after each section: a rank that torchrun stops (another rank died) keeps what it found
        write_text(path, json.dumps(record, indent=1))
    try:
        dist.barrier()  # every rank's file is written before any rank (rank 0 first) exits
    except Exception as e:
        print(f"preflight probe rank {rank}: final barrier: {type(e).__name__}: {e}", file=sys.stderr)
    finally:
        dist.destroy_process_group()
    if "error" in record:
        print(f"preflight probe rank {rank}: {record['error']}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
