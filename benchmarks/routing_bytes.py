"""The launches and least bytes of each routing kernel over one microbatch, as the launch tables split its work:
what `bench_routing` sets each kernel's GPU time against (its share of copy bandwidth, issue 53).

Counted for the model's call pattern: every source marked (`routing_source`, its gradient summed in place and its
norm computed once), calls in forward order, grouped by the sources they read. Least bytes: each launch's
inputs read once and outputs written once (a tile read by two programs counts once), the small per-program
partials and per-row sums left out."""

from __future__ import annotations

import collections
from collections.abc import Sequence

from kernels.triton.launch import LaunchTables, cdiv

# the profiler's kernel names, by the pass they belong to
KINDS = {
    "route_fwd_kernel": "forward",
    "route_fwd_sites_kernel": "forward",
    "route_bwd_stats_kernel": "stats",
    "route_bwd_mix_kernel": "mix",
    "route_bwd_norm_kernel": "norm",
    "source_rstd_kernel": "rstd",
    "route_bwd_finish_kernel": "finish",
}
PASSES = ("forward", "stats", "mix", "norm", "rstd", "finish")


def pass_bytes(
    calls: Sequence[tuple[int, int]], m: int, d: int, heads: int, itemsize: int, tables: LaunchTables
) -> dict[str, tuple[int, int]]:
    """{pass: (launches, least bytes)} for `calls`, each (sources it reads, sites it routes at once) in forward
    order, over [m, d] tensors of `itemsize` bytes with `heads` routing heads."""
    unit, plane = m * d * itemsize, m * heads * 4  # a tensor; one source's fp32 per-row, per-head values
    out: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])

    def add(kind: str, launches: int, nbytes: int) -> None:
        out[kind][0] += launches
        out[kind][1] += nbytes

    per_source_list: dict[int, int] = collections.Counter()  # sites over each source list, for the mix
    for n, sites in calls:
        fwd = tables.fwd_sites[n]
        per_pass = fwd["sites"] if sites > 1 else 1
        if per_pass == 2 and fwd["grouped"] and sites > 2 and sites % 2 == 0:
            per_pass = sites  # every pair in one launch: the sources once at least
        for at in range(0, sites, per_pass):
            k = min(per_pass, sites - at)
            add("forward", 1, (n + k) * unit + k * (n + 1) * plane)  # sources, outputs, logits
        stats = tables.stats_pair[n] if sites > 1 else None
        if stats is None:
            launches = [1] * sites
        elif stats["grouped"]:
            launches = [sites]
        else:
            launches = [2] * (sites // 2) + [1] * (sites % 2)
        rows = (tables.stats if sites == 1 else tables.stats_pair)[n]["rows"]
        for k in launches:  # sources and output gradients; per site its logits read, coefficients written
            add("stats", 1, (n + k) * unit + k * (n + 1 + 3 * n) * plane)
        add("finish", sites, sites * cdiv(m, rows) * (2 * d + heads + 1) * 4)
        per_source_list[n] += sites
    calls_a_pass = tables.mix["calls"]
    sources = max(per_source_list)  # the last block reads them all: it starts every sum (backward order)
    for n in sorted(per_source_list, reverse=True):
        for at in range(0, per_source_list[n], calls_a_pass):
            g = min(calls_a_pass, per_source_list[n] - at)
            starts = n == sources and at == 0  # the first pass over each sum writes it without reading it
            # output gradients; each sum written (and read); per call its A, B and C coefficients
            add("mix", 1, (g + n * (1 if starts else 2)) * unit + g * 3 * n * plane)
    add("norm", sources, 3 * sources * unit)  # source, its gradient sum read and written
    add("rstd", sources, sources * unit)
    return {kind: tuple(out[kind]) for kind in PASSES}
