"""The two autograd paths over the routing kernels: `route_op` (a torch.library custom op) and `route_eager`.

- `route_op`: `torch.ops.mhar.route_fwd` / `route_bwd`, custom ops with autograd, which
  torch.compile keeps in its graph as one node each instead of breaking at every call; it saves
  its inputs and its routing logits with save_for_backward and returns every gradient
  (`route_bwd` runs `host.custom_op_backward`). A graph traced through `route_eager` takes this
  path (see `_route_eager_in_graph`).
- `route_eager`: a plain autograd.Function (`_Route`) over the same host wrappers, without the
  custom-op dispatch, whose Python cost per call exceeds the kernels' own (docs/history/kernels-notebook.md). It
  keeps the inputs and logits on its context (not save_for_backward), so an activation checkpoint
  around a call has nothing to unpack and never re-runs the forward, and it sums the gradients of
  sources marked with `shared.share_source_grad` in place. Its backward (`_Route.backward`) runs
  `host.backward_stats`, then `host.backward_mix` or `shared.backward_mix_shared`. The model's
  training runs this path: it routes outside its compiled, checkpointed block bodies.
Both return the routing logits [N, *shape[:-1], H] (fp32, the null's first) beside the output:
the backward reads them rather than recomputing them, and statistics take their softmax.

- `route_sites_eager`: `route_eager` for several sites over the same sources (a block's sites):
  the forward reads each source once for several sites (host.forward_sites), each stats pass once
  for two.

Which path runs is the caller's choice, by function (or kernels.routing's backend name:
"triton_op" for `route_op`, "triton" for `route_eager` and `route_sites_eager`). One rule is
declared here, with torch.compile's `substitute_in_graph`: a graph that Dynamo traces through
`route_eager` (or `route_sites_eager`) gets `route_op` in its place, since the eager path's
autograd.Function and launcher cannot be traced.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kernels.triton import host, shared
from kernels.triton.launch import DEFAULT_TABLES, LaunchTables


@torch.library.custom_op("mhar::route_fwd", mutates_args=())
def route_fwd(
    x: torch.Tensor | None,
    sources: list[torch.Tensor],
    null: torch.Tensor,
    query: torch.Tensor,
    norm_weight: torch.Tensor,
    gate: torch.Tensor,
    num_heads: int,
    eps: float,
    out_dtype: torch.dtype | None,  # no default: a traced call would leave it out, and the backward's
    # gradients must match the arguments passed
) -> tuple[torch.Tensor, torch.Tensor]:
    return host.forward(x, sources, null, query, norm_weight, gate, num_heads, eps, out_dtype=out_dtype)


@route_fwd.register_fake
def _(x, sources, null, query, norm_weight, gate, num_heads, eps, out_dtype):
    ref = sources[0] if x is None else x
    logits = ref.new_empty((len(sources) + 1, *ref.shape[:-1], num_heads), dtype=torch.float32)
    out = torch.empty_like(ref) if x is not None else torch.empty_like(ref, dtype=out_dtype or query.dtype)
    return out, logits


@torch.library.custom_op("mhar::route_bwd", mutates_args=())
def route_bwd(
    grad_out: torch.Tensor,
    logits: torch.Tensor,
    sources: list[torch.Tensor],
    null: torch.Tensor,
    query: torch.Tensor,
    norm_weight: torch.Tensor,
    gate: torch.Tensor,
    num_heads: int,
    eps: float,
) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return host.custom_op_backward(grad_out, logits, sources, null, query, norm_weight, gate, num_heads, eps)


@route_bwd.register_fake
def _(grad_out, logits, sources, null, query, norm_weight, gate, num_heads, eps):
    return (
        [torch.empty_like(s) for s in sources],
        torch.empty_like(null),
        torch.empty_like(query),
        torch.empty_like(norm_weight),
        torch.empty_like(gate),
    )


def _setup_context(ctx, inputs, output) -> None:
    x, sources, null, query, norm_weight, gate, num_heads, eps, *_ = inputs
    ctx.num_heads, ctx.eps, ctx.has_x = num_heads, eps, x is not None
    ctx.save_for_backward(null, query, norm_weight, gate, output[1], *sources)


def _op_backward(ctx, grad_out, grad_logits):
    null, query, norm_weight, gate, logits, *sources = ctx.saved_tensors
    dsrcs, dz, dq, dg, dgate = route_bwd(
        grad_out, logits, sources, null, query, norm_weight, gate, ctx.num_heads, ctx.eps
    )
    return grad_out if ctx.has_x else None, dsrcs, dz, dq, dg, dgate, None, None, None


route_fwd.register_autograd(_op_backward, setup_context=_setup_context)


def route_op(
    x: torch.Tensor | None,
    sources: Sequence[torch.Tensor],
    null: torch.Tensor,
    query: torch.Tensor,
    norm_weight: torch.Tensor,
    gate: torch.Tensor,
    *,
    num_heads: int,
    eps: float,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused routing through the custom op (default launch tables): (x + gate * R, or gate * R in
    `out_dtype` (default: the parameters') when x is None; routing logits [N, *shape[:-1], H] fp32)."""
    return torch.ops.mhar.route_fwd(x, list(sources), null, query, norm_weight, gate, num_heads, eps, out_dtype)


def _unpack_inputs(ctx) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """(The inputs, the logits per site) kept by forward, released here: the graph may outlive the
    backward (the loss of one microbatch is alive during the next), the sources should not."""
    inputs, ctx.inputs = ctx.inputs, None
    logits, ctx.logits = ctx.logits, None
    if inputs is None:
        raise RuntimeError(
            "mhar_route: backward through the same triton routing call twice (retain_graph=True) is not "
            "supported; use backend='torch' for double backward"
        )
    names = ("null", "query", "norm_weight", "gate")
    per_site = [f"site {k} {name}" for k in range(ctx.num_sites) for name in names] if ctx.num_sites > 1 else names
    sites = [f"site {k} " if ctx.num_sites > 1 else "" for k in range(ctx.num_sites)]
    kept = (*inputs, *logits)
    for i, (t, version) in enumerate(zip(kept, ctx.versions, strict=True)):
        if t._version != version:
            if i < len(per_site):
                what = per_site[i]
            elif i < len(inputs):
                what = f"source {i - len(per_site)}"
            else:  # the backward reads them: a change there would change every gradient
                what = f"{sites[i - len(inputs)]}routing logits (an output)"
            raise RuntimeError(
                f"mhar_route: the routing call's {what} was modified in place after the call (version "
                f"{version} -> {t._version}); its gradient would be wrong"
            )
    return inputs, logits


class _Route(torch.autograd.Function):
    """The kernels for eager mode, without the custom-op dispatch."""

    @staticmethod
    def forward(ctx, x, null, query, norm_weight, gate, num_heads, eps, tables, out_dtype, param_dtype, *sources):
        ctx.slots = shared.grad_slots(sources)
        rstds = _marked_rstds(sources, ctx.slots, eps, tables)
        site = in_dtype((null, query, norm_weight, gate), param_dtype)
        out, logits = host.forward(x, sources, *site, num_heads, eps, tables, rstds, out_dtype)
        ctx.num_heads, ctx.eps, ctx.rstds, ctx.tables, ctx.has_x = num_heads, eps, rstds, tables, x is not None
        ctx.num_sites, ctx.site = 1, site
        # The backward needs the inputs (not x) and the logits. Kept on ctx rather than saved
        # with save_for_backward, so an activation checkpoint around the call has no saved
        # tensor to unpack and never re-runs the forward; the version check that
        # save_for_backward would do is done in backward.
        ctx.inputs, ctx.logits = (null, query, norm_weight, gate, *sources), (logits,)
        ctx.versions = [t._version for t in (*ctx.inputs, logits)]
        ctx.mark_non_differentiable(logits)
        ctx.set_materialize_grads(False)  # no zero-filled gradient for the logits
        return out, logits

    @staticmethod
    def backward(ctx, grad_out, grad_logits):
        inputs, (logits,) = _unpack_inputs(ctx)
        params, sources = inputs[:4], inputs[4:]  # the parameters: their gradients' dtypes
        site, ctx.site = ctx.site, None
        if grad_out is None:  # the output did not reach the loss
            return (None,) * (10 + len(sources))
        shared.check_open(ctx.slots)
        rstds, ctx.rstds = ctx.rstds, None
        tables = ctx.tables
        call, dz, dq, dg, dgate = host.backward_stats(
            grad_out, logits, sources, *site, ctx.num_heads, ctx.eps, rstds, tables, grad_like=params
        )
        # A shared source's gradient goes to its slot (None to autograd), the others to autograd.
        if all(slot is not None for slot in ctx.slots):
            shared.backward_mix_shared(call, sources, ctx.slots, ctx.num_heads, tables)
            dsrcs = [None] * len(sources)
        else:
            dsrcs = host.backward_mix([call], sources, ctx.slots, ctx.num_heads, tables)
        dx = grad_out if ctx.has_x else None
        return dx, dz, dq, dg, dgate, None, None, None, None, None, *dsrcs


def route_eager(
    x: torch.Tensor | None,
    sources: Sequence[torch.Tensor],
    null: torch.Tensor,
    query: torch.Tensor,
    norm_weight: torch.Tensor,
    gate: torch.Tensor,
    *,
    num_heads: int,
    eps: float,
    tables: LaunchTables | None = None,
    out_dtype: torch.dtype | None = None,
    param_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused routing through the eager autograd.Function: (x + gate * R, or gate * R in
    `out_dtype` (default: the parameters') when x is None; routing logits [N, *shape[:-1], H]
    fp32). `param_dtype`: the dtype the kernels read the site parameters in (autocast's,
    kernels/routing.py; None: theirs); their gradients keep the parameters' dtype. `tables`:
    launch shapes, DEFAULT_TABLES unless a benchmark passes its own. With nothing to
    differentiate (validation, evaluation, inference) the forward kernel is launched directly,
    with no autograd bookkeeping."""
    tables = tables or DEFAULT_TABLES
    if not torch.is_grad_enabled() or not _any_requires_grad(x, null, query, norm_weight, gate, sources):
        rstds = _marked_rstds(sources, shared.grad_slots(sources), eps, tables)  # the norms read with grad too
        site = in_dtype((null, query, norm_weight, gate), param_dtype)
        return host.forward(x, sources, *site, num_heads, eps, tables, rstds, out_dtype)
    return _Route.apply(x, null, query, norm_weight, gate, num_heads, eps, tables, out_dtype, param_dtype, *sources)


class _RouteSites(torch.autograd.Function):
    """Sites over the same sources (a block's, the model's call): `host.forward_sites` routes them in
    passes that read each source once for several sites; the backward, once every output's gradient
    is in, runs one stats pass per two sites (each source read once for both); otherwise `_Route`,
    once per site."""

    @staticmethod
    def forward(ctx, num_heads, eps, tables, out_dtype, param_dtype, n_params, *inputs):
        params, sources = inputs[:n_params], inputs[n_params:]
        work = in_dtype(params, param_dtype)
        sites = tuple(host.Site(*work[at : at + 4]) for at in range(0, n_params, 4))
        ctx.slots = shared.grad_slots(sources)
        rstds = _marked_rstds(sources, ctx.slots, eps, tables)
        results = host.forward_sites(sources, sites, num_heads, eps, tables, rstds, out_dtype)
        logits = tuple(lg for _, lg in results)
        ctx.num_heads, ctx.eps, ctx.rstds, ctx.tables, ctx.num_sites = num_heads, eps, rstds, tables, len(sites)
        ctx.sites = sites
        ctx.inputs, ctx.logits = inputs, logits  # kept on ctx, not saved: as in _Route
        ctx.versions = [t._version for t in (*inputs, *logits)]
        ctx.mark_non_differentiable(*logits)
        ctx.set_materialize_grads(False)
        return tuple(t for result in results for t in result)

    @staticmethod
    def backward(ctx, *grads):
        inputs, logits = _unpack_inputs(ctx)
        n_params = 4 * ctx.num_sites
        params = [inputs[at : at + 4] for at in range(0, n_params, 4)]  # their gradients' dtypes
        sources = inputs[n_params:]
        sites, ctx.sites = ctx.sites, None
        rstds, ctx.rstds = ctx.rstds, None
        grad_outs = grads[::2]  # each site's output; the logits get none
        reached = [k for k, g in enumerate(grad_outs) if g is not None]
        if not reached:  # no output reached the loss
            return (None,) * (6 + len(inputs))
        shared.check_open(ctx.slots)
        results, summed = {}, None  # summed: unshared sources' gradients, one mix pass per call
        # the last sites first, two a pass, as autograd would run one call per layer (the later one first)
        pairs = [reached[max(0, at - 2) : at] for at in range(len(reached), 0, -2)]
        shape = ctx.tables.stats_pair[len(sources)]
        whole = [pair for pair in pairs if len(pair) == 2] if shape else []
        # the whole pairs in one launch, or one launch a pair, as the table says
        for paired in [[k for pair in whole for k in pair]] if shape and shape["grouped"] else whole:
            both = host.backward_stats_pair(
                [grad_outs[k] for k in paired],
                [logits[k] for k in paired],
                sources,
                [sites[k] for k in paired],
                ctx.num_heads,
                ctx.eps,
                rstds,
                ctx.tables,
                grads_like=[params[k] for k in paired],
            )
            results.update(zip(paired, both, strict=True))
        for k in reached:  # a site whose pair did not reach the loss, or the table asks for single-site passes
            if k not in results:
                results[k] = host.backward_stats(
                    grad_outs[k],
                    logits[k],
                    sources,
                    *sites[k],
                    ctx.num_heads,
                    ctx.eps,
                    rstds,
                    ctx.tables,
                    grad_like=params[k],
                )
        for pair in pairs:
            # the pair's second site first, as two separate calls would sum them: bit for bit the same sums
            for call in [results[k][0] for k in pair][::-1]:
                if all(slot is not None for slot in ctx.slots):
                    shared.backward_mix_shared(call, sources, ctx.slots, ctx.num_heads, ctx.tables)
                    continue
                more = host.backward_mix([call], sources, ctx.slots, ctx.num_heads, ctx.tables)
                summed = (
                    more
                    if summed is None
                    else [a if a is None else a.add_(b) for a, b in zip(summed, more, strict=True)]
                )
        dsrcs = summed if summed is not None else [None] * len(sources)
        dparams = [results[k][1:] if k in results else (None,) * 4 for k in range(ctx.num_sites)]
        return (None,) * 6 + tuple(g for site in dparams for g in site) + tuple(dsrcs)


def route_sites_eager(
    sources: Sequence[torch.Tensor],
    sites: Sequence[Sequence[torch.Tensor]],
    *,
    num_heads: int,
    eps: float,
    tables: LaunchTables | None = None,
    out_dtype: torch.dtype | None = None,
    param_dtype: torch.dtype | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Sites over the same sources (a block's) through `_RouteSites`: per site (gate * R in
    `out_dtype`, default its parameters'; routing logits [N, *shape[:-1], H] fp32). Each site is (null,
    query, norm weight, gate); `param_dtype` as in `route_eager`. Without anything to differentiate
    the forward kernels are launched directly, as in `route_eager`."""
    tables = tables or DEFAULT_TABLES
    params = tuple(t for site in sites for t in site)
    if not torch.is_grad_enabled() or not any(t.requires_grad for t in (*params, *sources)):
        rstds = _marked_rstds(sources, shared.grad_slots(sources), eps, tables)
        work = in_dtype(params, param_dtype)
        cast = tuple(host.Site(*work[at : at + 4]) for at in range(0, len(work), 4))
        return host.forward_sites(sources, cast, num_heads, eps, tables, rstds, out_dtype)
    flat = _RouteSites.apply(num_heads, eps, tables, out_dtype, param_dtype, len(params), *params, *sources)
    return [(flat[at], flat[at + 1]) for at in range(0, len(flat), 2)]


def in_dtype(params: Sequence[torch.Tensor], dtype: torch.dtype | None) -> tuple[torch.Tensor, ...]:
    """The site parameters as the kernels read them: in `dtype` (None, or theirs: unchanged), joined
    and cast in two kernels, not one cast per parameter (a `cat` into a buffer of another dtype
    copies each input on its own); detached, as the Functions differentiate through their own
    backward."""
    if dtype is None or all(p.dtype == dtype for p in params):
        return tuple(params)
    flat = torch.cat([p.detach().reshape(-1) for p in params]).to(dtype)
    views, at = [], 0
    for p in params:
        views.append(flat[at : at + p.numel()].view(p.shape))
        at += p.numel()
    return tuple(views)


def _marked_rstds(sources, slots, eps: float, tables: LaunchTables) -> list[torch.Tensor | None]:
    """Each marked source's 1 / rms per row, for the row kernels: computed by the first call that
    reads it; None for unmarked sources."""
    rstds = []
    for s, slot in zip(sources, slots, strict=True):
        if slot is not None:
            slot.tables = tables
        rstds.append(None if slot is None else slot.source_rstd(s, eps))
    return rstds


def _any_requires_grad(x, null, query, norm_weight, gate, sources) -> bool:
    if (x is not None and x.requires_grad) or null.requires_grad or query.requires_grad:
        return True
    return norm_weight.requires_grad or gate.requires_grad or any(s.requires_grad for s in sources)


@torch.compiler.substitute_in_graph(route_eager)
def _route_eager_in_graph(
    x: torch.Tensor | None,
    sources: Sequence[torch.Tensor],
    null: torch.Tensor,
    query: torch.Tensor,
    norm_weight: torch.Tensor,
    gate: torch.Tensor,
    *,
    num_heads: int,
    eps: float,
    tables: LaunchTables | None = None,
    out_dtype: torch.dtype | None = None,
    param_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """What torch.compile traces in place of `route_eager`: `route_op`, one graph node (with the
    default launch tables, the only ones the custom op knows)."""
    return _route_op_cast(x, sources, (null, query, norm_weight, gate), num_heads, eps, out_dtype, param_dtype)


@torch.compiler.substitute_in_graph(route_sites_eager)
def _route_sites_eager_in_graph(
    sources: Sequence[torch.Tensor],
    sites: Sequence[Sequence[torch.Tensor]],
    *,
    num_heads: int,
    eps: float,
    tables: LaunchTables | None = None,
    out_dtype: torch.dtype | None = None,
    param_dtype: torch.dtype | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """What torch.compile traces in place of `route_sites_eager`: `route_op` once per site."""
    return [_route_op_cast(None, sources, site, num_heads, eps, out_dtype, param_dtype) for site in sites]


def _route_op_cast(x, sources, site, num_heads: int, eps: float, out_dtype, param_dtype):
    """`route_op` on the site's parameters cast to `param_dtype` in the graph."""
    return route_op(x, sources, *cast_site(site, param_dtype), num_heads=num_heads, eps=eps, out_dtype=out_dtype)


def cast_site(params: Sequence[torch.Tensor], dtype: torch.dtype | None) -> list[torch.Tensor]:
    """The site parameters in `dtype` (None: as they are), cast through autograd: the torch and
    custom-op paths. The eager Functions cast inside instead (`in_dtype`: one buffer, fp32
    gradients written by the finishing kernel)."""
    return [p if dtype is None else p.to(dtype) for p in params]
