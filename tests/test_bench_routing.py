"""The kernel benchmark's microbatch harness, on CPU at a tiny size: its triton arm (calls as the
model makes them, sources marked with routing_source, gradients summed in place) computes the
gradients its eager arm computes (per-call checkpoints), and its forwards with and without grad
compute the same outputs."""

import torch
from test_routing_triton import condition_scales

from benchmarks.bench_routing import Microbatch, route_fns


def test_microbatch_arms_compute_the_same_gradients():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    mb = Microbatch(1, 3, 24, num_layers=4, num_blocks=2, device=device, dtype=torch.float32)
    fns = route_fns(8, 1e-5)
    grads = {}
    for name, backend, wrapped in (("triton", "triton", False), ("eager", "torch", True)):
        mb.forward_backward(fns[name], backend, keep_grads=True, wrapped=wrapped)
        grads[name] = [t.grad.clone() for t in mb.leaves()]
        mb.forward_backward(fns[name], backend, wrapped=wrapped)  # and without keep_grads: nothing is left behind
        assert all(t.grad is None for t in mb.leaves())
    assert len(grads["triton"]) == 2 + 8 * 4  # two sources; per call four parameters
    # the triton op keeps references to its inputs only: under a per-call checkpoint it is not
    # re-run, so the same kernels run in the same order and the gradients are bitwise the same
    mb.forward_backward(fns["triton"], "triton", keep_grads=True, wrapped=True)
    for i, (a, b) in enumerate(zip(mb.leaves(), grads["triton"], strict=True)):
        assert torch.equal(a.grad, b), f"leaf {i}"
    # fp32: the two backends agree within test_routing_triton's bound, 1e-5 of the largest
    # element, or for the parameters of the conditioning scale of their sum over rows
    zero = torch.zeros_like(mb.sources[0])
    scales = [None] * len(mb.sources)
    for n, params in mb.calls:
        call_scales = condition_scales([zero, *mb.sources[:n], *params], n, 8, mb.grad_out)
        scales += [call_scales[name] for name in ("null", "query", "norm_weight", "gate")]
    for i, (a, b, scale) in enumerate(zip(grads["triton"], grads["eager"], scales, strict=True)):
        err = ((a - b).abs().max() / (b.abs().max() if scale is None else scale)).item()
        assert err <= 1e-5, f"leaf {i}: {err:.2e}"
    # the no-grad forward launches the kernel directly: the same outputs as with grad on
    n, params = mb.calls[-1]
    with torch.no_grad():
        fast = fns["triton"](*params, *mb.sources[:n])
    assert torch.equal(fast, fns["triton"](*params, *mb.sources[:n]).detach())
    mb.forward(fns["triton"])
    mb.forward(fns["triton"], grad=True)
