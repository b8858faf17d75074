"""The kernel benchmark's microbatch harness, on CPU at a tiny size: its triton arms (calls as the
model makes them, a block's sites in one call, a layer's two or one call per site, sources marked with
routing_source, gradients summed in place) compute the gradients its eager arm computes (per-call
checkpoints), and its forwards with and without grad compute the same outputs."""

import collections
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_routing_triton import condition_scales

import kernels.triton.launch as rt
from benchmarks.routing_bytes import PASSES, pass_bytes
from benchmarks.routing_cases import Microbatch, route_fns


def test_microbatch_arms_compute_the_same_gradients():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    mb = Microbatch(1, 3, 24, num_layers=4, num_blocks=2, device=device, dtype=torch.float32)
    fns = route_fns(8, 1e-5)
    grads = {}
    arms = (
        ("triton", "triton", False, "block"),
        ("triton_layer", "triton", False, "layer"),
        ("triton_site", "triton", False, None),
        ("eager", "torch", True, None),
    )
    for name, backend, wrapped, grouping in arms:
        mb.forward_backward(fns[name], backend, keep_grads=True, wrapped=wrapped, grouping=grouping)
        grads[name] = [t.grad.clone() for t in mb.leaves()]
        # and without keep_grads: nothing is left behind
        mb.forward_backward(fns[name], backend, wrapped=wrapped, grouping=grouping)
        assert all(t.grad is None for t in mb.leaves())
    assert len(grads["triton"]) == 2 + 8 * 4  # two sources; per call four parameters
    # a block's sites in one call, a layer's two, compute what one call each computes, bit for bit
    for arm in ("triton", "triton_layer"):
        for i, (a, b) in enumerate(zip(grads[arm], grads["triton_site"], strict=True)):
            assert torch.equal(a, b), f"{arm}, leaf {i}"
    # the triton op keeps references to its inputs only: under a per-call checkpoint it is not
    # re-run, so the same kernels run in the same order and the gradients are bitwise the same
    mb.forward_backward(fns["triton_site"], "triton", keep_grads=True, wrapped=True)
    for i, (a, b) in enumerate(zip(mb.leaves(), grads["triton_site"], strict=True)):
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
        fast = fns["triton_site"](*params, *mb.sources[:n])
    assert torch.equal(fast, fns["triton_site"](*params, *mb.sources[:n]).detach())
    for grouping in ("block", "layer"):
        n, sites = mb.groups(grouping)[-1]
        with torch.no_grad():
            fast = fns["triton"](sites, *mb.sources[:n])
        for a, b in zip(fast, fns["triton"](sites, *mb.sources[:n]), strict=True):
            assert torch.equal(a, b.detach())
        mb.forward(fns["triton"], grouping=grouping)
        mb.forward(fns["triton"], grad=True, grouping=grouping)
    mb.forward(fns["eager"], grad=True, wrapped=True)  # each call checkpointed, as the benchmark runs it


def test_an_unknown_kernel_to_tune_is_refused_by_name_before_anything_runs():
    """Checked before the GPU is looked for: on a GPU, an unknown name would otherwise time nothing."""
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_routing", "--tune", "pair,stat"],
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "--tune: unknown ['stat']" in proc.stderr, proc.stderr


@pytest.mark.parametrize("block_kernels", [None, "block", "grouped"])
def test_the_byte_model_counts_the_launches_each_path_makes(block_kernels, monkeypatch):
    """benchmarks.routing_bytes, which each pass's share of copy bandwidth divides by, counts the launches of
    every kernel that the block, layer and per-site paths make over a microbatch (launchers counted), with
    the default tables, with a block's forward in one pass of the block kernel, and with its pairs in one
    launch of the two-site kernels (forward and stats)."""
    mb = Microbatch(1, 3, 24, num_layers=4, num_blocks=2, device="cpu", dtype=torch.float32)
    tables = rt.DEFAULT_TABLES
    if block_kernels:
        per_pass = 4 if block_kernels == "block" else 2
        tables = tables.replace(fwd_sites={n: {"grouped": True} for n in (1, 2)})
        tables = tables.replace(
            fwd_sites={n: {"sites": per_pass} for n in (1, 2)}, stats_pair={n: {"grouped": True} for n in (1, 2)}
        )
    kinds = {
        "fwd": "forward",
        "sites": "forward",
        "stats": "stats",
        "mix": "mix",
        "norm": "norm",
        "rstd": "rstd",
        "finish": "finish",
    }
    counted = collections.Counter()
    for name, kind in kinds.items():
        launcher = getattr(rt, f"{name}_launcher")
        monkeypatch.setattr(
            rt, f"{name}_launcher", lambda *a, k=kind, f=launcher, **kw: (counted.update([k]), f(*a, **kw))
        )
    fns = route_fns(8, 1e-5, tables)
    for arm, grouping in (("triton", "block"), ("triton_layer", "layer"), ("triton_site", None)):
        counted.clear()
        mb.forward_backward(fns[arm], "triton", grouping=grouping)
        model = pass_bytes(mb.call_shapes(grouping), 3, 24, 8, 4, tables)
        assert {kind: launches for kind, (launches, _) in model.items()} == {k: counted[k] for k in PASSES}, arm
        unit = 3 * 24 * 4
        if grouping is None:  # one call a site: each reads its sources and writes its output and logits
            want = sum((n + 1) * unit + (n + 1) * 3 * 8 * 4 for n, _ in mb.calls)
            assert model["forward"][1] == want
