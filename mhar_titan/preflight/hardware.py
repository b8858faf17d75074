"""Stage c of the preflight probe: what this rank's device and the world's links deliver, before a long pair.

- A GEMM at the 8B MLP shapes, tokens x dim @ dim x gemm_hidden (bf16 on a GPU, timed with CUDA
  events after warm-up; fp32 on CPU, timed with the host clock): TFLOP/s, 2 * T * D * F flops.
- The two collectives of FSDP2's step, over the whole world: all-gather of one transformer
  block's parameters in bf16 (--block-elements, the model's count, from the driver; each rank holding
  1 / n of them) and reduce-scatter of their fp32 gradients. Bandwidths follow nccl-tests:
  algbw = the full tensor's bytes / time, busbw = algbw * (n - 1) / n (0 on one rank, where the
  collectives move nothing and are timed only to show they run).

Each rank reports its own times; judging them across ranks is probe_report.py's (pure) job.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

GPU_GEMM_HIDDEN = 14336  # Llama-3.1 8B's MLP width
CPU_HIDDEN_RATIO = 3.5  # the same ratio to the width (14336 / 4096) on CPU's small widths
WARMUP = {"cuda": 5, "cpu": 2}
ITERS = {"cuda": 20, "cpu": 5}
# torch 2.13 deprecates the *_tensor names for the *_single ones (same arguments); 2.11 has only the former
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def default_gemm_hidden(dim: int, device: torch.device) -> int:
    """14336 on a GPU (the 8B MLP); on CPU 3.5 x the (small) width given."""
    return GPU_GEMM_HIDDEN if device.type == "cuda" else max(1, round(CPU_HIDDEN_RATIO * dim))


def block_elements(dim: int, gemm_hidden: int) -> int:
    """About one transformer block's parameters without grouped-query attention: four dim x dim attention
    projections, three MLP matrices (the driver passes the model's exact count, --block-elements)."""
    return dim * dim * 4 + 3 * dim * gemm_hidden


def timed(fn: Callable[[], Any], device: torch.device, warmup: int, iters: int) -> float:
    """Seconds per call of `fn` after `warmup` calls: CUDA events around `iters` calls on a GPU,
    the host clock on CPU (where every op is synchronous)."""
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / iters
    begin = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - begin) / iters


def gemm(tokens: int, dim: int, gemm_hidden: int, device: torch.device) -> dict[str, Any]:
    """tokens x dim @ dim x gemm_hidden on this rank's device: seconds per GEMM and TFLOP/s."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(tokens, dim, device=device, dtype=dtype, generator=gen)
    b = torch.randn(dim, gemm_hidden, device=device, dtype=dtype, generator=gen)
    out = torch.empty(tokens, gemm_hidden, device=device, dtype=dtype)
    seconds = timed(lambda: torch.matmul(a, b, out=out), device, WARMUP[device.type], ITERS[device.type])
    flops = 2 * tokens * dim * gemm_hidden
    return {
        "shape": [tokens, dim, gemm_hidden],
        "dtype": str(dtype).removeprefix("torch."),
        "seconds": seconds,
        "tflops": flops / seconds / 1e12,
    }


def collective(name: str, elements: int, device: torch.device) -> dict[str, Any]:
    """All-gather (bf16) or reduce-scatter (fp32) of `elements` over the world: seconds per call, algbw and busbw."""
    world = dist.get_world_size()
    shard = -(-elements // world)  # each rank's part, the total rounded up to a multiple of the world
    total = shard * world
    if name == "all_gather":
        dtype, fn = torch.bfloat16, _ALL_GATHER
        src = torch.ones(shard, device=device, dtype=dtype)
        dst = torch.empty(total, device=device, dtype=dtype)
    else:
        dtype, fn = torch.float32, _REDUCE_SCATTER
        src = torch.ones(total, device=device, dtype=dtype)
        dst = torch.empty(shard, device=device, dtype=dtype)
    dist.barrier()  # the ranks start the timed loop together
    seconds = timed(lambda: fn(dst, src), device, WARMUP[device.type], ITERS[device.type])
    size = total * src.element_size()  # nccl-tests: the full (gathered, or reduced) tensor's bytes
    algbw = size / seconds / 1e9
    return {
        "dtype": str(dtype).removeprefix("torch."),
        "elements": total,
        "bytes": size,
        "seconds": seconds,
        "algbw_gbps": algbw,
        "busbw_gbps": algbw * (world - 1) / world,
        "supported": True,
    }


def measure(
    tokens: int, dim: int, gemm_hidden: int | None, device: torch.device, elements: int | None = None
) -> dict[str, Any]:
    """Stage c on this rank: the GEMM, then both collectives (every rank must call this: they are collective).
    On CPU a collective gloo cannot run is recorded as unsupported, not raised."""
    start = time.perf_counter()
    hidden = gemm_hidden or default_gemm_hidden(dim, device)
    world = dist.get_world_size()
    result: dict[str, Any] = {"device": device.type, "world_size": world, "gemm_hidden": hidden}
    failure = None
    try:
        result["gemm"] = gemm(tokens, dim, hidden, device)
    except Exception as e:  # raised after the ranks agree, so that no other rank waits in a collective
        failure = e
    ready = torch.tensor([0 if failure else 1], device=device, dtype=torch.int32)
    dist.all_reduce(ready, op=dist.ReduceOp.MIN)
    if failure is not None:
        raise failure
    if not ready.item():
        raise RuntimeError("collectives skipped: another rank's GEMM failed (its file says why)")
    elements = elements or block_elements(dim, hidden)
    result["block_elements"] = elements
    for name in ("all_gather", "reduce_scatter"):
        try:
            result[name] = collective(name, elements, device)
        except (RuntimeError, NotImplementedError) as e:
            if device.type == "cuda":
                raise
            result[name] = {"supported": False, "error": f"not supported on CPU (gloo): {type(e).__name__}: {e}"}
    if world == 1:
        result["note"] = "world size 1: the collectives move no data; timed only to show they run"
    result["seconds"] = time.perf_counter() - start
    return result
