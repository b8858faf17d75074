"""Host wrappers of the routing kernels: check, allocate and launch one forward, stats, mix or finishing pass.

Forward: `forward`, `forward_pair`, `forward_sites` (a block's sites). The eager path's backward (autograd.py's
Functions): `backward_stats` or `backward_stats_pair`, then `backward_mix` (or shared.backward_mix_shared).
`custom_op_backward` chains the same two for the custom op's `route_bwd` alone.
Each takes a `LaunchTables` (launch.DEFAULT_TABLES unless a benchmark passes another) and
reads the allocation and launcher seams through the `launch` module (its docstring lists them).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from kernels.triton import launch
from kernels.triton.launch import DEFAULT_TABLES, MAX_SOURCES, LaunchTables, cdiv, cpu_rows, interpreting, pow2


def check_inputs(ref: torch.Tensor | None, sources: Sequence[torch.Tensor]) -> None:
    """`ref`: x or the output gradient (None: the sources alone)."""
    if not 1 <= len(sources) <= MAX_SOURCES:
        raise ValueError(f"backend='triton' routes over 1..{MAX_SOURCES} sources, got {len(sources)}")
    if not (sources[0] if ref is None else ref).is_cuda and not interpreting():
        raise ValueError("backend='triton' needs CUDA tensors (or TRITON_INTERPRET=1 on CPU)")


def _known_rstds(rstds: Sequence[torch.Tensor | None], n: int, spare: torch.Tensor) -> tuple[int, tuple]:
    """The row kernels' KNOWN bits and RSTDS pointers; `spare` stands in where none is given."""
    rstds = tuple(rstds) or (None,) * n
    known = sum(1 << i for i, r in enumerate(rstds) if r is not None)
    return known, tuple(spare if r is None else r for r in rstds)


def source_rstd(source: torch.Tensor, eps: float, tables: LaunchTables = DEFAULT_TABLES) -> torch.Tensor:
    """1 / rms per row of a source, fp32 [rows]."""
    src = source.contiguous()
    d = src.shape[-1]
    m = src.numel() // d
    rstd = launch.empty((m,), device=src.device, dtype=torch.float32)
    block_r = cpu_rows(m) if interpreting() else tables.rstd["block_r"]
    grid, consts = launch.rstd_launch(m, d, block_r, tables.rstd["block_c"])
    launch.rstd_launcher(grid, tables.rstd["warps"], consts, src, rstd, m, eps)
    return rstd


class Site(NamedTuple):
    """One routing site's parameters: null source, query, norm weight, gate."""

    null: torch.Tensor
    query: torch.Tensor
    norm_weight: torch.Tensor
    gate: torch.Tensor


def forward(
    x: torch.Tensor | None,
    sources: Sequence[torch.Tensor],
    null: torch.Tensor,
    query: torch.Tensor,
    norm_weight: torch.Tensor,
    gate: torch.Tensor,
    num_heads: int,
    eps: float,
    tables: LaunchTables = DEFAULT_TABLES,
    rstds: Sequence[torch.Tensor | None] = (),
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward kernel: (x + gate * R in x's dtype, or gate * R in `out_dtype` (default: the
    parameters') when x is None; routing logits [N, *shape[:-1], H] fp32, which `backward_stats` reads).
    `rstds`: per source its 1 / rms per row where known, else None."""
    return _forward(x, sources, (Site(null, query, norm_weight, gate),), num_heads, eps, tables, rstds, out_dtype)[0]


def forward_pair(
    sources: Sequence[torch.Tensor],
    sites: Sequence[Site],
    num_heads: int,
    eps: float,
    tables: LaunchTables = DEFAULT_TABLES,
    rstds: Sequence[torch.Tensor | None] = (),
    out_dtype: torch.dtype | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Two sites over the same sources in one pass (each source read once): per site (gate * R in
    `out_dtype`, default its parameters', and its routing logits), as `forward` without x."""
    if len(sites) != 2:
        raise ValueError(f"forward_pair routes two sites, got {len(sites)}")
    return _forward(None, sources, tuple(sites), num_heads, eps, tables, rstds, out_dtype)


def forward_sites(
    sources: Sequence[torch.Tensor],
    sites: Sequence[Site],
    num_heads: int,
    eps: float,
    tables: LaunchTables = DEFAULT_TABLES,
    rstds: Sequence[torch.Tensor | None] = (),
    out_dtype: torch.dtype | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Any number of sites over the same sources (a block's): per site (gate * R in `out_dtype`, default
    its parameters', and its routing logits), as `forward` without x. The sites go in passes of at
    most `tables.fwd_sites[N]["sites"]`, each reading every source once: a pass of one site takes
    the single-site kernel, of two the two-site kernel, of more the block kernel, which needs every
    source's 1 / rms (computed here where `rstds` lacks one). With two a pass and `grouped`, every pair
    goes in one launch of the two-site kernel, whose pairs' programs of a row block run side by side (all
    but the first find the sources in L2)."""
    if not sites:
        raise ValueError("forward_sites routes at least one site")
    check_inputs(None, sources)
    per_pass = tables.fwd_sites[len(sources)]["sites"]
    if per_pass == 2 and tables.fwd_sites[len(sources)]["grouped"] and len(sites) > 2 and len(sites) % 2 == 0:
        # the two-site kernel for every pair in one launch: the pairs' programs of a row block side by side
        return _forward(None, sources, tuple(sites), num_heads, eps, tables, rstds, out_dtype)
    results = []
    for at in range(0, len(sites), per_pass):
        group = tuple(sites[at : at + per_pass])
        if len(group) <= 2:
            results += _forward(None, sources, group, num_heads, eps, tables, rstds, out_dtype)
        else:
            results += _forward_block(sources, group, num_heads, eps, tables, rstds, out_dtype)
    return results


def _forward_block(sources, sites, num_heads, eps, tables, rstds, out_dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    srcs = tuple(s.contiguous() for s in sources)
    given = tuple(rstds) or (None,) * len(srcs)
    rstd_ptrs = tuple(source_rstd(s, eps, tables) if r is None else r for s, r in zip(srcs, given, strict=True))
    d = srcs[0].shape[-1]
    m = srcs[0].numel() // d
    outs = tuple(launch.empty(srcs[0].shape, device=srcs[0].device, dtype=out_dtype or s.query.dtype) for s in sites)
    lg_shape = (len(srcs) + 1, *srcs[0].shape[:-1], num_heads)
    logits = tuple(launch.empty(lg_shape, device=srcs[0].device, dtype=torch.float32) for _ in sites)
    interp = interpreting()
    shape = tables.fwd_sites[len(srcs)]
    rows = cpu_rows(m) if interp else shape["rows"]
    grid, warps, consts = launch.sites_launch(
        m, d, num_heads, len(srcs), srcs[0].element_size(), rows, shape["warps_per_4096"], not interp, len(sites)
    )
    params = [tuple(t.contiguous() for t in site) for site in sites]
    nulls, queries, norm_weights, gates = (tuple(p[j] for p in params) for j in range(4))
    launch.sites_launcher(
        grid,
        warps,
        consts,
        srcs,
        rstd_ptrs,
        nulls,
        queries,
        norm_weights,
        gates,
        outs,
        logits,
        m,
        eps,
        maxnreg=None if interp else shape["maxnreg"],
    )
    return list(zip(outs, logits, strict=True))


def _forward(x, sources, sites, num_heads, eps, tables, rstds, out_dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    check_inputs(x, sources)
    srcs = tuple(s.contiguous() for s in sources)
    d = srcs[0].shape[-1]
    m = srcs[0].numel() // d
    xs = srcs[0] if x is None else x.contiguous()  # not read without x
    outs = [
        launch.empty_like(xs)
        if x is not None
        else launch.empty(xs.shape, device=xs.device, dtype=out_dtype or site.query.dtype)
        for site in sites
    ]
    lg_shape = (len(srcs) + 1, *srcs[0].shape[:-1], num_heads)
    logits = [launch.empty(lg_shape, device=xs.device, dtype=torch.float32) for _ in sites]
    interp = interpreting()
    per_program = 1 if len(sites) == 1 else 2  # more sites: pairs, one launch (a program per row block and pair)
    shape = (tables.fwd if per_program == 1 else tables.fwd_pair)[len(srcs)]
    rows = cpu_rows(m) if interp else shape["rows"]
    known, rstd_ptrs = _known_rstds(rstds if shape["given_rstd"] else (), len(srcs), logits[0])
    grid, warps, consts = launch.fwd_launch(
        m,
        d,
        num_heads,
        len(srcs),
        xs.element_size(),
        rows,
        shape["warps_per_4096"],
        not interp,
        known,
        x is not None,
        per_program,
        shape["prefetch"],
        len(sites) // per_program,
    )
    per_site = [(*(t.contiguous() for t in site), out, lg) for site, out, lg in zip(sites, outs, logits, strict=True)]
    # per kernel argument, a tuple over the pairs: each pair's first site, then its second (with one site, the
    # first again: not read)
    first = [tuple(column) for column in zip(*per_site[::per_program], strict=True)]
    second = [tuple(column) for column in zip(*per_site[per_program - 1 :: per_program], strict=True)]
    launch.fwd_launcher(grid, warps, consts, xs, srcs, rstd_ptrs, *first, *second, m, eps, maxnreg=shape["maxnreg"])
    return list(zip(outs, logits, strict=True))


class MixCall(NamedTuple):
    """What the mix kernel needs of one call, once its stats have run."""

    dout: torch.Tensor
    coef: torch.Tensor  # [3, N, m, H]: A, B, C per source (the stats kernel's COEF)
    query: torch.Tensor
    norm_weight: torch.Tensor


def backward_stats(
    grad_out: torch.Tensor,
    logits: torch.Tensor,
    sources: Sequence[torch.Tensor],
    null: torch.Tensor,
    query: torch.Tensor,
    norm_weight: torch.Tensor,
    gate: torch.Tensor,
    num_heads: int,
    eps: float,
    rstds: Sequence[torch.Tensor | None] = (),
    tables: LaunchTables = DEFAULT_TABLES,
    grad_like: Sequence[torch.Tensor] | None = None,
) -> tuple[MixCall, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One call's backward up to its sources' gradients: the stats and finishing kernels give
    the site's parameter gradients and the coefficients the mix kernel turns into the sources'.
    `logits`: the call's forward's. `rstds`: per source its 1 / rms per row where known
    (source_rstd), else None. `grad_like`: the parameters whose dtypes the gradients take
    (default: these), when these are cast copies."""
    site = Site(null, query, norm_weight, gate)
    return _backward_stats((grad_out,), (logits,), sources, (site,), num_heads, eps, rstds, tables, (grad_like,))[0]


def backward_stats_pair(
    grad_outs: Sequence[torch.Tensor],
    logits: Sequence[torch.Tensor],
    sources: Sequence[torch.Tensor],
    sites: Sequence[Site],
    num_heads: int,
    eps: float,
    rstds: Sequence[torch.Tensor | None] = (),
    tables: LaunchTables = DEFAULT_TABLES,
    grads_like: Sequence[Sequence[torch.Tensor] | None] | None = None,
) -> list[tuple[MixCall, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """`backward_stats` for pairs of sites over the same sources (2, 4, ... sites: a layer's, a block's)
    in one launch: each program serves two sites (each source read once for both), and the pairs'
    programs of a row block run side by side (all but the first find the sources in L2). Per site, as
    `backward_stats` (`logits`: each site's forward's; `grads_like`: per site, as its `grad_like`)."""
    if not len(sites) == len(grad_outs) == len(logits) or len(sites) % 2 or not sites:
        raise ValueError(
            f"backward_stats_pair takes pairs of sites with an output gradient and logits each, got {len(sites)} "
            f"sites, {len(grad_outs)} output gradients, {len(logits)} logits"
        )
    grads_like = grads_like or (None,) * len(sites)
    return _backward_stats(grad_outs, logits, sources, tuple(sites), num_heads, eps, rstds, tables, grads_like)


def _backward_stats(grad_outs, logits, sources, sites, num_heads, eps, rstds, tables, grads_like) -> list[tuple]:
    check_inputs(grad_outs[0], sources)
    d = grad_outs[0].shape[-1]
    m = grad_outs[0].numel() // d
    n = len(sources)
    lg_shape = (n + 1, *grad_outs[0].shape[:-1], num_heads)
    for lg in logits:  # the kernel indexes them as [N, m, H]: another shape would read other rows' logits
        if lg.shape != lg_shape or lg.dtype != torch.float32 or not lg.is_contiguous():
            raise ValueError(
                f"mhar_route backward: routing logits of shape {tuple(lg.shape)}, {lg.dtype}"
                f"{'' if lg.is_contiguous() else ', not contiguous'}; expected {lg_shape}, torch.float32, "
                "contiguous, as the forward wrote them"
            )
    douts = [g.contiguous() for g in grad_outs]
    srcs = tuple(s.contiguous() for s in sources)
    params = [Site(*(t.contiguous() for t in site)) for site in sites]
    interp = interpreting()
    per_program = 1 if len(sites) == 1 else 2
    shape = (tables.stats if per_program == 1 else tables.stats_pair)[n]
    rows = cpu_rows(m) if interp else shape["rows"]
    parts = cdiv(m, rows)
    # One allocation per site: the coefficients [3, N, m, H], then the per-program partials.
    coef_size = 3 * n * m * num_heads
    works = [
        launch.empty((coef_size + parts * (2 * d + num_heads + 1),), device=douts[0].device, dtype=torch.float32)
        for _ in sites
    ]
    known, rstd_ptrs = _known_rstds(rstds if shape["given_rstd"] else (), n, works[0])
    groups = len(sites) // per_program
    grid, warps, consts = launch.stats_launch(
        m,
        d,
        num_heads,
        n,
        douts[0].element_size(),
        rows,
        shape["warps_per_4096"],
        not interp,
        known,
        per_program,
        shape["prefetch"],
        groups,
    )
    cap = None if interp else shape["maxnreg"]
    per_site = [
        (dout, site.null, lg, site.gate, work[:coef_size], work[coef_size:])
        for dout, lg, site, work in zip(douts, logits, params, works, strict=True)
    ]
    # per kernel argument, a tuple over the groups: each group's first site, then its second (its first
    # again with one site a program: not read)
    first = [tuple(column) for column in zip(*per_site[::per_program], strict=True)]
    second = [tuple(column) for column in zip(*per_site[per_program - 1 :: per_program], strict=True)]
    launch.stats_launcher(grid, warps, consts, first[0], srcs, rstd_ptrs, *first[1:], *second, m, eps, maxnreg=cap)
    results = []
    for dout, site, work, like in zip(douts, params, works, grads_like, strict=True):
        grads = finish_param_grads(work[coef_size:], parts, *site, num_heads, eps, tables, like)
        results.append((MixCall(dout, work[:coef_size], site.query, site.norm_weight), *grads))
    return results


def finish_param_grads(
    partials: torch.Tensor,
    parts: int,
    null: torch.Tensor,
    query: torch.Tensor,
    norm_weight: torch.Tensor,
    gate: torch.Tensor,
    num_heads: int,
    eps: float,
    tables: LaunchTables = DEFAULT_TABLES,
    grad_like: Sequence[torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The finishing kernel: the stats kernel's `parts` per-program partials (fp32, laid out as
    backward.py's _partials says) summed in a fixed order into the gradients of null, query,
    norm weight and gate, each in the dtype of its parameter, or of its `grad_like` entry."""
    d = null.shape[-1]
    like = grad_like or (null, query, norm_weight, gate)
    dz, dq, dg, dgate = (launch.empty(t.shape, device=t.device, dtype=t.dtype) for t in like)
    f = tables.finish
    grid, warps, consts = launch.finish_launch(
        d, num_heads, null.element_size(), parts, f["block_c"], f["block_p"], f["warps"]
    )
    launch.finish_launcher(grid, warps, consts, partials, null, query, norm_weight, dz, dq, dg, dgate, eps)
    return dz, dq, dg, dgate


def backward_mix(
    calls: Sequence[MixCall],
    sources: Sequence[torch.Tensor],
    slots: Sequence,
    num_heads: int,
    tables: LaunchTables = DEFAULT_TABLES,
) -> list[torch.Tensor | None]:
    """The sources' gradients from 1..4 calls over the same sources, in one pass. A source
    with a slot (shared.GradSlot: `grad`, `csum`) has them added to the slot's sum (its norm
    term deferred to the slot's csum); the others get a new tensor, returned (None in the
    slots' places)."""
    srcs = tuple(s.contiguous() for s in sources)
    d = srcs[0].shape[-1]
    m = srcs[0].numel() // d
    dsrcs, csums, accum, shared = [], [], 0, 0
    for i, (s, slot) in enumerate(zip(srcs, slots, strict=True)):
        if slot is None:
            dsrcs.append(launch.empty_like(s))
            csums.append(dsrcs[-1])  # not read or written
            continue
        shared |= 1 << i
        if slot.grad is None:
            slot.grad, slot.csum = launch.empty_like(s), launch.empty((m,), device=s.device, dtype=torch.float32)
        else:
            accum |= 1 << i
        dsrcs.append(slot.grad)
        csums.append(slot.csum)
    if not 1 <= len(calls) <= 4:
        raise ValueError(f"mhar_route: one mix pass serves 1..4 calls, got {len(calls)} (MIX['calls'])")
    if len(calls) > 1 and shared != (1 << len(srcs)) - 1:
        raise RuntimeError("mhar_route: one mix pass serves several calls only when every source is shared")
    shape = tables.mix
    block_m = cpu_rows(m) if interpreting() else shape["block_m"]
    grid, consts = launch.mix_launch(m, d, num_heads, len(srcs), len(calls), block_m, shape["block_kc"], accum, shared)
    by_field = tuple(zip(*calls, strict=True))
    launch.mix_launcher(grid, shape["warps"], consts, *by_field, srcs, tuple(dsrcs), tuple(csums), m)
    return [None if slot is not None else ds for slot, ds in zip(slots, dsrcs, strict=True)]


def apply_norm_term(
    source: torch.Tensor, grad: torch.Tensor, csum: torch.Tensor, tables: LaunchTables = DEFAULT_TABLES
) -> None:
    """A shared source's norm term, once its gradient sum is complete: grad -= csum[row] * source."""
    src = source.contiguous()
    d = src.shape[-1]
    m = src.numel() // d
    if interpreting():
        grid, consts = launch.norm_launch(m, d, cpu_rows(m), pow2(d))
    else:
        grid, consts = launch.norm_launch(m, d, tables.norm["block_m"], tables.norm["block_d"])
    launch.norm_launcher(grid, tables.norm["warps"], consts, src, grad, csum, m)


def custom_op_backward(
    grad_out: torch.Tensor,
    logits: torch.Tensor,
    sources: Sequence[torch.Tensor],
    null: torch.Tensor,
    query: torch.Tensor,
    norm_weight: torch.Tensor,
    gate: torch.Tensor,
    num_heads: int,
    eps: float,
    tables: LaunchTables = DEFAULT_TABLES,
) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The custom op's backward (autograd.py's `route_bwd`; the eager Functions call the stats and
    mix wrappers themselves, to share sources' gradients): the sources' and the site's parameter
    gradients of one call on its own (`logits`: its forward's)."""
    site = (null, query, norm_weight, gate)
    call, dz, dq, dg, dgate = backward_stats(grad_out, logits, sources, *site, num_heads, eps, (), tables)
    dsrcs = backward_mix([call], sources, (None,) * len(sources), num_heads, tables)
    return dsrcs, dz, dq, dg, dgate
