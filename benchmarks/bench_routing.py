"""Routing cost of one 8B microbatch on a GPU: the fused kernels' two paths vs torch.compile vs eager, in one run.

The 8B geometry of docs/design.md section 2.7: B=2, T=4096, d=4096, H=8, 32 layers x 2
sites in 8 blocks of 4 layers, so the 64 calls route over 1..8 sources (plus
the null source), 288 source reads in all. Every call is made as the model's RoutingSite
makes it: site(sources) -> gate * R (the block adds its stream input inside its compiled
body), parameters held by the site, sources in one list, marked with `routing_source`,
outside any activation checkpoint (the model's AC wraps the blocks' bodies, not the routing).
Rows, each one path of kernels.routing:
- triton (the headline): the eager autograd.Function over a block's sites, the path the training step takes
  (compiled or not): it keeps references to its inputs only, sums marked sources' gradients
  in place and serves up to 4 calls over the same sources with one mix pass;
- triton_op: the custom op `torch.ops.mhar.route_fwd` (for graphs that compile the routing);
- compile, eager: the torch reference, compiled and not, each call checkpointed on its own as
  the model does for that backend under activation checkpointing (it saves its intermediates), in
  the forward with grad as in the forward and backward.
Prints the forward's ms without grad (validation, evaluation) and with grad (training), fwd+bwd
ms, the peak memory over the three, speedups, and the forward's achieved bandwidth against a device-to-device copy
measured in the same run; then, per triton arm, each pass's GPU time and share of copy bandwidth
(benchmarks.routing_bytes counts the least bytes); then a sweep over N and d for a single call (custom op path).

    python -m benchmarks.bench_routing            (make bench-kernels)
    python -m benchmarks.bench_routing --max-memory-gib 80      (as an 80 GB H100 holds it)
"""

from __future__ import annotations

import argparse
import collections
import functools
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity
from torch.profiler import profile as torch_profile
from torch.utils.checkpoint import checkpoint

from benchmarks.routing_bytes import KINDS, PASSES, pass_bytes
from benchmarks.routing_cases import (
    ARMS,
    DTYPE,
    GROUPED,
    SOURCE_BACKEND,
    UNWRAPPED,
    Microbatch,
    call_site,
    copy_bandwidth,
    route_fns,
    timed,
)
from benchmarks.routing_tune import TUNE_KERNELS, tune
from kernels.triton.launch import DEFAULT_TABLES


def bench_microbatch(args, bw: float) -> list[dict]:
    mb = Microbatch(args.batch, args.seq, args.dim, args.layers, args.blocks)
    rows = []
    fns = {name: fn for name, fn in route_fns(args.heads, 1e-5).items() if name in args.arms.split(",")}
    for name, fn in fns.items():
        reps = 3 if name == "eager" else args.reps
        grouping = GROUPED.get(name)
        backend, wrapped = SOURCE_BACKEND[name], name not in UNWRAPPED
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fwd = timed(lambda fn=fn, g=grouping: mb.forward(fn, grouping=g), reps)
        fwd_grad = timed(lambda fn=fn, g=grouping, w=wrapped: mb.forward(fn, grad=True, grouping=g, wrapped=w), reps)
        fwd_bwd = timed(
            lambda fn=fn, b=backend, w=wrapped, g=grouping: mb.forward_backward(fn, b, wrapped=w, grouping=g), reps
        )
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30  # over the arm's three timings
        rows.append({"backend": name, "fwd_ms": fwd, "fwd_grad_ms": fwd_grad, "fwd_bwd_ms": fwd_bwd, "peak_gib": peak})
    ref = {r["backend"]: r for r in rows}
    for r in rows:
        r["speedup_vs_compile"] = ref["compile"]["fwd_bwd_ms"] / r["fwd_bwd_ms"] if "compile" in ref else float("nan")
        grouping = GROUPED.get(r["backend"])
        least = mb.bytes_grouped[grouping] if grouping else mb.bytes_fwd
        r["fwd_bw_frac"] = least / (r["fwd_ms"] * 1e-3) / bw
    print(f"\n8B microbatch: B={args.batch} T={args.seq} d={args.dim} H={args.heads}, {len(mb.calls)} calls, ")
    print(
        f"forward moves at least {mb.bytes_fwd / 1e9:.1f} GB one call per site, "
        f"{mb.bytes_grouped['layer'] / 1e9:.1f} GB a layer's two sites in one pass, "
        f"{mb.bytes_grouped['block'] / 1e9:.1f} GB a block's {mb.per_block}; "
        f"copy bandwidth {bw / 1e12:.2f} TB/s"
    )
    print("headline: triton, the path the training step takes")
    print(
        "| backend | path | fwd ms, no grad | fwd ms, grad | no grad / grad | fwd+bwd ms | peak GiB "
        "| fwd+bwd vs compile | fwd bw / copy bw |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['backend']} | {ARMS[r['backend']]} | {r['fwd_ms']:.1f} | {r['fwd_grad_ms']:.1f} | "
            f"{r['fwd_ms'] / r['fwd_grad_ms']:.2f} | {r['fwd_bwd_ms']:.1f} | {r['peak_gib']:.2f} | "
            f"{r['speedup_vs_compile']:.2f}x | {r['fwd_bw_frac']:.0%} |"
        )
    return rows


def pass_table(args, bw: float) -> None:
    """Per triton arm asked for, each pass's kernels over one microbatch fwd+bwd: launches (the byte model's and
    the profiler's), GPU time, least bytes (benchmarks.routing_bytes) and their share of copy bandwidth."""
    arms = [a for a in args.arms.split(",") if a in ("triton", "triton_layer", "triton_site")]
    if not arms:
        return
    mb = Microbatch(args.batch, args.seq, args.dim, args.layers, args.blocks)
    m, d = mb.grad_out.numel() // args.dim, args.dim
    print(f"\nEach pass of one microbatch fwd+bwd (GPU time profiled, idle GPU); copy bandwidth {bw / 1e12:.2f} TB/s")
    print("| arm | pass | launches (profiled) | GPU ms | GB | share of copy bw |")
    print("|---|---|---|---|---|---|")
    for arm in arms:
        grouping, fn = GROUPED.get(arm), route_fns(args.heads, 1e-5)[arm]
        mb.forward_backward(fn, SOURCE_BACKEND[arm], grouping=grouping)  # compiled and warm
        torch.cuda.synchronize()
        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            mb.forward_backward(fn, SOURCE_BACKEND[arm], grouping=grouping)
            torch.cuda.synchronize()
        ms, seen = collections.Counter(), collections.Counter()
        for event in prof.key_averages():
            if event.key in KINDS:
                ms[KINDS[event.key]] += event.self_device_time_total / 1e3
                seen[KINDS[event.key]] += event.count
        model = pass_bytes(mb.call_shapes(grouping), m, d, args.heads, mb.grad_out.element_size(), DEFAULT_TABLES)
        for kind in PASSES:
            launches, nbytes = model[kind]
            share = f"{nbytes / (ms[kind] * 1e-3) / bw:.0%}" if ms[kind] else "-"
            print(f"| {arm} | {kind} | {launches} ({seen[kind]}) | {ms[kind]:.2f} | {nbytes / 1e9:.2f} | {share} |")


def bench_sweep(args, bw: float) -> None:
    rows = args.batch * args.seq
    print(f"\nOne call, B*T={rows} rows, H={args.heads}: triton_op ({ARMS['triton_op']}) vs torch.compile")
    print("| N | d | triton_op fwd ms | fwd bw / copy bw | triton_op fwd+bwd ms | compile fwd+bwd ms | speedup |")
    print("|---|---|---|---|---|---|---|")
    fns = route_fns(args.heads, 1e-5)
    for d in (2048, 4096, 8192):
        for n in (2, 5, 9):
            sweep_case(fns, args, bw, d, n)


def sweep_case(fns: dict[str, Callable], args, bw: float, d: int, n: int) -> None:
    dev = {"device": "cuda", "dtype": DTYPE}
    srcs = [torch.randn(args.batch, args.seq, d, **dev).requires_grad_() for _ in range(n - 1)]
    params = [torch.randn(d, **dev).requires_grad_() for _ in range(3)] + [torch.randn(1, **dev).requires_grad_()]
    dout = torch.randn_like(srcs[0])

    def fwd(fn):
        with torch.no_grad():
            fn(*params, *srcs)

    def fwd_bwd(name):
        site = functools.partial(call_site, fns[name], params)
        out = site(srcs) if name in UNWRAPPED else checkpoint(site, srcs, use_reentrant=False)
        out.backward(dout)

    t_fwd = timed(lambda: fwd(fns["triton_op"]), args.reps * 4)
    t_tri = timed(lambda: fwd_bwd("triton_op"), args.reps * 4)
    t_cmp = timed(lambda: fwd_bwd("compile"), args.reps * 4)
    frac = n * dout.numel() * dout.element_size() / (t_fwd * 1e-3) / bw
    print(f"| {n} | {d} | {t_fwd:.3f} | {frac:.0%} | {t_tri:.3f} | {t_cmp:.3f} | {t_cmp / t_tri:.2f}x |")


def profile(args) -> None:
    """Where one triton arm's microbatch fwd+bwd time goes: top GPU kernels, and CPU time."""
    arm = args.profile
    print(f"profiling {arm}: {ARMS[arm]}")
    mb = Microbatch(args.batch, args.seq, args.dim, args.layers, args.blocks)
    fn = route_fns(args.heads, 1e-5)[arm]
    mb.forward_backward(fn, SOURCE_BACKEND[arm], grouping=GROUPED.get(arm))
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        mb.forward_backward(fn, SOURCE_BACKEND[arm], grouping=GROUPED.get(arm))
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=60))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=2, help="sequences per microbatch (B)")
    parser.add_argument("--seq", type=int, default=4096, help="tokens per sequence (T)")
    parser.add_argument("--dim", type=int, default=4096, help="model width d")
    parser.add_argument("--heads", type=int, default=8, help="routing heads H")
    parser.add_argument("--layers", type=int, default=32, help="layers: two routing sites each")
    parser.add_argument("--blocks", type=int, default=8, help="MHAR blocks: the sources a site reads grow by block")
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions (the median is printed)")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"microbatch rows to run, of {', '.join(ARMS)}")
    parser.add_argument(
        "--max-memory-gib",
        type=float,
        default=None,
        help="cap this process's GPU memory (e.g. 80 on an H200 to check an 80 GB H100's fit)",
    )
    parser.add_argument("--no-sweep", action="store_true", help="skip the single-call sweep over N and d")
    parser.add_argument("--sweep-only", action="store_true", help="run only the single-call sweep")
    parser.add_argument(
        "--profile",
        nargs="?",
        const="triton",
        choices=("triton_op", "triton", "triton_layer", "triton_site"),
        help="profile this arm's microbatch instead (default triton, the training step's path)",
    )
    parser.add_argument(
        "--tune",
        nargs="?",
        const="fwd,bwd,stats,group,finish",
        help=f"time launch shapes of these kernels ({','.join(TUNE_KERNELS)}) instead",
    )
    args = parser.parse_args()
    unknown = [k for k in (args.tune or "").split(",") if args.tune and k not in TUNE_KERNELS]
    if unknown:
        parser.error(f"--tune: unknown {unknown}; choose from {', '.join(TUNE_KERNELS)}")
    unknown = [a for a in args.arms.split(",") if a not in ARMS]
    if unknown:
        parser.error(f"--arms: unknown {unknown}; choose from {', '.join(ARMS)}")
    if not torch.cuda.is_available():
        raise SystemExit("bench_routing needs a CUDA GPU")
    torch.manual_seed(0)
    total = torch.cuda.get_device_properties(0).total_memory
    if args.max_memory_gib is not None:
        if not 0 < args.max_memory_gib * 2**30 <= total:
            parser.error(f"--max-memory-gib {args.max_memory_gib}: between 0 and this GPU's {total / 2**30:.1f}")
        torch.cuda.set_per_process_memory_fraction(args.max_memory_gib * 2**30 / total)
    cap = f", memory capped at {args.max_memory_gib} GiB" if args.max_memory_gib is not None else ""
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}{cap}")
    if args.profile:
        return profile(args)
    bw = copy_bandwidth()
    if args.tune:
        return tune(args, bw)
    if not args.sweep_only:
        bench_microbatch(args, bw)
        pass_table(args, bw)
    if not args.no_sweep:
        bench_sweep(args, bw)


if __name__ == "__main__":
    main()
