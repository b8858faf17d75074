"""The routing op against an independent float64 evaluation of docs/design.md section 1."""

import pytest
import torch

from kernels.routing import mhar_route, mhar_route_with_weights


def route_f64(x, sources, null, query, norm_weight, gate, num_heads, eps):
    """docs/design.md's formulas token by token, head by head, source by source, in float64.

    Written with scalar tensor ops (differentiable), independently of kernels/routing.py.
    """
    x, null, query, norm_weight, gate = (t.double() for t in (x, null, query, norm_weight, gate))
    srcs = [s.double() for s in sources]
    B, T, d = x.shape
    K = d // num_heads
    rows, weights = [], torch.zeros(1 + len(srcs), B, T, num_heads, dtype=torch.float64)
    for b in range(B):
        for t in range(T):
            vecs = [null] + [s[b, t] for s in srcs]
            keys = [v / torch.sqrt((v * v).sum() / d + eps) * norm_weight for v in vecs]
            parts = []
            for h in range(num_heads):
                hs = slice(h * K, (h + 1) * K)
                logits = torch.stack([(query[hs] * k[hs]).sum() for k in keys])
                exps = torch.exp(logits - logits.max().detach())
                w = exps / exps.sum()
                weights[:, b, t, h] = w.detach()
                parts.append(sum(w[n] * vecs[n][hs] for n in range(len(vecs))))
            rows.append(x[b, t] + gate.reshape(()) * torch.cat(parts))
    return torch.stack(rows).reshape(B, T, d), weights


def random_site(d, num_sources, B=2, T=3, dtype=torch.float64, gate_shape=()):
    x = torch.randn(B, T, d, dtype=dtype)
    # sources of very different scales, as embeddings and block deltas are
    sources = [torch.randn(B, T, d, dtype=dtype) * 10.0 ** torch.empty(()).uniform_(-1, 1) for _ in range(num_sources)]
    null = torch.randn(d, dtype=dtype) * 0.5
    query = torch.randn(d, dtype=dtype)
    norm_weight = 1 + 0.3 * torch.randn(d, dtype=dtype)
    gate = torch.randn(gate_shape, dtype=dtype)
    return x, sources, null, query, norm_weight, gate


SHAPES = [(1, 37, 1), (1, 37, 8), (2, 26, 2), (2, 26, 5), (8, 40, 3), (8, 40, 8), (8, 24, 4)]  # (H, d, N - 1)


@pytest.mark.parametrize("num_heads,d,num_sources", SHAPES)
def test_forward_matches_float64_formulas(num_heads, d, num_sources):
    eps = 1e-5
    args = random_site(d, num_sources)
    want, want_w = route_f64(*args, num_heads, eps)
    got, got_w = mhar_route_with_weights(*args, num_heads=num_heads, eps=eps, backend="torch")
    assert got.dtype == torch.float64 and got_w.shape == (num_sources + 1, 2, 3, num_heads)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_w, want_w, rtol=1e-12, atol=1e-12)

    # fp32 inputs: fp32 statistics, within fp32 rounding of the float64 truth
    args32 = [a.float() if torch.is_tensor(a) else [s.float() for s in a] for a in args]
    got32 = mhar_route(*args32, num_heads=num_heads, eps=eps, backend="torch")
    assert got32.dtype == torch.float32
    scale = want.abs().max().item() + max(s.abs().max().item() for s in args[1])
    torch.testing.assert_close(got32.double(), want, rtol=0, atol=64 * torch.finfo(torch.float32).eps * scale)


@pytest.mark.parametrize("num_heads,d,num_sources", [(1, 7, 1), (2, 6, 3), (8, 16, 2), (8, 24, 8)])
def test_gradients_match_float64_formulas_and_gradcheck(num_heads, d, num_sources):
    eps = 1e-5
    args = random_site(d, num_sources, B=1, T=2, gate_shape=(1,))
    leaves = [args[0], *args[1], *args[2:]]
    for t in leaves:
        t.requires_grad_(True)

    def op(x, *rest):
        srcs, (null, q, g, gate) = list(rest[:num_sources]), rest[num_sources:]
        return mhar_route(x, srcs, null, q, g, gate, num_heads=num_heads, eps=eps, backend="torch")

    assert torch.autograd.gradcheck(op, tuple(leaves), eps=1e-6, atol=1e-7, rtol=1e-5)

    cot = torch.randn(1, 2, d, dtype=torch.float64)
    got = torch.autograd.grad((op(*leaves) * cot).sum(), leaves)
    want = torch.autograd.grad((route_f64(*args, num_heads, eps)[0] * cot).sum(), leaves)
    names = ["x"] + [f"sources[{i}]" for i in range(num_sources)] + ["null", "query", "norm_weight", "gate"]
    for name, g, w in zip(names, got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zero_gate_returns_x_bit_for_bit(dtype):
    x, sources, null, query, norm_weight, _ = random_site(64, 4, dtype=dtype)
    out = mhar_route(x, sources, null, query, norm_weight, torch.zeros(1, dtype=dtype), num_heads=8, eps=1e-5)
    assert out.dtype == dtype and torch.equal(out, x)


def test_zero_query_routes_uniformly():
    x, sources, null, _, norm_weight, gate = random_site(16, 3)
    query = torch.zeros(16, dtype=x.dtype)
    _, w = mhar_route_with_weights(x, sources, null, query, norm_weight, gate, num_heads=4, eps=1e-5)
    assert torch.equal(w, torch.full_like(w, 0.25))


def test_bad_arguments_are_named():
    x, sources, null, query, norm_weight, gate = random_site(16, 2)
    with pytest.raises(ValueError, match="num_heads=3"):
        mhar_route(x, sources, null, query, norm_weight, gate, num_heads=3, eps=1e-5)
    with pytest.raises(ValueError, match=r"sources\[1\]"):
        mhar_route(x, [sources[0], sources[1][:, :2]], null, query, norm_weight, gate, num_heads=4, eps=1e-5)
    with pytest.raises(ValueError, match="at least one source"):
        mhar_route(x, [], null, query, norm_weight, gate, num_heads=4, eps=1e-5)
    with pytest.raises(ValueError, match="'cuda'"):
        mhar_route(x, sources, null, query, norm_weight, gate, num_heads=4, eps=1e-5, backend="cuda")
