"""Routing cost of one 8B microbatch on a GPU: the fused kernels' two paths vs torch.compile vs eager, in one run.

The 8B geometry of docs/design.md section 3.7: B=2, T=4096, d=4096, H=8, 32 layers x 2
sites in 8 blocks of 4 layers, so the 64 calls route over 1..8 sources (plus
the null source), 288 source reads in all. Every call is made as the model's RoutingSite
makes it: site(sources) -> gate * R (the block adds its stream input inside its compiled
body), parameters held by the site, sources in one list, marked with `routing_source`,
outside any activation checkpoint (the model's AC wraps the blocks' bodies, not the routing).
Rows, each one path of kernels.routing:
- triton (the headline): the eager autograd.Function, the path the training step takes
  (compiled or not): it keeps references to its inputs only, sums marked sources' gradients
  in place and serves up to 4 calls over the same sources with one mix pass;
- triton_op: the custom op `torch.ops.mhar.route_fwd` (for graphs that compile the routing);
- compile, eager: the torch reference, compiled and not, each call checkpointed on its own as
  the model does for that backend under activation checkpointing (it saves its intermediates).
Prints the forward's ms without grad (validation, evaluation) and with grad (training), fwd+bwd
ms, peak memory, speedups, and the forward's achieved bandwidth against a device-to-device copy
measured in the same run; then a sweep over N and d for a single call (custom op path).

    python -m benchmarks.bench_routing            (make bench-kernels)
"""

from __future__ import annotations

import argparse
import functools
import gc
import itertools
import statistics
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity
from torch.profiler import profile as torch_profile
from torch.utils.checkpoint import checkpoint
from triton.testing import do_bench

from kernels import MAX_TRITON_SOURCES, route_torch, routing_source
from kernels.triton.autograd import route_eager, route_op
from kernels.triton.host import backward, finish_param_grads, forward, source_rstd, stats
from kernels.triton.launch import DEFAULT_TABLES, LaunchTables

DTYPE = torch.bfloat16


def timed(fn: Callable[[], object], reps: int, warmup: int = 2) -> float:
    """Median milliseconds of fn() over reps, timed with CUDA events after warm-up, with
    Python's garbage collector off while timing (as timeit does): a collection pass in a
    rep is host noise, not the cost of what is timed."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    gc.collect()
    gc.disable()
    try:
        times = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
    finally:
        gc.enable()
    return statistics.median(times)


def copy_bandwidth(nbytes: int = 4 << 30) -> float:
    """Device-to-device copy bandwidth in bytes/s (bytes read + bytes written)."""
    src = torch.randn(nbytes // 2, device="cuda", dtype=DTYPE)
    dst = torch.empty_like(src)
    ms = timed(lambda: dst.copy_(src), reps=20)
    return 2 * nbytes / (ms * 1e-3)


# What each row measures: the routing path, by kernels.routing's backend name.
ARMS = {
    "triton": "eager autograd.Function (the training step's path)",
    "triton_op": "custom op torch.ops.mhar.route_fwd",
    "compile": "torch reference under torch.compile, per-call checkpoint",
    "eager": "torch reference, eager, per-call checkpoint",
}
# The backend name each arm marks its sources for (routing_source)
SOURCE_BACKEND = {"triton_op": "triton_op", "triton": "triton", "compile": "torch", "eager": "torch"}
# Arms whose op saves nothing but references to its inputs: the model runs them unwrapped
UNWRAPPED = ("triton", "triton_op")


def route_fns(num_heads: int, eps: float, tables: LaunchTables | None = None) -> dict[str, Callable]:
    """One site function per arm, site(null, query, norm_weight, gate, *sources) -> gate * R;
    `tables`: the eager triton path's launch shapes (the custom op always takes the default ones)."""
    # torch.compile: one graph per source count, with and without grad: let it keep them all.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)

    def op_fn(null, q, g, gate, *srcs):
        return route_op(None, srcs, null, q, g, gate, num_heads=num_heads, eps=eps)[0]

    def triton_fn(null, q, g, gate, *srcs):
        return route_eager(None, srcs, null, q, g, gate, num_heads=num_heads, eps=eps, tables=tables)[0]

    def torch_fn(null, q, g, gate, *srcs):
        return route_torch(None, srcs, null, q, g, gate, num_heads=num_heads, eps=eps)[0]

    return {
        "triton": triton_fn,
        "triton_op": op_fn,
        "compile": torch.compile(torch_fn, dynamic=False),
        "eager": torch_fn,
    }


def _site(fn: Callable, params: list[torch.Tensor], sources: list[torch.Tensor]) -> torch.Tensor:
    """One routing site, called as the model calls a RoutingSite module, site(sources): its
    parameters are bound, the sources one list."""
    return fn(*params, *sources)


class Microbatch:
    """The 64 routing calls of one 8B microbatch, with random sources and site parameters."""

    def __init__(
        self, B: int, T: int, d: int, num_layers: int, num_blocks: int, device: str = "cuda", dtype: torch.dtype = DTYPE
    ):
        per_block = num_layers // num_blocks
        dev = {"device": device, "dtype": dtype}
        self.sources = [torch.randn(B, T, d, **dev).requires_grad_() for _ in range(num_blocks)]
        self.calls = []  # (n_sources, params)
        for layer in range(num_layers):
            block = layer // per_block
            for _site_index in range(2):
                params = [
                    (0.5 * torch.randn(d, **dev)).requires_grad_(),
                    torch.randn(d, **dev).requires_grad_(),
                    (1 + 0.1 * torch.randn(d, **dev)).requires_grad_(),
                    (0.1 * torch.randn(1, **dev)).requires_grad_(),
                ]
                self.calls.append((1 + block, params))
        self.grad_out = torch.randn(B, T, d, **dev)
        unit = self.grad_out.numel() * self.grad_out.element_size()
        self.bytes_fwd = sum((n + 1) * unit for n, _ in self.calls)  # sources read, output written

    def forward(self, fn: Callable, grad: bool = False) -> None:
        """Every call's forward; with `grad`, as in training (the graph is built, then dropped)."""
        with torch.set_grad_enabled(grad):
            outs = [fn(*params, *self.sources[:n]) for n, params in self.calls]
        del outs

    def leaves(self) -> list[torch.Tensor]:
        return [*self.sources] + [p for _, ps in self.calls for p in ps]

    def forward_backward(self, fn: Callable, backend: str, keep_grads: bool = False, wrapped: bool = False) -> None:
        """Forward and backward of every call; `wrapped`: each call checkpointed on its own."""
        srcs = [routing_source(s, backend) for s in self.sources]
        outs = []
        for n, params in self.calls:
            site = functools.partial(_site, fn, params)
            outs.append(checkpoint(site, srcs[:n], use_reentrant=False) if wrapped else site(srcs[:n]))
        torch.autograd.backward(outs, [self.grad_out] * len(outs))
        if not keep_grads:
            for t in self.leaves():
                t.grad = None


def bench_microbatch(args, bw: float) -> list[dict]:
    mb = Microbatch(args.batch, args.seq, args.dim, args.layers, args.blocks)
    rows = []
    fns = {name: fn for name, fn in route_fns(args.heads, 1e-5).items() if name in args.arms.split(",")}
    for name, fn in fns.items():
        reps = 3 if name == "eager" else args.reps
        fwd = timed(lambda fn=fn: mb.forward(fn), reps)
        fwd_grad = timed(lambda fn=fn: mb.forward(fn, grad=True), reps)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        backend, wrapped = SOURCE_BACKEND[name], name not in UNWRAPPED
        fwd_bwd = timed(lambda fn=fn, b=backend, w=wrapped: mb.forward_backward(fn, b, wrapped=w), reps)
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30
        rows.append({"backend": name, "fwd_ms": fwd, "fwd_grad_ms": fwd_grad, "fwd_bwd_ms": fwd_bwd, "peak_gib": peak})
    ref = {r["backend"]: r for r in rows}
    for r in rows:
        r["speedup_vs_compile"] = ref["compile"]["fwd_bwd_ms"] / r["fwd_bwd_ms"] if "compile" in ref else float("nan")
        r["fwd_bw_frac"] = mb.bytes_fwd / (r["fwd_ms"] * 1e-3) / bw
    print(f"\n8B microbatch: B={args.batch} T={args.seq} d={args.dim} H={args.heads}, {len(mb.calls)} calls, ")
    print(f"forward moves at least {mb.bytes_fwd / 1e9:.1f} GB; copy bandwidth {bw / 1e12:.2f} TB/s")
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
        site = functools.partial(_site, fns[name], params)
        out = site(srcs) if name in UNWRAPPED else checkpoint(site, srcs, use_reentrant=False)
        out.backward(dout)

    t_fwd = timed(lambda: fwd(fns["triton_op"]), args.reps * 4)
    t_tri = timed(lambda: fwd_bwd("triton_op"), args.reps * 4)
    t_cmp = timed(lambda: fwd_bwd("compile"), args.reps * 4)
    frac = n * dout.numel() * dout.element_size() / (t_fwd * 1e-3) / bw
    print(f"| {n} | {d} | {t_fwd:.3f} | {frac:.0%} | {t_tri:.3f} | {t_cmp:.3f} | {t_cmp / t_tri:.2f}x |")


def tune(args, bw: float) -> None:
    """Time launch shapes of each kernel at the 8B width: the forward alone for every number of
    caller sources (its table is keyed by it), and the whole backward while one of its kernels'
    shapes varies, at 2 and 8 caller sources. GPU time of back-to-back calls (Triton's do_bench),
    so the Python launch cost of one call, which CUDA events around it would include, is not.
    Each shape is passed to the kernels' host wrappers as a `LaunchTables` argument."""
    dev = {"device": "cuda", "dtype": DTYPE}
    d = args.dim
    x = torch.randn(args.batch, args.seq, d, **dev)
    z, q, g = (0.5 * torch.randn(d, **dev) for _ in range(3))
    gate = torch.randn(1, **dev)
    dout = torch.randn_like(x)
    unit = x.numel() * x.element_size()
    kernels = args.tune.split(",")
    print("| kernel | sources | launch | ms | bytes / ms vs copy bw |")
    print("|---|---|---|---|---|")

    def fwd(srcs: list[torch.Tensor], tables: LaunchTables, label: str, rstds=()) -> None:
        # as the model calls it: gate * R, without x; `rstds`: the sources' norms, given or not
        ms = do_bench(lambda: forward(None, srcs, z, q, g, gate, args.heads, 1e-5, tables, rstds), warmup=10, rep=50)
        print(f"| fwd | {len(srcs)} | {label} | {ms:.3f} | {(len(srcs) + 1) * unit / (ms * 1e-3) / bw:.0%} |")

    def bwd(srcs: list[torch.Tensor], tables: LaunchTables, label: str) -> None:
        ms = do_bench(lambda: backward(dout, srcs, z, q, g, gate, args.heads, 1e-5, tables), warmup=10, rep=50)
        nbytes = (2 + 3 * len(srcs)) * unit  # dout twice, each source twice, each gradient once
        print(f"| bwd | {len(srcs)} | {label} | {ms:.3f} | {nbytes / (ms * 1e-3) / bw:.0%} |")

    for n in range(1, MAX_TRITON_SOURCES + 1) if "fwd" in kernels else ():
        srcs = [torch.randn_like(x) for _ in range(n)]
        rstds = [source_rstd(s, 1e-5) for s in srcs]  # as for sources marked with routing_source
        for given in (False, True):
            for rows, warps, maxnreg in [
                (1, 4, None),
                (1, 8, None),
                (2, 4, None),
                (2, 8, None),
                (2, 8, 80),
                (2, 16, None),
                (4, 8, None),
            ]:
                shape = {"rows": rows, "warps_per_4096": warps, "maxnreg": maxnreg, "given_rstd": given}
                tables = DEFAULT_TABLES.replace(fwd={n: shape})
                how = "given" if given else "computed"
                label = f"rows {rows}, {warps} warps, registers <= {maxnreg or 'any'}, rstd {how}"
                fwd(srcs, tables, label, rstds)
    for n in range(1, MAX_TRITON_SOURCES + 1) if "fwd_rstd" in kernels else ():
        # the default shapes only, norms given or computed
        srcs = [torch.randn_like(x) for _ in range(n)]
        rstds = [source_rstd(s, 1e-5) for s in srcs]
        for given in (False, True):
            tables = DEFAULT_TABLES.replace(fwd={n: {"given_rstd": given}})
            fwd(srcs, tables, f"default shape, rstd {'given' if given else 'computed'}", rstds)
    for n in (2, 8) if "bwd" in kernels else ():
        srcs = [torch.randn_like(x) for _ in range(n)]
        for rows, warps, maxnreg in itertools.product((16, 32, 64), (8, 16), (None, 128)):
            tables = DEFAULT_TABLES.replace(stats={n: {"rows": rows, "warps_per_4096": warps, "maxnreg": maxnreg}})
            bwd(srcs, tables, f"stats rows {rows}, {warps} warps, registers <= {maxnreg or 'any'}")
        for block_m, block_kc, warps in [(16, 64, 4), (32, 64, 4), (16, 128, 4), (32, 128, 8)]:
            tables = DEFAULT_TABLES.replace(mix={"block_m": block_m, "block_kc": block_kc, "warps": warps})
            bwd(srcs, tables, f"mix {block_m}x{block_kc}, {warps} warps")
    for n in range(1, MAX_TRITON_SOURCES + 1) if "stats" in kernels else ():
        # the stats and finishing kernels alone (what a call's backward runs before its mix)
        srcs = [torch.randn_like(x) for _ in range(n)]
        rstds = [source_rstd(s, 1e-5) for s in srcs]  # as for sources marked with routing_source
        for given, maxnreg in itertools.product((False, True), (None, 128, 168)):
            tables = DEFAULT_TABLES.replace(stats={n: {"maxnreg": maxnreg, "given_rstd": given}})
            ms = do_bench(
                lambda srcs=srcs, rstds=rstds, tables=tables: stats(
                    dout, srcs, z, q, g, gate, args.heads, 1e-5, rstds, tables
                ),
                warmup=10,
                rep=50,
            )
            label = (
                f"rows {tables.stats[n]['rows']}, registers <= {maxnreg or 'any'}, "
                f"rstd {'given' if given else 'computed'}"
            )
            print(f"| stats | {n} | {label} | {ms:.3f} | {(n + 1) * unit / (ms * 1e-3) / bw:.0%} |")
    if "group" in kernels:
        # calls per mix pass: the microbatch's triton loop without the wrapper, GPU-bound in its backward
        mb = Microbatch(args.batch, args.seq, d, args.layers, args.blocks)
        for calls in (1, 2, 4):
            fn = route_fns(args.heads, 1e-5, DEFAULT_TABLES.replace(mix={"calls": calls}))["triton"]
            ms = do_bench(lambda fn=fn: mb.forward_backward(fn, "triton"), warmup=3, rep=200)
            print(f"| microbatch fwd+bwd, no wrapper | 1-8 | mix pass per {calls} calls | {ms:.2f} | |")
    if "finish" in kernels:
        finish(x, z, q, g, gate, args.heads)


def finish(x, z, q, g, gate, num_heads: int) -> None:
    """The finishing kernel alone, on the partials of one 8B-width call."""
    m, d = x.numel() // x.shape[-1], x.shape[-1]
    parts = -(-m // DEFAULT_TABLES.stats[MAX_TRITON_SOURCES]["rows"])
    work = torch.randn(parts * (2 * d + num_heads + 1), device=x.device)
    default = DEFAULT_TABLES.finish
    for block_c, block_p, warps in itertools.product((16, 32, 64), (32, 64, 128, 256), (4, 8)):
        tables = DEFAULT_TABLES.replace(finish={"block_c": block_c, "block_p": block_p, "warps": warps})
        ms = do_bench(
            lambda tables=tables: finish_param_grads(work, parts, z, q, g, gate, num_heads, 1e-5, tables),
            warmup=10,
            rep=50,
        )
        mark = " (default)" if {"block_c": block_c, "block_p": block_p, "warps": warps} == dict(default) else ""
        shape = f"{block_c} columns, {block_p} partials a step, {warps} warps{mark}"
        print(f"| finish | - | {shape} | {ms:.4f} | |")


def profile(args) -> None:
    """Where one triton arm's microbatch fwd+bwd time goes: top GPU kernels, and CPU time."""
    arm = args.profile
    print(f"profiling {arm}: {ARMS[arm]}")
    mb = Microbatch(args.batch, args.seq, args.dim, args.layers, args.blocks)
    fn = route_fns(args.heads, 1e-5)[arm]
    mb.forward_backward(fn, SOURCE_BACKEND[arm])
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        mb.forward_backward(fn, SOURCE_BACKEND[arm])
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=60))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--dim", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--arms", default=",".join(ARMS), help=f"microbatch rows to run, of {', '.join(ARMS)}")
    parser.add_argument("--no-sweep", action="store_true")
    parser.add_argument("--sweep-only", action="store_true")
    parser.add_argument(
        "--profile",
        nargs="?",
        const="triton",
        choices=("triton_op", "triton"),
        help="profile this arm's microbatch instead (default triton, the training step's path)",
    )
    parser.add_argument(
        "--tune",
        nargs="?",
        const="fwd,bwd,stats,group,finish",
        help="time launch shapes of these kernels (fwd,fwd_rstd,bwd,stats,group,finish) instead",
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_routing needs a CUDA GPU")
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    if args.profile:
        return profile(args)
    bw = copy_bandwidth()
    if args.tune:
        return tune(args, bw)
    if not args.sweep_only:
        bench_microbatch(args, bw)
    if not args.no_sweep:
        bench_sweep(args, bw)


if __name__ == "__main__":
    main()
