"""`python -m benchmarks.bench_routing --tune`: launch shapes of the routing kernels timed at the 8B width.

Each shape is passed to the kernels' host wrappers as a `LaunchTables` argument; the tables in
kernels/triton/launch.py hold the winners (docs/performance.md has the runs).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from triton.testing import do_bench

from benchmarks.routing_cases import DTYPE, Microbatch, route_fns
from kernels import MAX_TRITON_SOURCES
from kernels.triton.host import (
    Site,
    backward_stats,
    backward_stats_pair,
    custom_op_backward,
    finish_param_grads,
    forward,
    forward_pair,
    forward_sites,
    source_rstd,
)
from kernels.triton.launch import DEFAULT_TABLES, LaunchTables

TUNE_KERNELS = (
    "fwd",
    "fwd_rstd",
    "bwd",
    "stats",
    "pair",
    "pair_load",
    "params",
    "load",
    "group",
    "finish",
    "block",
)  # what `--tune` takes


@dataclass
class _Inputs:
    """One 8B-width call's tensors (`args.batch` x `args.seq` x `args.dim`), shared by the tuned kernels,
    and the copy bandwidth `bw` that each row's bytes per ms are set against."""

    args: Any
    bw: float
    x: torch.Tensor
    z: torch.Tensor
    q: torch.Tensor
    g: torch.Tensor
    gate: torch.Tensor
    dout: torch.Tensor

    @classmethod
    def make(cls, args, bw: float) -> _Inputs:
        dev = {"device": "cuda", "dtype": DTYPE}
        d = args.dim
        x = torch.randn(args.batch, args.seq, d, **dev)
        z, q, g = (0.5 * torch.randn(d, **dev) for _ in range(3))
        gate = torch.randn(1, **dev)
        return cls(args, bw, x, z, q, g, gate, torch.randn_like(x))

    @property
    def unit(self) -> int:
        return self.x.numel() * self.x.element_size()

    def site_params(self) -> list[tuple]:
        """A layer's two sites' parameters (null, query, norm weight, gate)."""
        return [(self.z, self.q, self.g, self.gate), (self.q, self.g, self.z, 2 * self.gate)]

    def fwd(self, srcs: list[torch.Tensor], tables: LaunchTables, label: str, rstds=()) -> None:
        """Times the forward as the model calls it: gate * R, without x; `rstds`: the sources' norms, given or not."""
        z, q, g, gate, heads = self.z, self.q, self.g, self.gate, self.args.heads
        ms = do_bench(lambda: forward(None, srcs, z, q, g, gate, heads, 1e-5, tables, rstds), warmup=10, rep=50)
        print(f"| fwd | {len(srcs)} | {label} | {ms:.3f} | {(len(srcs) + 1) * self.unit / (ms * 1e-3) / self.bw:.0%} |")

    def bwd(self, srcs: list[torch.Tensor], tables: LaunchTables, label: str) -> None:
        """Times the whole backward of one call."""
        z, q, g, gate, heads, dout = self.z, self.q, self.g, self.gate, self.args.heads, self.dout
        lg = forward(None, srcs, z, q, g, gate, heads, 1e-5)[1]  # what the backward reads
        ms = do_bench(lambda: custom_op_backward(dout, lg, srcs, z, q, g, gate, heads, 1e-5, tables), warmup=10, rep=50)
        nbytes = (2 + 3 * len(srcs)) * self.unit  # dout twice, each source twice, each gradient once
        print(f"| bwd | {len(srcs)} | {label} | {ms:.3f} | {nbytes / (ms * 1e-3) / self.bw:.0%} |")


def _tune_fwd(t: _Inputs) -> None:
    """The forward's launch shapes for every number of sources, with the norms given and computed."""
    for n in range(1, MAX_TRITON_SOURCES + 1):
        srcs = [torch.randn_like(t.x) for _ in range(n)]
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
                t.fwd(srcs, tables, label, rstds)


def _tune_fwd_rstd(t: _Inputs) -> None:
    """The forward's default shapes only, norms given or computed."""
    for n in range(1, MAX_TRITON_SOURCES + 1):
        srcs = [torch.randn_like(t.x) for _ in range(n)]
        rstds = [source_rstd(s, 1e-5) for s in srcs]
        for given in (False, True):
            tables = DEFAULT_TABLES.replace(fwd={n: {"given_rstd": given}})
            t.fwd(srcs, tables, f"default shape, rstd {'given' if given else 'computed'}", rstds)


def _tune_bwd(t: _Inputs) -> None:
    """The whole backward at 2 and 8 sources while the stats, then the mix kernel's shape varies."""
    for n in (2, 8):
        srcs = [torch.randn_like(t.x) for _ in range(n)]
        for rows, warps, maxnreg in itertools.product((16, 32, 64), (8, 16), (None, 128)):
            tables = DEFAULT_TABLES.replace(stats={n: {"rows": rows, "warps_per_4096": warps, "maxnreg": maxnreg}})
            t.bwd(srcs, tables, f"stats rows {rows}, {warps} warps, registers <= {maxnreg or 'any'}")
        for block_m, block_kc, warps in [(16, 64, 4), (32, 64, 4), (16, 128, 4), (32, 128, 8)]:
            tables = DEFAULT_TABLES.replace(mix={"block_m": block_m, "block_kc": block_kc, "warps": warps})
            t.bwd(srcs, tables, f"mix {block_m}x{block_kc}, {warps} warps")


def _tune_stats(t: _Inputs) -> None:
    """The stats and finishing kernels alone (what a call's backward runs before its mix)."""
    z, q, g, gate, heads, dout = t.z, t.q, t.g, t.gate, t.args.heads, t.dout
    for n in range(1, MAX_TRITON_SOURCES + 1):
        srcs = [torch.randn_like(t.x) for _ in range(n)]
        rstds = [source_rstd(s, 1e-5) for s in srcs]  # as for sources marked with routing_source
        lg = forward(None, srcs, z, q, g, gate, heads, 1e-5, DEFAULT_TABLES, rstds)[1]
        for given, maxnreg, warps in itertools.product((False, True), (None, 168), (8, 16)):
            shape = {"maxnreg": maxnreg, "given_rstd": given, "warps_per_4096": warps}
            tables = DEFAULT_TABLES.replace(stats={n: shape})
            ms = do_bench(
                lambda srcs=srcs, rstds=rstds, tables=tables, lg=lg: backward_stats(
                    dout, lg, srcs, z, q, g, gate, heads, 1e-5, rstds, tables
                ),
                warmup=10,
                rep=50,
            )
            label = (
                f"rows {tables.stats[n]['rows']}, {warps} warps, registers <= {maxnreg or 'any'}, "
                f"rstd {'given' if given else 'computed'}"
            )
            print(f"| stats | {n} | {label} | {ms:.3f} | {(n + 1) * t.unit / (ms * 1e-3) / t.bw:.0%} |")


def _tune_group(t: _Inputs) -> None:
    """Calls per mix pass: the microbatch's triton loop without the wrapper, GPU-bound in its backward."""
    args = t.args
    mb = Microbatch(args.batch, args.seq, args.dim, args.layers, args.blocks)
    for calls in (1, 2, 4):
        fn = route_fns(args.heads, 1e-5, DEFAULT_TABLES.replace(mix={"calls": calls}))["triton_site"]
        ms = do_bench(lambda fn=fn: mb.forward_backward(fn, "triton"), warmup=3, rep=200)
        print(f"| microbatch fwd+bwd, no wrapper | 1-8 | mix pass per {calls} calls | {ms:.2f} | |")


def tune(args, bw: float) -> None:
    """Time launch shapes of each kernel at the 8B width: the forward alone for every number of
    caller sources (its table is keyed by it), and the whole backward while one of its kernels'
    shapes varies, at 2 and 8 caller sources. GPU time of back-to-back calls (Triton's do_bench),
    so the Python launch cost of one call, which CUDA events around it would include, is not.
    Each shape is passed to the kernels' host wrappers as a `LaunchTables` argument."""
    t = _Inputs.make(args, bw)
    kernels = args.tune.split(",")
    print("| kernel | sources | launch | ms | bytes / ms vs copy bw |")
    print("|---|---|---|---|---|")
    for name, run in (("fwd", _tune_fwd), ("fwd_rstd", _tune_fwd_rstd), ("bwd", _tune_bwd), ("stats", _tune_stats)):
        if name in kernels:
            run(t)
    for n in PAIR_SOURCES if "pair" in kernels else ():
        tune_pair(args, bw, n, t.dout, t.site_params())
    for n in PAIR_SOURCES if "params" in kernels else ():
        param_dtypes(args, bw, n, t.dout, t.site_params())
    if "load" in kernels:
        under_load(args, bw, t.dout, t.site_params())
    if "pair_load" in kernels:
        tune_pair_loaded(args, bw, t.dout, t.site_params())
    if "group" in kernels:
        _tune_group(t)
    if "block" in kernels:
        tune_block(args, bw, t.dout)
    if "finish" in kernels:
        finish(t.x, t.z, t.q, t.g, t.gate, args.heads)


PAIR_SOURCES = tuple(range(1, MAX_TRITON_SOURCES + 1))
PAIR_FWD = [  # (rows, warps per 4096, register cap, prefetch)
    (1, 8, None, False),
    (1, 8, 128, False),
    (2, 8, None, False),
    (2, 8, 128, False),
    (2, 8, None, True),
    (2, 8, 128, True),
    (4, 8, None, True),
    (4, 8, 128, True),
]
PAIR_STATS = [(32, 8, None, False), (64, 8, None, False), (32, 8, None, True), (64, 8, None, True)]


def pair_logits(srcs: list[torch.Tensor], sites: list[Site], heads: int, rstds: list) -> list[torch.Tensor]:
    """Each site's routing logits, as its forward wrote them: what the stats kernel reads."""
    return [lg for _, lg in forward_pair(srcs, sites, heads, 1e-5, DEFAULT_TABLES, rstds)]


def _label(rows: int, warps: int, maxnreg: int | None, prefetch: bool) -> str:
    return f"rows {rows}, {warps} warps, registers <= {maxnreg or 'any'}" + (", prefetch" if prefetch else "")


def tune_pair(args, bw: float, n: int, dout: torch.Tensor, params: list[tuple]) -> None:
    """A layer's two sites over n marked sources: two single-site calls against one two-site pass
    at each launch shape, for the forward and for the stats kernel (single-site stats with and
    without prefetch: a `STATS_PAIR` entry None takes two single-site passes)."""
    sites = [Site(*p) for p in params]
    srcs = [torch.randn_like(dout) for _ in range(n)]
    rstds = [source_rstd(s, 1e-5) for s in srcs]
    lgs = pair_logits(srcs, sites, args.heads, rstds)
    unit = dout.numel() * dout.element_size()

    def row(kernel: str, label: str, ms: float, nbytes: int) -> None:
        print(f"| {kernel} | {n} | {label} | {ms:.3f} | {nbytes / (ms * 1e-3) / bw:.0%} |")

    def fwd_single() -> None:
        for s in sites:
            forward(None, srcs, *s, args.heads, 1e-5, DEFAULT_TABLES, rstds)

    row("fwd", "two single-site calls", do_bench(fwd_single, warmup=10, rep=50), (2 * n + 2) * unit)
    for rows, warps, maxnreg, prefetch in PAIR_FWD:
        shape = {"rows": rows, "warps_per_4096": warps, "maxnreg": maxnreg, "given_rstd": True, "prefetch": prefetch}
        tables = DEFAULT_TABLES.replace(fwd_pair={n: shape})
        ms = do_bench(lambda t=tables: forward_pair(srcs, sites, args.heads, 1e-5, t, rstds), warmup=10, rep=50)
        row("fwd, 2 sites", _label(rows, warps, maxnreg, prefetch), ms, (n + 2) * unit)

    for prefetch in (False, True):
        tables = DEFAULT_TABLES.replace(stats={n: {"prefetch": prefetch}})

        def stats_single(t=tables) -> None:
            for s, lg in zip(sites, lgs, strict=True):
                backward_stats(dout, lg, srcs, *s, args.heads, 1e-5, rstds, t)

        shape = tables.stats[n]
        label = "two single-site calls, " + _label(shape["rows"], 8, shape["maxnreg"], prefetch)
        row("stats", label, do_bench(stats_single, warmup=10, rep=50), (2 * n + 2) * unit)
    for rows, warps, maxnreg, prefetch in PAIR_STATS:
        shape = {"rows": rows, "warps_per_4096": warps, "maxnreg": maxnreg, "given_rstd": True, "prefetch": prefetch}
        tables = DEFAULT_TABLES.replace(stats_pair={n: shape})
        ms = do_bench(
            lambda t=tables: backward_stats_pair([dout, dout], lgs, srcs, sites, args.heads, 1e-5, rstds, t),
            warmup=10,
            rep=50,
        )
        row("stats, 2 sites", _label(rows, warps, maxnreg, prefetch), ms, (n + 2) * unit)


def param_dtypes(args, bw: float, n: int, dout: torch.Tensor, params: list[tuple]) -> None:
    """A layer's two-site forward and stats passes (default tables) reading bf16 site parameters
    (FSDP's, and autocast's since kernels/routing.py casts them) against fp32 ones (what one GPU
    under autocast passed before): the row kernels re-read the parameter tiles per source."""
    srcs = [torch.randn_like(dout) for _ in range(n)]
    rstds = [source_rstd(s, 1e-5) for s in srcs]
    unit = dout.numel() * dout.element_size()
    for dtype in (torch.bfloat16, torch.float32):
        sites = [Site(*(t.to(dtype) for t in p)) for p in params]
        lgs = pair_logits(srcs, sites, args.heads, rstds)
        label = f"default shape, {str(dtype).removeprefix('torch.')} parameters"

        def fwd(s=sites) -> None:
            forward_pair(srcs, s, args.heads, 1e-5, DEFAULT_TABLES, rstds, dout.dtype)

        def bwd_stats(s=sites, lgs=lgs) -> None:
            backward_stats_pair([dout, dout], lgs, srcs, s, args.heads, 1e-5, rstds, DEFAULT_TABLES)

        for kernel, fn in (("fwd, 2 sites", fwd), ("stats, 2 sites", bwd_stats)):
            ms = do_bench(fn, warmup=10, rep=50)
            print(f"| {kernel} | {n} | {label} | {ms:.3f} | {(n + 2) * unit / (ms * 1e-3) / bw:.0%} |")


class Burst:
    """Single launches timed right after an L2 flush (the GPU otherwise idle, as in the rest of the
    tune) or right after 20 ms of the 8B MLP's up-projection matmuls: the step's context, where the
    GPU runs at its power cap and clocks below the idle tune's (docs/performance.md, 2026-12-03).
    Medians of `reps` launches; the host enqueues each while the GPU is still busy, so launch
    latency is not timed."""

    def __init__(self, dout: torch.Tensor, reps: int = 30):
        rows, d = dout.numel() // dout.shape[-1], dout.shape[-1]
        self.a = torch.randn(rows, d, device=dout.device, dtype=dout.dtype)
        self.w = torch.randn(d, int(3.5 * d), device=dout.device, dtype=dout.dtype)
        self.scratch = torch.empty(256 * 2**20, device=dout.device, dtype=torch.int8)  # beyond L2
        self.count = max(1, round(20e-3 / (2 * rows * d * self.w.shape[1] / 700e12)))  # 20 ms at ~700 TFLOP/s
        self.reps = reps

    def flushed(self) -> None:
        self.scratch.zero_()
        torch.cuda._sleep(2_000_000)  # ~1 ms at 2 GHz: the host enqueues the timed launch meanwhile

    def loaded(self) -> None:
        for _ in range(self.count):
            torch.mm(self.a, self.w)

    def median_ms(self, fn, before) -> float:
        times = []
        for _ in range(self.reps):
            before()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return sorted(times)[len(times) // 2]


def under_load(args, bw: float, dout: torch.Tensor, params: list[tuple]) -> None:
    """A layer's two-site forward and stats passes (default tables), and a copy of as many bytes,
    after an L2 flush and after matmuls (`Burst`): inside the step the row kernels ran slower than
    tuned alone (docs/history/kernels-notebook.md)."""
    sites = [Site(*p) for p in params]
    burst = Burst(dout)
    unit = dout.numel() * dout.element_size()
    for n in (1, 4, 8):
        srcs = [torch.randn_like(dout) for _ in range(n)]
        rstds = [source_rstd(s, 1e-5) for s in srcs]
        copy_src = torch.empty((n + 2) * dout.numel() // 2, device=dout.device, dtype=dout.dtype)
        copy_dst = torch.empty_like(copy_src)
        lgs = pair_logits(srcs, sites, args.heads, rstds)
        stats_fn = partial(backward_stats_pair, [dout, dout], lgs, srcs, sites, args.heads, 1e-5, rstds, DEFAULT_TABLES)
        cases = (
            ("fwd, 2 sites", partial(forward_pair, srcs, sites, args.heads, 1e-5, DEFAULT_TABLES, rstds, dout.dtype)),
            ("stats, 2 sites", stats_fn),
            ("copy, as many bytes", partial(copy_dst.copy_, copy_src)),
        )
        for kernel, fn in cases:
            for context, before in (("after an L2 flush", burst.flushed), ("after 20 ms of matmuls", burst.loaded)):
                ms = burst.median_ms(fn, before)
                print(f"| {kernel} | {n} | {context} | {ms:.3f} | {(n + 2) * unit / (ms * 1e-3) / bw:.0%} |")


def tune_pair_loaded(args, bw: float, dout: torch.Tensor, params: list[tuple]) -> None:
    """The two-site launch shapes of `--tune pair`, each timed after matmuls (`Burst`), where the
    step runs them: the tables were chosen at the idle GPU's clocks."""
    sites = [Site(*p) for p in params]
    burst = Burst(dout, reps=20)
    unit = dout.numel() * dout.element_size()
    for n in PAIR_SOURCES:
        srcs = [torch.randn_like(dout) for _ in range(n)]
        rstds = [source_rstd(s, 1e-5) for s in srcs]
        lgs = pair_logits(srcs, sites, args.heads, rstds)
        # and the stats at two programs an SM (128 registers, some spills): fewer cycles stalled
        stats_shapes = [*PAIR_STATS, (32, 8, 128, True), (64, 8, 128, True)]
        for kernel, key, shapes in (("fwd", "fwd_pair", PAIR_FWD), ("stats", "stats_pair", stats_shapes)):
            for rows, warps, maxnreg, prefetch in shapes:
                shape = {"rows": rows, "warps_per_4096": warps, "maxnreg": maxnreg, "prefetch": prefetch}
                tables = DEFAULT_TABLES.replace(**{key: {n: {**shape, "given_rstd": True}}})
                if key == "fwd_pair":
                    fn = partial(forward_pair, srcs, sites, args.heads, 1e-5, tables, rstds)
                else:
                    fn = partial(backward_stats_pair, [dout, dout], lgs, srcs, sites, args.heads, 1e-5, rstds, tables)
                ms = burst.median_ms(fn, burst.loaded)
                mark = " (default)" if getattr(DEFAULT_TABLES, key)[n] == getattr(tables, key)[n] else ""
                label = _label(rows, warps, maxnreg, prefetch) + mark
                share = (n + 2) * unit / (ms * 1e-3) / bw
                print(f"| {kernel}, 2 sites, after matmuls | {n} | {label} | {ms:.3f} | {share:.0%} |")


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


BLOCK_FWD = [(1, None), (2, None), (2, 128), (4, None), (4, 128)]  # (rows, register cap) of the block forward


def tune_block(args, bw: float, dout: torch.Tensor) -> None:
    """A block's sites (2 x layers / blocks) over n marked sources, after matmuls (`Burst`), as the step
    runs them: the forward in passes of two sites (the two-site kernel, a launch a pair or every pair in one
    launch) against one pass of the block kernel at each launch shape; the stats passes one launch per pair
    against one launch for the block.
    Shares of copy bandwidth count each case's least bytes: every site's output (or output gradient) once, the
    sources once a pair for launches a pair, once for the block kernel and for the block's pairs in one launch
    (whose pairs share them through L2 at best)."""
    count = 2 * args.layers // args.blocks
    gen = torch.Generator(device=dout.device).manual_seed(0)
    sites = [
        Site(
            *(0.5 * torch.randn(dout.shape[-1], device=dout.device, generator=gen).to(dout.dtype) for _ in range(3)),
            0.1 * torch.randn(1, device=dout.device, generator=gen).to(dout.dtype),
        )
        for _ in range(count)
    ]
    douts = [torch.randn_like(dout) for _ in range(count)]
    burst = Burst(dout, reps=20)
    unit = dout.numel() * dout.element_size()
    for n in PAIR_SOURCES:
        srcs = [torch.randn_like(dout) for _ in range(n)]
        rstds = [source_rstd(s, 1e-5) for s in srcs]
        once, per_pair = (n + count) * unit, count // 2 * (n + 2) * unit  # the sources once, or once a pair
        cases = [
            ("fwd, pairs", DEFAULT_TABLES.replace(fwd_sites={n: {"sites": 2, "grouped": False}})),
            ("fwd, pairs in one launch", DEFAULT_TABLES.replace(fwd_sites={n: {"sites": 2, "grouped": True}})),
        ]
        for rows, cap in BLOCK_FWD:
            shape = {"sites": count, "rows": rows, "warps_per_4096": 8, "maxnreg": cap}
            cases.append(
                (f"fwd, block, rows {rows}, registers <= {cap or 'any'}", DEFAULT_TABLES.replace(fwd_sites={n: shape}))
            )
        for label, tables in cases:
            ms = burst.median_ms(partial(forward_sites, srcs, sites, args.heads, 1e-5, tables, rstds), burst.loaded)
            mark = " (default)" if tables.fwd_sites[n] == DEFAULT_TABLES.fwd_sites[n] else ""
            nbytes = per_pair if tables.fwd_sites[n]["sites"] == 2 and not tables.fwd_sites[n]["grouped"] else once
            print(f"| {label}{mark} | {n} | {count} sites | {ms:.3f} | {nbytes / (ms * 1e-3) / bw:.0%} |")
        lgs = [lg for _, lg in forward_sites(srcs, sites, args.heads, 1e-5, DEFAULT_TABLES, rstds)]

        def pairs(srcs=srcs, rstds=rstds, lgs=lgs) -> None:
            for at in range(0, count, 2):
                backward_stats_pair(
                    douts[at : at + 2], lgs[at : at + 2], srcs, sites[at : at + 2], args.heads, 1e-5, rstds
                )

        block = partial(backward_stats_pair, douts, lgs, srcs, sites, args.heads, 1e-5, rstds)
        for label, fn, nbytes in (("stats, a launch per pair", pairs, per_pair), ("stats, one launch", block, once)):
            ms = burst.median_ms(fn, burst.loaded)
            print(f"| {label} | {n} | {count} sites | {ms:.3f} | {nbytes / (ms * 1e-3) / bw:.0%} |")
