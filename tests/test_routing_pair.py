"""Two sites over the same sources in one pass (kernels.routing.mhar_route_sites, a layer's two sites):
against the torch reference, and against the same two sites routed one call each."""

import pytest
import torch
from test_routing_triton import PARAMS, SHAPES, condition_scales, scale_of, site
from torch._dynamo.utils import counters

import kernels.triton.launch as rt
from kernels.routing import mhar_route_sites, mhar_route_with_logits, routing_source
from kernels.triton.autograd import route_sites_eager

EPS = 1e-5


def pair(H, d, S, T, dtype):
    """Two sites' leaves over one set of sources: [*sources, *site_a, *site_b], all requiring grad."""
    first = site(H, d, S, T, dtype)
    second = site(H, d, S, T, dtype)
    return first[1 : 1 + S] + first[1 + S :] + second[1 + S :]


def split(leaves, S):
    return leaves[:S], (leaves[S : S + 4], leaves[S + 4 :])


def routed_pair(backend, leaves, S, H, grad_outs, mark=False):
    """[out_a, out_b, logits_a, logits_b, *gradients of the leaves]."""
    sources, sites = split(leaves, S)
    srcs = [routing_source(s, backend) for s in sources] if mark else sources
    (out_a, lg_a), (out_b, lg_b) = mhar_route_sites(srcs, sites, num_heads=H, eps=EPS, backend=backend)
    grads = torch.autograd.grad([out_a, out_b], leaves, grad_outs)
    return [out_a, out_b, lg_a, lg_b, *grads]


def routed_one_by_one(leaves, S, H, grad_outs, mark=False):
    """The same, with one triton call per site."""
    sources, sites = split(leaves, S)
    srcs = [routing_source(s, "triton") for s in sources] if mark else sources
    outs = [mhar_route_with_logits(None, srcs, *p, num_heads=H, eps=EPS, backend="triton") for p in sites]
    grads = torch.autograd.grad([o for o, _ in outs], leaves, grad_outs)
    return [outs[0][0], outs[1][0], outs[0][1], outs[1][1], *grads]


def names(S):
    sites = [f"{p}_{s}" for s in "ab" for p in PARAMS]
    return ["out_a", "out_b", "logits_a", "logits_b"] + [f"source{i}" for i in range(S)] + sites


def scales_of(leaves, S, H, grad_outs):
    """Per gradient, the float64 conditioning scale of test_routing_triton's bounds: a source's is
    the sum of both sites' (its gradient sums their terms), a parameter's its own site's."""
    sources, sites = split(leaves, S)
    out = {}
    for tag, params, grad_out in zip("ab", sites, grad_outs, strict=True):
        x = torch.zeros_like(sources[0])  # only its shape and dtype are read
        one = condition_scales([x, *sources, *params], S, H, grad_out)
        for name, value in one.items():
            key = name if name.startswith("source") else f"{name}_{tag}"
            out[key] = out.get(key, 0.0) + value
    return out


# odd widths and one head; 8 sources (the most); heads wider than a chunk, exact; sources marked or not
@pytest.mark.parametrize("H,d,S,T,mark", [(*SHAPES[0], False), (*SHAPES[4], True), (*SHAPES[9], False)])
def test_fp32_matches_torch_backend_and_is_deterministic(H, d, S, T, mark, poisoned):
    leaves = pair(H, d, S, T, torch.float32)
    grad_outs = [torch.randn_like(leaves[0]) for _ in range(2)]
    ref = routed_pair("torch", leaves, S, H, grad_outs)
    first = routed_pair("triton", leaves, S, H, grad_outs, mark)
    second = routed_pair("triton", leaves, S, H, grad_outs, mark)
    scales = scales_of(leaves, S, H, grad_outs)
    for name, r, a, b in zip(names(S), ref, first, second, strict=True):
        assert not torch.isnan(a).any(), f"{name}: unwritten elements"
        assert a.dtype == r.dtype and a.shape == r.shape, name
        err = (a.double() - r.double()).abs().max().item() / scale_of(name, r, scales)
        assert err <= 1e-5, f"{(H, d, S, T)} {name}: {err:.2e}"
        assert torch.equal(a, b), f"{name}: two runs differ"


@pytest.mark.parametrize(
    "H,d,S,T,dtype,two_site_stats", [(*SHAPES[3], torch.float32, False), (*SHAPES[4], torch.bfloat16, True)]
)
def test_equals_one_call_per_site_bit_for_bit(H, d, S, T, dtype, two_site_stats, poisoned, monkeypatch):
    """Each site's outputs, logits and parameter gradients are those of its own call: the pair
    runs the same arithmetic in the same order, one load of each source serving both. So are the
    marked sources' gradients, which both ways sum in one mix pass per layer. The backward takes
    one two-site stats pass or, where its table says None, two single-site ones: both checked."""
    shape = {"rows": 32, "warps_per_4096": 8, "maxnreg": None, "given_rstd": True, "prefetch": False, "grouped": False}
    monkeypatch.setitem(rt.STATS_PAIR, S, shape if two_site_stats else None)
    leaves = pair(H, d, S, T, dtype)
    grad_outs = [torch.randn_like(leaves[0]) for _ in range(2)]
    together = routed_pair("triton", leaves, S, H, grad_outs, mark=True)
    apart = routed_one_by_one(leaves, S, H, grad_outs, mark=True)
    for name, a, b in zip(names(S), together, apart, strict=True):
        assert torch.equal(a, b), name


# one source, as a pair (two-site passes) and one call per site (single-site passes), and eight as
# a pair; in the interpreter a program walks 4 rows, so the last program's prefetch runs past the
# input's end
@pytest.mark.parametrize("H,d,S,T,singles", [(*SHAPES[2], True), (1, 37, 8, 5, False)])
def test_prefetch_changes_no_bit(H, d, S, T, singles, poisoned, monkeypatch):
    """Issuing a row's first loads while the row before finishes (the tables' `prefetch`) loads
    the same values into the same arithmetic: every output, weight and gradient is bit for bit
    what it is without."""
    leaves = pair(H, d, S, T, torch.bfloat16)
    grad_outs = [torch.randn_like(leaves[0]) for _ in range(2)]

    def routed():
        got = routed_pair("triton", leaves, S, H, grad_outs, mark=True)
        return got + routed_one_by_one(leaves, S, H, grad_outs) if singles else got

    tables = [t for t in (rt.FWD, rt.STATS, rt.FWD_PAIR, rt.STATS_PAIR) if t[S] is not None]
    for table in tables:
        monkeypatch.setitem(table[S], "prefetch", False)
    plain = routed()
    for table in tables:
        monkeypatch.setitem(table[S], "prefetch", True)
    seen = set()
    for kind in ("fwd", "stats"):
        launcher = getattr(rt, f"{kind}_launcher")

        def recorded(grid, warps, consts, *args, kind=kind, launcher=launcher, **kw):
            seen.add((kind, consts["PREFETCH"]))
            return launcher(grid, warps, consts, *args, **kw)

        monkeypatch.setattr(rt, f"{kind}_launcher", recorded)
    for name, a, b in zip(names(S) * (2 if singles else 1), plain, routed(), strict=True):
        assert torch.equal(a, b), name
    assert seen == {("fwd", True), ("stats", True)}


def test_one_site_unused_gets_no_gradient_and_the_other_its_own(poisoned):
    """When only one site's output reaches the loss, that site's call runs alone: the unused
    site's parameters get no gradient, everything else is the one-call result."""
    H, d, S, T = 8, 40, 3, 5
    leaves = pair(H, d, S, T, torch.float32)
    sources, sites = split(leaves, S)
    grad_out = torch.randn_like(sources[0])
    (out_a, _), (out_b, _) = mhar_route_sites(sources, sites, num_heads=H, eps=EPS, backend="triton")
    got = torch.autograd.grad(out_b, leaves, grad_out, allow_unused=True)
    out, _ = mhar_route_with_logits(None, sources, *sites[1], num_heads=H, eps=EPS, backend="triton")
    want = torch.autograd.grad(out, [*sources, *sites[1]], grad_out)
    assert all(g is None for g in got[S : S + 4])
    for name, a, b in zip(["s0", "s1", "s2", *PARAMS], [*got[:S], *got[S + 4 :]], want, strict=True):
        assert torch.equal(a, b), name


def test_without_grad_the_forward_computes_exactly_what_it_computes_with_grad():
    H, d, S, T = 8, 64, 4, 3
    leaves = pair(H, d, S, T, torch.float32)
    sources, sites = split(leaves, S)
    with torch.no_grad():
        marked = [routing_source(s, "triton") for s in sources]
        plain = mhar_route_sites(marked, sites, num_heads=H, eps=EPS, backend="triton")
    marked = [routing_source(s, "triton") for s in sources]
    graded = mhar_route_sites(marked, sites, num_heads=H, eps=EPS, backend="triton")
    for (a, wa), (b, wb) in zip(plain, graded, strict=True):
        assert torch.equal(a, b) and torch.equal(wa, wb)
        assert b.requires_grad and not a.requires_grad


def test_under_autocast_the_pair_reads_its_sites_as_fsdp_gathers_them(poisoned):
    """The layer's call on one GPU (fp32 parameters under autocast) computes exactly what it computes
    on bf16 parameters (FSDP's): outputs, logits, the marked sources' gradients, the parameters'
    gradients once rounded to bf16 (they keep fp32); with and without grad."""
    H, d, S, T = 8, 40, 3, 5
    leaves = pair(H, d, S, T, torch.float32)
    sources = [s.detach().bfloat16().requires_grad_() for s in leaves[:S]]
    params = leaves[S:]
    as_fsdp = [p.detach().bfloat16().requires_grad_() for p in params]
    grad_outs = [torch.randn_like(sources[0]) for _ in range(2)]
    want = routed_pair("triton", [*sources, *as_fsdp], S, H, grad_outs, mark=True)
    with torch.autocast(sources[0].device.type, dtype=torch.bfloat16):
        got = routed_pair("triton", [*sources, *params], S, H, grad_outs, mark=True)
        with torch.no_grad():
            marked = [routing_source(s, "triton") for s in sources]
            plain = mhar_route_sites(marked, split(leaves, S)[1], num_heads=H, eps=EPS, backend="triton")
    assert [g.dtype for g in got[4 + S :]] == [torch.float32] * 8
    for name, a, b in zip(names(S), got, want, strict=True):
        assert torch.equal(a.to(b.dtype), b), name
    for (out, logits), a, lg in zip(plain, got[:2], got[2:4], strict=True):
        assert torch.equal(out, a) and torch.equal(logits, lg)


def test_one_forward_and_one_stats_launch_serve_both_sites(monkeypatch):
    """What makes the pair cheaper: one forward and one stats kernel per layer, not one per site
    (at the source counts whose table entry takes the two-site stats pass)."""
    H, d, S, T = 8, 40, 3, 3
    assert rt.STATS_PAIR[S] is not None
    counts = {"fwd": 0, "stats": 0}
    for kind in counts:
        launcher = getattr(rt, f"{kind}_launcher")

        def counted(*args, kind=kind, launcher=launcher, **kw):
            counts[kind] += 1
            return launcher(*args, **kw)

        monkeypatch.setattr(rt, f"{kind}_launcher", counted)
    leaves = pair(H, d, S, T, torch.float32)
    routed_pair("triton", leaves, S, H, [torch.randn_like(leaves[0]) for _ in range(2)], mark=True)
    assert counts == {"fwd": 1, "stats": 1}


def test_sites_are_checked_by_name():
    H, d, S, T = 8, 40, 2, 3
    leaves = pair(H, d, S, T, torch.float32)
    sources, sites = split(leaves, S)
    with pytest.raises(ValueError, match="one or more sites"):
        mhar_route_sites(sources, sites[:0], num_heads=H, eps=EPS, backend="triton")
    bad = (sites[0], [sites[1][0], sites[1][1][:8], *sites[1][2:]])
    with pytest.raises(ValueError, match="query has shape"):
        mhar_route_sites(sources, bad, num_heads=H, eps=EPS, backend="triton")


def test_a_traced_graph_routes_the_pair_through_the_custom_op():
    """torch.compile cannot trace the eager pair path; a graph that calls it runs the custom op once
    per site instead (autograd.py's substitute_in_graph): no graph break, and the custom op's
    numbers, gradients included (its autograd under tracing: arguments at their defaults are left
    out of a traced call, so the op's signature has none)."""
    H, d, S, T = 8, 40, 2, 3
    leaves = pair(H, d, S, T, torch.float32)
    sources, sites = split(leaves, S)
    grad_outs = [torch.randn_like(sources[0]) for _ in range(2)]

    def both(srcs, a, b):
        return [out for out, _ in route_sites_eager(srcs, [a, b], num_heads=H, eps=EPS)]

    torch._dynamo.reset()
    counters.clear()
    traced = torch.compile(both, backend="aot_eager", fullgraph=True)(sources, *sites)
    assert not counters["graph_break"]
    got = [*traced, *torch.autograd.grad(traced, leaves, grad_outs)]
    ops = [mhar_route_with_logits(None, sources, *p, num_heads=H, eps=EPS, backend="triton_op")[0] for p in sites]
    want = [*ops, *torch.autograd.grad(ops, leaves, grad_outs)]
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), i


def test_a_site_parameter_changed_in_place_is_refused_by_name():
    H, d, S, T = 8, 40, 2, 3
    leaves = pair(H, d, S, T, torch.float32)
    sources, sites = split(leaves, S)
    outs = mhar_route_sites(sources, sites, num_heads=H, eps=EPS, backend="triton")
    with torch.no_grad():
        sites[1][1].mul_(2)  # the second site's query
    with pytest.raises(RuntimeError, match=r"call's site 1 query was modified in place"):
        torch.autograd.grad([o for o, _ in outs], leaves, [torch.ones_like(sources[0])] * 2)
    # the backward reads the logits the forward returned: changed in place, they are refused too
    outs = mhar_route_sites(sources, sites, num_heads=H, eps=EPS, backend="triton")
    outs[0][1].sub_(outs[0][1].amax(dim=0))  # a user's in-place normalisation of site 0's logits
    with pytest.raises(RuntimeError, match=r"call's site 0 routing logits \(an output\) was modified in place"):
        torch.autograd.grad([o for o, _ in outs], leaves, [torch.ones_like(sources[0])] * 2)


def block(H, d, S, T, dtype, count):
    """`count` sites' leaves over one set of sources: [*sources, *site_0, ..., *site_{count-1}]."""
    draws = [site(H, d, S, T, dtype) for _ in range(count)]
    return draws[0][1 : 1 + S] + [p for draw in draws for p in draw[1 + S :]]


# a block of 2 and of 4 layers (4 and 8 sites) through the block forward kernel and the block's pairs in one
# stats launch, through the two-site kernels a launch a pair, and with every pair in one launch of each:
# odd widths, 8 sources, one head
@pytest.mark.parametrize(
    "H,d,S,T,count,per_pass,grouped",
    [
        (*SHAPES[0], 4, 4, True),
        (*SHAPES[4], 8, 8, True),
        (*SHAPES[9], 4, 4, True),
        (*SHAPES[4], 4, 2, False),
        (*SHAPES[6], 8, 2, True),
    ],
)
def test_a_blocks_sites_match_torch_and_repeat_bit_for_bit(H, d, S, T, count, per_pass, grouped, poisoned):
    """Every site's output, logits and gradients (each source's summed over the block's sites) within the
    file's fp32 bound of the torch backend, and the same bits on a second run, whichever kernels a
    block's call takes (the launch tables' `sites` a forward pass, `grouped` pairs in one launch)."""
    # grouped: the block's stats pairs in one launch, and with two sites a pass its forward pairs too
    tables = rt.DEFAULT_TABLES.replace(
        fwd_sites={S: {"sites": per_pass, "grouped": grouped}}, stats_pair={S: {"grouped": grouped}}
    )
    leaves = block(H, d, S, T, torch.float32, count)
    grad_outs = [torch.randn_like(leaves[0]) for _ in range(count)]

    def routed(backend, tables=None):
        sources = [routing_source(s, backend) for s in leaves[:S]]
        sites = [leaves[S + 4 * k : S + 4 * k + 4] for k in range(count)]
        if backend == "torch":
            outs = mhar_route_sites(sources, sites, num_heads=H, eps=EPS, backend="torch")
        else:
            outs = route_sites_eager(sources, sites, num_heads=H, eps=EPS, tables=tables)
        grads = torch.autograd.grad([o for o, _ in outs], leaves, grad_outs)
        return [o for o, _ in outs] + [lg for _, lg in outs] + list(grads)

    ref, first, second = routed("torch"), routed("triton", tables), routed("triton", tables)
    tags = [f"site{k}" for k in range(count)]
    names_ = [f"out_{t}" for t in tags] + [f"logits_{t}" for t in tags] + [f"source{i}" for i in range(S)]
    names_ += [f"{p}_{t}" for t in tags for p in PARAMS]
    scales = {}
    for k, tag in enumerate(tags):
        params = leaves[S + 4 * k : S + 4 * k + 4]
        one = condition_scales([torch.zeros_like(leaves[0]), *leaves[:S], *params], S, H, grad_outs[k])
        for name, value in one.items():
            key = name if name.startswith("source") else f"{name}_{tag}"
            scales[key] = scales.get(key, 0.0) + value
    for name, r, a, b in zip(names_, ref, first, second, strict=True):
        assert not torch.isnan(a).any(), f"{name}: unwritten elements"
        err = (a.double() - r.double()).abs().max().item() / scale_of(name, r, scales)
        assert err <= 1e-5, f"{(H, d, S, T)} {name}: {err:.2e}"
        assert torch.equal(a, b), f"{name}: two runs differ"
