"""MHAR's activation checkpointing keeps the fused routing op's outputs instead of re-running it."""

import functools

import torch
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

import kernels.triton.host as rt
from mhar_titan.model.parallelize import keep_routing_outputs

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_full_ac_keeps_routing_outputs_and_changes_no_number(monkeypatch):
    calls = []
    forward = rt.forward
    monkeypatch.setattr(rt, "forward", lambda *a: calls.append(1) or forward(*a))
    B, T, d, H = 2, 5, 24, 8
    x, emb, delta = (torch.randn(B, T, d, device=DEVICE, requires_grad=True) for _ in range(3))
    params = [torch.randn(n, device=DEVICE, requires_grad=True) for n in (d, d, d, 1)]
    leaves = [x, emb, delta, *params]
    grad_out = torch.randn(B, T, d, device=DEVICE)

    def block(x, emb, delta, *params):  # the routing op inside a checkpointed region, then more work
        out, weights = torch.ops.mhar.route_fwd(x, [emb, delta], *params, H, 1e-5)
        return (out.tanh() * 2).sum(-1, keepdim=True) * out + weights.sum()

    results = {}
    for name, context_fn in [
        ("full", None),
        ("keep routing", functools.partial(create_selective_checkpoint_contexts, keep_routing_outputs)),
    ]:
        calls.clear()
        kwargs = {"context_fn": context_fn} if context_fn else {}
        out = checkpoint(block, *leaves, use_reentrant=False, **kwargs)
        grads = torch.autograd.grad(out, leaves, grad_out)
        results[name] = (len(calls), [out, *grads])
    assert results["full"][0] == 2  # forward, then the recompute in backward
    assert results["keep routing"][0] == 1  # forward only
    for a, b in zip(results["full"][1], results["keep routing"][1], strict=True):
        assert torch.equal(a, b)
