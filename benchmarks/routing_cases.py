"""The routing benchmarks' harness: timing, the copy-bandwidth ceiling, one site function per routing
path, and the 64 routing calls of one 8B microbatch as the model makes them (benchmarks.bench_routing
times them; benchmarks.routing_tune times launch shapes; tests/test_bench_routing.py checks them)."""

from __future__ import annotations

import functools
import gc
import statistics
from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint

from kernels import route_torch, routing_source
from kernels.triton.autograd import route_eager, route_op, route_sites_eager
from kernels.triton.launch import LaunchTables
from mhar_titan.model.sources import SITE_NAMES, SourceLayout

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
    "triton": "eager autograd.Function, a block's sites in one call (the training step's path)",
    "triton_layer": "eager autograd.Function, a layer's two sites in one call",
    "triton_site": "eager autograd.Function, one call per site",
    "triton_op": "custom op torch.ops.mhar.route_fwd",
    "compile": "torch reference under torch.compile, per-call checkpoint",
    "eager": "torch reference, eager, per-call checkpoint",
}
# The backend name each arm marks its sources for (routing_source)
SOURCE_BACKEND = {
    "triton_op": "triton_op",
    "triton": "triton",
    "triton_layer": "triton",
    "triton_site": "triton",
    "compile": "torch",
    "eager": "torch",
}
# Arms whose op saves nothing but references to its inputs: the model runs them unwrapped
UNWRAPPED = ("triton", "triton_layer", "triton_site", "triton_op")
# Arms that route several sites over the same sources in one call: a block's (as the model does), a layer's
GROUPED = {"triton": "block", "triton_layer": "layer"}


def route_fns(num_heads: int, eps: float, tables: LaunchTables | None = None) -> dict[str, Callable]:
    """One site function per arm, site(null, query, norm_weight, gate, *sources) -> gate * R;
    `tables`: the eager triton path's launch shapes (the custom op always takes the default ones)."""
    # torch.compile: one graph per source count, with and without grad: let it keep them all.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)

    def op_fn(null, q, g, gate, *srcs):
        return route_op(None, srcs, null, q, g, gate, num_heads=num_heads, eps=eps)[0]

    def triton_fn(null, q, g, gate, *srcs):
        return route_eager(None, srcs, null, q, g, gate, num_heads=num_heads, eps=eps, tables=tables)[0]

    def sites_fn(sites, *srcs):
        return [out for out, _ in route_sites_eager(srcs, sites, num_heads=num_heads, eps=eps, tables=tables)]

    def torch_fn(null, q, g, gate, *srcs):
        return route_torch(None, srcs, null, q, g, gate, num_heads=num_heads, eps=eps)[0]

    return {
        "triton": sites_fn,
        "triton_layer": sites_fn,
        "triton_site": triton_fn,
        "triton_op": op_fn,
        "compile": torch.compile(torch_fn, dynamic=False),
        "eager": torch_fn,
    }


def call_site(fn: Callable, params: list[torch.Tensor], sources: list[torch.Tensor]) -> torch.Tensor:
    """One routing site, called as the model calls a RoutingSite module, site(sources): its
    parameters are bound, the sources one list."""
    return fn(*params, *sources)


class Microbatch:
    """The 64 routing calls of one 8B microbatch, with random sources and site parameters."""

    def __init__(
        self, B: int, T: int, d: int, num_layers: int, num_blocks: int, device: str = "cuda", dtype: torch.dtype = DTYPE
    ):
        layout = SourceLayout(num_blocks, num_layers)
        dev = {"device": device, "dtype": dtype}
        self.sources = [torch.randn(B, T, d, **dev).requires_grad_() for _ in range(layout.max_caller_sources)]
        self.calls = []  # (n_sources, params)
        for layer in range(num_layers):
            for _site in SITE_NAMES:
                params = [
                    (0.5 * torch.randn(d, **dev)).requires_grad_(),
                    torch.randn(d, **dev).requires_grad_(),
                    (1 + 0.1 * torch.randn(d, **dev)).requires_grad_(),
                    (0.1 * torch.randn(1, **dev)).requires_grad_(),
                ]
                self.calls.append((layout.caller_sources(layer), params))
        self.grad_out = torch.randn(B, T, d, **dev)
        unit = self.grad_out.numel() * self.grad_out.element_size()
        self.bytes_fwd = sum((n + 1) * unit for n, _ in self.calls)  # sources read, output written
        self.per_block = layout.sites_per_block
        # sources read once a layer, or once a block; every output written
        self.bytes_grouped = {
            grouping: sum((n + len(sites)) * unit for n, sites in self.groups(grouping))
            for grouping in ("layer", "block")
        }

    def call_shapes(self, grouping: str | None) -> list[tuple[int, int]]:
        """(sources read, sites routed at once) per call, as `forward` makes them."""
        if grouping:
            return [(n, len(sites)) for n, sites in self.groups(grouping)]
        return [(n, 1) for n, _ in self.calls]

    def groups(self, grouping: str) -> list[tuple[int, list[list[torch.Tensor]]]]:
        """(n_sources, each site's params) per call over the same sources: a layer's two sites, or a block's."""
        size = len(SITE_NAMES) if grouping == "layer" else self.per_block
        return [
            (self.calls[at][0], [p for _, p in self.calls[at : at + size]]) for at in range(0, len(self.calls), size)
        ]

    def forward(self, fn: Callable, grad: bool = False, grouping: str | None = None, wrapped: bool = False) -> None:
        """Every call's forward; with `grad`, as in training (the graph is built, then dropped);
        `grouping` ("layer", "block"): fn routes the group's sites at once (fn(sites, *sources)); `wrapped`: with
        grad, each call checkpointed on its own, as in `forward_backward` (the torch reference keeps every
        call's intermediates otherwise: more than a 141 GB GPU holds for the 8B microbatch's 64 calls)."""
        with torch.set_grad_enabled(grad):
            if grouping:
                outs = [fn(sites, *self.sources[:n]) for n, sites in self.groups(grouping)]
            else:
                outs = []
                for n, params in self.calls:
                    site = functools.partial(call_site, fn, params)
                    wrap = grad and wrapped
                    outs.append(
                        checkpoint(site, self.sources[:n], use_reentrant=False) if wrap else site(self.sources[:n])
                    )
        del outs

    def leaves(self) -> list[torch.Tensor]:
        return [*self.sources] + [p for _, ps in self.calls for p in ps]

    def forward_backward(
        self, fn: Callable, backend: str, keep_grads: bool = False, wrapped: bool = False, grouping: str | None = None
    ) -> None:
        """Forward and backward of every call; `wrapped`: each call checkpointed on its own;
        `grouping`: as in `forward`."""
        srcs = [routing_source(s, backend) for s in self.sources]
        outs = []
        for n, sites in self.groups(grouping) if grouping else []:
            outs.extend(fn(sites, *srcs[:n]))
        for n, params in [] if grouping else self.calls:
            site = functools.partial(call_site, fn, params)
            outs.append(checkpoint(site, srcs[:n], use_reentrant=False) if wrapped else site(srcs[:n]))
        torch.autograd.backward(outs, [self.grad_out] * len(outs))
        if not keep_grads:
            for t in self.leaves():
                t.grad = None
