"""The triton backend against the torch reference (interpreted on CPU, compiled on a GPU)."""

import copy

import pytest
import torch
from torch.utils.checkpoint import checkpoint
from torchtitan.config import Optimizer as OptimizerConfig

import kernels.triton.launch as rt
from kernels.routing import mhar_route_with_logits, mhar_route_with_weights, route_torch, routing_source
from kernels.triton import host
from mhar_titan.components.optimizer import build_optimizers
from mhar_titan.model.args import FLAVORS, MHAR
from mhar_titan.model.model import MHARTransformer

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# (H, d, number of caller sources = N - 1, T): odd T, widths that are not powers of two, N from 2 to 9,
# one exact power-of-two shape (the unmasked path the 8B geometry takes), and heads wider than
# one chunk of the row kernels' tiles (128 fp32 or 256 bf16 columns): masked, and exact
SHAPES = [
    (1, 37, 1, 5),
    (1, 37, 8, 3),
    (8, 40, 1, 7),
    (8, 40, 4, 3),
    (8, 72, 8, 5),
    (8, 24, 6, 1),
    (1, 100, 3, 9),
    (8, 64, 3, 8),
    (1, 300, 2, 3),
    (2, 1024, 3, 2),
]


def site(H, d, S, T, dtype, B=2):
    dev = {"device": DEVICE, "dtype": dtype}
    x = torch.randn(B, T, d, **dev)
    sources = [torch.randn(B, T, d, **dev) * 10.0 ** torch.empty(()).uniform_(-1, 1).item() for _ in range(S)]
    null = 0.5 * torch.randn(d, **dev)
    query = torch.randn(d, **dev)
    norm_weight = 1 + 0.3 * torch.randn(d, **dev)
    gate = torch.randn(1, **dev)
    leaves = [x, *sources, null, query, norm_weight, gate]
    return [t.requires_grad_() for t in leaves]


def run(backend, leaves, S, H, grad_out):
    x, sources, rest = leaves[0], leaves[1 : 1 + S], leaves[1 + S :]
    out, weights = mhar_route_with_weights(x, sources, *rest, num_heads=H, eps=1e-5, backend=backend)
    grads = torch.autograd.grad(out, leaves, grad_out)
    return [out, weights, *grads]


NAMES = ["out", "weights", "x"] + [f"source{i}" for i in range(8)]


PARAMS = ("null", "query", "norm_weight", "gate")


def names(S):
    return NAMES[:3] + NAMES[3 : 3 + S] + ["null", "query", "norm_weight", "gate"]


def condition_scales(leaves, S, H, grad_out, eps=1e-5):
    """Float64 scales for the parameter and source gradients: each is a sum (over rows, sources,
    the softmax's (c - dot) difference, or a source gradient's three terms) whose terms can
    cancel, so it is only as exact as their magnitudes. This is the backward of docs/design.md's
    formulas with every product and sum taken in absolute value; errors of these gradients
    are measured against it instead of against the (possibly much smaller) result: where a
    source's gradient cancels, the torch backend's own fp32 error exceeds 1e-5 of it."""
    x, *rest = [t.detach().double() for t in leaves]
    sources, (z, q, g, gate) = rest[:S], rest[S:]
    K = x.shape[-1] // H
    do = grad_out.double().abs().unflatten(-1, (H, K))
    s = torch.stack([z.expand_as(x), *sources])  # [N, B, T, d]
    rstd = torch.rsqrt(s.square().mean(-1, keepdim=True) + eps)
    sh = s.unflatten(-1, (H, K))
    w = torch.softmax(((s * rstd * g).unflatten(-1, (H, K)) * q.view(H, K)).sum(-1), dim=0)  # [N, B, T, H]
    c = (do * sh.abs()).sum(-1)  # |<dout_h, s_n,h>|, bounded
    dot = (w * c).sum(0)
    dl = gate.abs() * w * (c + dot)  # |dl| bound per source, row, head
    t = (dl.unsqueeze(-1) * rstd.unsqueeze(-1) * sh.abs()).sum(dim=(0, 1, 2)).flatten()  # over sources and rows
    dz_mix = gate.abs() * (w[0].unsqueeze(-1) * do).sum(dim=(0, 1)).flatten()
    dz_norm = rstd[0, 0, 0] * (q * g).abs() * dl[0].sum(dim=(0, 1)).repeat_interleave(K)
    # a source's gradient, A dout + B (q g) - C s (kernels/triton/backward.py's stats kernel), term by term
    qg = (q * g).abs().view(H, K)
    a = (sh.abs() * qg).sum(-1)  # |<(q g)_h, s_n,h>| bound
    coupling = rstd**3 * (dl * a).sum(-1, keepdim=True) / x.shape[-1]  # [N, B, T, 1]
    ds = (gate.abs() * w).unsqueeze(-1) * do + (rstd * dl).unsqueeze(-1) * qg + coupling.unsqueeze(-1) * sh.abs()
    return {
        "null": (dz_mix + 2 * dz_norm).max().item(),
        "query": (t * g.abs()).max().item(),
        "norm_weight": (t * q.abs()).max().item(),
        "gate": (w * c).sum().item(),
        **{f"source{i}": ds[1 + i].max().item() for i in range(S)},
    }


def scale_of(name, ref, scales):
    return scales[name] if name in scales else ref.double().abs().max().item()


@pytest.mark.parametrize("H,d,S,T", SHAPES)
def test_fp32_matches_torch_backend_and_is_deterministic(H, d, S, T, poisoned):
    leaves = site(H, d, S, T, torch.float32)
    grad_out = torch.randn_like(leaves[0])
    ref = run("torch", leaves, S, H, grad_out)
    first = run("triton", leaves, S, H, grad_out)
    second = run("triton", leaves, S, H, grad_out)
    scales = condition_scales(leaves, S, H, grad_out)
    for name, r, a, b in zip(names(S), ref, first, second, strict=True):
        assert not torch.isnan(a).any(), f"{name}: unwritten elements"
        assert a.dtype == r.dtype and a.shape == r.shape, name
        err = (a.double() - r.double()).abs().max().item() / scale_of(name, r, scales)
        assert err <= 1e-5, f"{(H, d, S, T)} {name}: {err:.2e}"
        assert torch.equal(a, b), f"{name}: two runs differ"


@pytest.mark.parametrize("H,d,S,T", SHAPES)
def test_bf16_error_is_no_larger_than_torch_backends(H, d, S, T, poisoned):
    leaves = site(H, d, S, T, torch.bfloat16)
    grad_out = torch.randn_like(leaves[0])
    truth = run("torch", [t.detach().double().requires_grad_() for t in leaves], S, H, grad_out.double())
    torch_bf16 = run("torch", leaves, S, H, grad_out)
    triton_bf16 = run("triton", leaves, S, H, grad_out)
    scales = condition_scales(leaves, S, H, grad_out)
    for name, t, a, b in zip(names(S), truth, torch_bf16, triton_bf16, strict=True):
        assert b.dtype == a.dtype, name
        err_torch = ((a.double() - t).norm() / t.norm()).item()  # relative L2 error vs float64
        err_triton = ((b.double() - t).norm() / t.norm()).item()
        if name == "weights":
            # fp32 outputs from bf16-exact inputs: both within fp32 rounding of the truth
            assert max(err_torch, err_triton) <= 64 * torch.finfo(torch.float32).eps, name
        elif name in PARAMS:
            # A sum over rows, rounded to bf16 once: no worse than torch's, or within that
            # rounding (half an ulp of the result) plus fp32 summation error on the terms' scale.
            bound = (2.0**-9 * t.abs().max().item() + 1e-5 * scales[name]) * t.numel() ** 0.5 / t.norm().item()
            assert err_triton <= max(err_torch * 1.01, bound), (
                f"{(H, d, S, T)} {name}: triton {err_triton:.3e} > torch {err_torch:.3e}, bound {bound:.3e}"
            )
        else:
            # Both backends round an fp32 result to bf16 once; they can differ only where an
            # element's fp32 values (summed in another order) straddle a bf16 rounding boundary.
            assert err_triton <= err_torch * 1.01, (
                f"{(H, d, S, T)} {name}: triton {err_triton:.3e} > torch {err_torch:.3e}"
            )


def test_unsupported_inputs_are_refused_by_name():
    leaves = site(8, 16, 9, 2, torch.float32)
    with pytest.raises(ValueError, match="1..8 sources, got 9"):
        run("triton", leaves, 9, 8, torch.randn_like(leaves[0]))


def test_checkpointed_call_runs_its_forward_once_with_the_same_gradients(monkeypatch):
    """The backward needs only the inputs, so an activation checkpoint around one call has
    nothing to recompute: one forward launch, and exactly the gradients of the plain call."""
    S, H = 3, 8
    leaves = site(H, 40, S, 5, torch.float32)
    grad_out = torch.randn_like(leaves[0])
    launches = []
    forward = rt.fwd_launcher
    monkeypatch.setattr(rt, "fwd_launcher", lambda *a, **k: (launches.append(1), forward(*a, **k)))

    def call(x, *rest):
        return mhar_route_with_weights(x, rest[:S], *rest[S:], num_heads=H, eps=1e-5, backend="triton")[0]

    plain = torch.autograd.grad(call(*leaves), leaves, grad_out)
    launches.clear()
    out = checkpoint(call, *leaves, use_reentrant=False)
    checkpointed = torch.autograd.grad(out, leaves, grad_out)
    assert len(launches) == 1
    for name, a, b in zip(["x", *names(S)[3:]], plain, checkpointed, strict=True):
        assert torch.equal(a, b), name


def chain(leaves, S, H, calls, backend, share, extra_consumer=False):
    """`calls` routing calls of one width over the same S sources, as the model's layers make
    them (each call's input is the previous output), some of them checkpointed; returns the
    loss's gradients for every leaf."""
    x, sources, params = leaves[0], leaves[1 : 1 + S], leaves[1 + S :]
    srcs = [routing_source(s, backend) if share else s for s in sources]
    h = x
    for i in range(calls):
        n = 1 + (i * (S - 1)) // max(1, calls - 1)  # 1..S sources, as blocks complete

        def call(h, *srcs_n, n=n):
            return mhar_route_with_weights(h, srcs_n, *params, num_heads=H, eps=1e-5, backend=backend)[0]

        h = checkpoint(call, h, *srcs[:n], use_reentrant=False) if i % 2 else call(h, *srcs[:n])
    loss = (h.float() * torch.linspace(-1, 1, h.shape[-1], device=h.device)).sum()
    if extra_consumer:  # a reader of the source other than the routing calls
        loss = loss + (srcs[0].float() ** 2).sum()
    return torch.autograd.grad(loss, leaves)


def test_shared_source_gradients_are_summed_in_place_in_fp32(poisoned, monkeypatch):
    """Shared sources gather their gradient in one buffer, up to 2 or 4 calls per mix pass (the
    chain has runs of 1 and 2 calls over the same sources, and a checkpoint around every other
    call), their norm term applied once at the end.
    - Against one call per pass: the parameters' gradients come from the same kernels, equal;
      each source element adds three terms per call in another grouping, so the two differ by
      at most 2 * calls fp32 roundings of the largest element (a lost or doubled call: about
      1 / calls).
    - Against unmarked sources, which autograd sums call by call and whose norms every call
      computes itself: within the fp32 bound the op meets against the torch backend (1e-5 of
      the largest element).
    - A second run of the largest grouping (without the extra reader) is bit for bit the first."""
    S, H, calls = 4, 8, 6
    bound = 2 * calls * torch.finfo(torch.float32).eps
    leaves = site(H, 40, S, 3, torch.float32)
    for extra_consumer in (False, True):  # another reader of a source, whose gradient autograd adds
        separate = chain(leaves, S, H, calls, "triton", share=False, extra_consumer=extra_consumer)
        monkeypatch.setitem(rt.MIX, "calls", 1)
        single = chain(leaves, S, H, calls, "triton", share=True, extra_consumer=extra_consumer)
        for group in (2, 4):
            monkeypatch.setitem(rt.MIX, "calls", group)
            shared = chain(leaves, S, H, calls, "triton", share=True, extra_consumer=extra_consumer)
            rerun = group == 4 and not extra_consumer  # determinism: one rerun of the largest grouping
            again = chain(leaves, S, H, calls, "triton", share=True, extra_consumer=extra_consumer) if rerun else shared
            for name, a, b, c, d in zip(["x", *names(S)[3:]], separate, single, shared, again, strict=True):
                assert not torch.isnan(c).any(), f"{name}: unwritten elements"
                assert torch.equal(c, d), f"{name}: two runs differ"
                if name.startswith("source"):
                    err = ((c - b).abs().max() / b.abs().max()).item()
                    assert err <= bound, f"group {group} {name}: {err:.2e}"
                    err = ((c - a).abs().max() / a.abs().max()).item()
                    assert err <= 1e-5, f"group {group} {name} against unmarked: {err:.2e}"
                else:
                    assert torch.equal(b, c), name


@pytest.mark.parametrize("fwd_given", [False, True])
@pytest.mark.parametrize("H,d,S,T", SHAPES[::3])
def test_marked_sources_match_torch_backend_in_fp32(H, d, S, T, fwd_given, poisoned, monkeypatch):
    """Marked sources (routing_source) take the other path through the kernels: their norms
    computed once beforehand (read by the stats kernel, and by the forward where its table says
    so), their gradients summed in place with the norm term applied at the end. The same bound
    as unmarked ones against the torch backend."""
    monkeypatch.setitem(rt.FWD[S], "given_rstd", fwd_given)
    leaves = site(H, d, S, T, torch.float32)
    grad_out = torch.randn_like(leaves[0])
    ref = run("torch", leaves, S, H, grad_out)
    x, sources, rest = leaves[0], leaves[1 : 1 + S], leaves[1 + S :]
    marked = [routing_source(s, "triton") for s in sources]
    out, weights = mhar_route_with_weights(x, marked, *rest, num_heads=H, eps=1e-5, backend="triton")
    got = [out, weights, *torch.autograd.grad(out, leaves, grad_out)]
    scales = condition_scales(leaves, S, H, grad_out)
    for name, r, a in zip(names(S), ref, got, strict=True):
        assert not torch.isnan(a).any(), f"{name}: unwritten elements"
        err = (a.double() - r.double()).abs().max().item() / scale_of(name, r, scales)
        assert err <= 1e-5, f"{(H, d, S, T)} {name}: {err:.2e}"


def test_marked_source_changed_in_place_is_not_routed_with_a_stale_norm():
    """A marked source's norm is computed once for all the calls that read it. Changing the
    source in place afterwards and routing the marked tensor again is refused (by autograd's
    view check; the op would recompute the norm for the new version anyway)."""
    H = 8
    x, s, *params = site(H, 40, 1, 3, torch.float32)
    marked = routing_source(s, "triton")

    def out(srcs):
        return mhar_route_with_weights(x, srcs, *params, num_heads=H, eps=1e-5, backend="triton")[0]

    out([marked])
    with torch.no_grad():
        s.mul_(3.0)
    with pytest.raises(RuntimeError, match="modified inplace"):
        out([marked])


def test_shared_source_gradients_in_bf16_differ_by_rounding_only():
    """In place, each call's fp32 gradient is added to the bf16 sum and rounded once; autograd
    rounds it to bf16 first and then adds. The two sums differ by at most one rounding per
    call, 2**-8 relative each; as a relative L2 distance over many elements, by at most
    sqrt(calls) * 2**-8. A lost or doubled call would be off by about 1 / calls."""
    S, H, calls = 4, 8, 8
    leaves = site(H, 64, S, 8, torch.bfloat16)
    separate = chain(leaves, S, H, calls, "triton", share=False)
    shared = chain(leaves, S, H, calls, "triton", share=True)
    for i in range(1, 1 + S):
        a, b = separate[i].double(), shared[i].double()
        dist = ((b - a).norm() / a.norm()).item()
        assert dist <= calls**0.5 * 2.0**-8, f"source{i - 1}: {dist:.3e}"


def test_same_shared_source_twice_in_one_call():
    """One tensor as two sources of a call: its gradient is the two slots' gradients summed, by autograd
    (unmarked) or inside the kernel (marked). Both sum the same terms in other orders, so each is held to
    the file's bound against float64, 1e-5 of the gradient's conditioning scale: both slots' term
    magnitudes (condition_scales), not the result, which can cancel (a bound relative to max |result|
    failed on an H200 once in seven runs)."""
    H = 8
    leaves = site(H, 40, 1, 3, torch.float32)
    x, s, *params = leaves
    grad_out = torch.randn_like(x)

    def grads(srcs):
        out = mhar_route_with_weights(x, srcs, *params, num_heads=H, eps=1e-5, backend="triton")[0]
        return torch.autograd.grad(out, [s], grad_out)[0]

    a, b = grads([s, s]), grads([routing_source(s, "triton")] * 2)
    x64, s64, *params64 = [t.detach().double().requires_grad_() for t in leaves]
    out64 = route_torch(x64, [s64, s64], *params64, num_heads=H, eps=1e-5)[0]
    truth = torch.autograd.grad(out64, [s64], grad_out.double())[0]
    scales = condition_scales([x, s, s, *params], 2, H, grad_out)
    scale = scales["source0"] + scales["source1"]
    for name, got in (("autograd sum", a), ("in-kernel sum", b)):
        err = (got.double() - truth).abs().max().item() / scale
        assert err <= 1e-5, f"{name}: {err:.2e}"


def test_inputs_changed_in_place_or_a_second_backward_are_refused():
    H = 8
    leaves = site(H, 40, 2, 3, torch.float32)
    x, s0, s1, *params = leaves

    def out():
        return mhar_route_with_weights(x, [s0, s1], *params, num_heads=H, eps=1e-5, backend="triton")[0].sum()

    loss = out()
    with torch.no_grad():
        s1.mul_(2)
    with pytest.raises(RuntimeError, match=r"call's source 1 was modified in place"):
        loss.backward()
    loss = out()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="twice"):
        loss.backward()
    out, logits = mhar_route_with_logits(x, [s0, s1], *params, num_heads=H, eps=1e-5, backend="triton")
    logits.mul_(0.5)  # the backward reads them: changed, every gradient would be wrong
    with pytest.raises(RuntimeError, match=r"call's routing logits \(an output\) was modified in place"):
        out.sum().backward()


def test_logits_of_another_shape_are_refused_by_the_backward():
    """The stats kernel indexes the logits as [N, rows, H]: others would read other rows' logits."""
    H, S = 8, 2
    leaves = site(H, 40, S, 3, torch.float32)
    x, sources, params = leaves[0], leaves[1 : 1 + S], [t.detach() for t in leaves[1 + S :]]
    _, logits = host.forward(x.detach(), [s.detach() for s in sources], *params, H, 1e-5)
    grad = torch.randn_like(x)
    for bad, what in ((logits[:, :1], r"shape \(3, 1, 3, 8\)"), (logits.transpose(1, 2), "not contiguous")):
        with pytest.raises(ValueError, match=what):
            host.backward_stats(grad, bad, [s.detach() for s in sources], *params, H, 1e-5)


def test_routing_source_is_the_tensor_itself_where_nothing_is_shared():
    t = torch.randn(2, 3, 8, requires_grad=True)
    assert routing_source(t, "torch") is t
    frozen = t.detach()
    assert routing_source(frozen, "triton") is frozen  # grad on, nothing to sum: unmarked
    with torch.no_grad():  # a view carrying the norm only, the same data
        marked = routing_source(t, "triton")
        assert marked is not t and marked.data_ptr() == t.data_ptr()
    assert routing_source(t, "triton") is not t


def test_without_grad_the_forward_computes_exactly_what_it_computes_with_grad():
    """Validation and evaluation run the forward without grad: with the marked sources' norms read
    as in training, the outputs are the training forward's bit for bit."""
    H = 8
    x, *rest = site(H, 40, 3, 5, torch.float32)
    sources, params = rest[:3], rest[3:]

    def forward():
        marked = [routing_source(s, "triton") for s in sources]
        return mhar_route_with_weights(None, marked, *params, num_heads=H, eps=1e-5, backend="triton")

    with_grad = forward()
    with torch.no_grad():
        without = forward()
    for a, b in zip(with_grad, without, strict=True):
        assert torch.equal(a.detach(), b)


def test_tiny_model_trains_alike_on_both_backends():
    losses = {}
    for backend in ("torch", "triton"):
        args = copy.deepcopy(FLAVORS["tiny"])
        args.max_seq_len = 16
        args.mhar = MHAR(enable=True, num_blocks=2, backend=backend)
        torch.manual_seed(0)
        with torch.device(DEVICE):
            model = MHARTransformer(args)
            with torch.no_grad():
                model.init_weights()
        opt = build_optimizers([model], OptimizerConfig(lr=1e-2, implementation="for-loop"), parallel_dims=None)
        gen = torch.Generator().manual_seed(1)
        losses[backend] = []
        for _ in range(2):  # the second loss is after one update through either backend's backward
            tokens = torch.randint(0, args.vocab_size, (1, 17), generator=gen).to(DEVICE)
            logits = model(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses[backend].append(loss.item())
        gates = torch.stack([p.detach() for n, p in model.named_parameters() if n.endswith(".gate")])
        assert gates.abs().min() > 0  # the routing trained
    torch.testing.assert_close(losses["triton"], losses["torch"], rtol=1e-5, atol=0)


@pytest.mark.parametrize("backend", ["triton", "triton_op"])
@pytest.mark.parametrize("H,d,S,T", SHAPES[::2])
def test_without_x_the_op_returns_gate_times_r_as_the_torch_backend(H, d, S, T, backend, poisoned):
    """x = None (how the model calls it: its compiled block adds x): gate * R and the routing
    weights, and the gradients of everything else, within the file's fp32 bound."""
    x, *rest = site(H, d, S, T, torch.float32)
    grad_out = torch.randn_like(x)
    scales = condition_scales([torch.zeros_like(x), *rest], S, H, grad_out)
    sources, params = rest[:S], rest[S:]
    results = {}
    for name in ("torch", backend):
        out, weights = mhar_route_with_weights(None, sources, *params, num_heads=H, eps=1e-5, backend=name)
        results[name] = [out, weights, *torch.autograd.grad(out, rest, grad_out)]
    for name, r, a in zip(names(S)[:2] + names(S)[3:], results["torch"], results[backend], strict=True):
        assert not torch.isnan(a).any(), f"{name}: unwritten elements"
        err = (a.double() - r.double()).abs().max().item() / scale_of(name, r, scales)
        assert err <= 1e-5, f"{(H, d, S, T)} {name}: {err:.2e}"


class _Alias(torch.autograd.Function):
    """Returns its inputs, as FSDP2's pre-forward hook does for a module's inputs (new tensors)."""

    @staticmethod
    def forward(tag, *inputs):
        return inputs

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, *grads):
        return (None, *grads)


def test_aliases_of_marked_sources_share_their_slots(monkeypatch):
    """A call given aliases of the marked sources (FSDP2 hands a module such aliases) sums their
    gradients in place as with the marked tensors: the same kernels in the same order, so the
    same gradients bit for bit and one mix pass per group of calls."""
    S, H = 3, 8
    leaves = site(H, 40, S, 3, torch.float32)
    sources, params = leaves[1 : 1 + S], leaves[1 + S :]
    grad_out = torch.randn_like(leaves[0])
    mixes = []
    mix = rt.mix_launcher
    monkeypatch.setattr(rt, "mix_launcher", lambda *a, **k: (mixes.append(1), mix(*a, **k)))

    def grads(alias):
        marked = [routing_source(s, "triton") for s in sources]
        total = 0
        for _ in range(2):  # the two sites of a layer, one mix pass for both
            srcs = list(_Alias.apply("fsdp", *marked)) if alias else marked
            total = total + mhar_route_with_weights(None, srcs, *params, num_heads=H, eps=1e-5, backend="triton")[0]
        return torch.autograd.grad(total, sources, grad_out)

    direct = grads(alias=False)
    launches = len(mixes)
    through = grads(alias=True)
    assert launches == len(mixes) - launches == 1
    for a, b in zip(direct, through, strict=True):
        assert torch.equal(a, b)


def test_a_call_waiting_for_its_mix_pass_keeps_its_own_parameters(monkeypatch):
    """The mix pass of the later call waits for the earlier one; by then FSDP2 may have freed the
    later call's gathered parameters. Overwriting them in between changes no gradient."""
    monkeypatch.setitem(rt.MIX, "calls", 2)
    S, H = 2, 8
    x, *rest = site(H, 40, S, 3, torch.float32)
    sources = rest[:S]
    first = [p.detach().clone().requires_grad_() for p in rest[S:]]
    second = [(p.detach() * 1.5).requires_grad_() for p in rest[S:]]

    def grads(spoil):
        marked = [routing_source(s, "triton") for s in sources]
        h = mhar_route_with_weights(x, marked, *first, num_heads=H, eps=1e-5, backend="triton")[0]
        if spoil:  # after the second call's backward (deferred), before the first's (which runs the pass)
            h.register_hook(lambda g: [p.data.fill_(float("nan")) for p in second] and None)
        out = mhar_route_with_weights(h, marked, *second, num_heads=H, eps=1e-5, backend="triton")[0]
        return torch.autograd.grad(out.sum(), sources)

    clean = grads(spoil=False)
    for p, q in zip(second, rest[S:], strict=True):
        p.data.copy_(q.detach() * 1.5)
    for a, b in zip(clean, grads(spoil=True), strict=True):
        assert torch.equal(a, b)


def test_a_marked_source_routed_again_after_its_gradient_was_handed_on_is_refused():
    H = 8
    x, s, *params = site(H, 40, 1, 3, torch.float32)
    marked = routing_source(s, "triton")
    mhar_route_with_weights(x, [marked], *params, num_heads=H, eps=1e-5, backend="triton")[0].sum().backward()
    out = mhar_route_with_weights(x, [marked], *params, num_heads=H, eps=1e-5, backend="triton")[0]
    with pytest.raises(RuntimeError, match="after the source's gradient sum was handed on"):
        out.sum().backward()


@pytest.mark.parametrize("backend", ["torch", "triton", "triton_op"])
def test_under_autocast_the_site_is_read_as_fsdp_gathers_it(backend, poisoned):
    """One GPU trains under autocast with fp32 parameters: the op reads them in the autocast dtype,
    as FSDP's mixed precision gathers them, so gate * R, the sources' gradients and the parameters'
    gradients rounded to bf16 are exactly those of the same call on bf16 parameters; the output
    without x has the autocast dtype, with x x's, and the gradients keep their tensors' dtypes."""
    H, d, T = 8, 40, 5
    leaves = site(H, d, 2, T, torch.float32)
    sources = [s.detach().bfloat16().requires_grad_() for s in leaves[1:3]]
    params = leaves[3:]
    as_fsdp = [p.detach().bfloat16().requires_grad_() for p in params]
    ref, _ = mhar_route_with_weights(None, sources, *as_fsdp, num_heads=H, eps=1e-5, backend=backend)
    ref_grads = torch.autograd.grad(ref.float().square().sum(), [*sources, *as_fsdp])
    with torch.autocast(torch.device(DEVICE).type, dtype=torch.bfloat16):
        out, _ = mhar_route_with_weights(None, sources, *params, num_heads=H, eps=1e-5, backend=backend)
        with_x, _ = mhar_route_with_weights(leaves[0], sources, *params, num_heads=H, eps=1e-5, backend=backend)
    assert out.dtype == torch.bfloat16 and with_x.dtype == torch.float32
    assert torch.equal(out, ref)
    grads = torch.autograd.grad(out.float().square().sum(), [*sources, *params])
    assert [g.dtype for g in grads] == [t.dtype for t in (*sources, *params)]
    for g, r in zip(grads, ref_grads, strict=True):
        assert torch.equal(g.bfloat16(), r)


@pytest.mark.parametrize("backend", ["triton", "triton_op"])
def test_without_x_the_output_has_the_parameters_dtype_whatever_the_sources(backend, poisoned):
    """Under FSDP's mixed precision the embedding source can be fp32 while the block deltas and the
    gathered site parameters are bf16: gate * R comes out in the parameters' dtype, rounded once,
    as close to the float64 truth as the torch backend's."""
    H, d, T = 8, 40, 5
    leaves = site(H, d, 3, T, torch.float32)
    sources = [leaves[1], leaves[2].detach().bfloat16().requires_grad_(), leaves[3]]
    params = [p.detach().bfloat16().requires_grad_() for p in leaves[4:]]
    truth = route_torch(None, [s.double() for s in sources], *[p.double() for p in params], num_heads=H, eps=1e-5)[0]
    ref = route_torch(None, sources, *params, num_heads=H, eps=1e-5)[0]
    out, _ = mhar_route_with_weights(None, sources, *params, num_heads=H, eps=1e-5, backend=backend)
    assert out.dtype == ref.dtype == torch.bfloat16 and not torch.isnan(out).any()
    err_ref = ((ref.double() - truth).norm() / truth.norm()).item()
    err = ((out.double() - truth).norm() / truth.norm()).item()
    assert err <= err_ref * 1.01, f"{err:.3e} vs torch {err_ref:.3e}"  # as the bf16 test above
    grads = torch.autograd.grad(out.float().square().sum(), [*sources, *params])
    assert [g.dtype for g in grads] == [t.dtype for t in (*sources, *params)]
