"""Stage b of the preflight probe: the fused routing kernels against the torch reference, at the run's geometry.

The training step routes a block's sites together over sources marked with `routing_source`
(`MHARTransformer.route_block`: `mhar_route_sites`, backend "triton", gate * R without x, bf16 under
FSDP's mixed precision; `--sites`, 2 per layer of a block). This module runs exactly that call, forward
and backward, for every source count a site can read, from 2 (the null and the embedding) to
`--max-sources` (counted as the project counts them, `SourceLayout.max_sources`: the null included,
[mhar] num_blocks + 1; the op takes the others, 1 to MAX_TRITON_SOURCES), and compares the forward
outputs, the routing logits and every gradient (each source's, and the null, query, norm weight and
gate of every site) with the torch backend
computed in fp32 from the same bf16 inputs. It also runs the fused call twice and requires the same
bytes, as the kernels promise (no atomics, fixed reduction order: docs/design.md section 2.6).

Bounds (one per checked tensor; `bound`): the fused op computes in fp32 and rounds its result to the
tensor's dtype once, so its error against the fp32 reference is at most
    unit * max|ref| + (rounds * unit + fp32(n) * (1 + unit)) * scale
- unit: half an ulp, relative, of the tensor's dtype (2**-8 for bf16);
- rounds: intermediate roundings to that dtype before the last one: a marked source's gradient is
  summed in place in its dtype (one mix pass per MIX["calls"] sites, then the norm term applied), so
  that many plus one for sources (2 for 2 sites) and 0 for everything else;
- scale: the conditioning scale, docs/design.md's formulas taken in absolute value (float64),
  as tests/test_routing_triton.py's `condition_scales` (re-derived here, with the outputs' and
  logits' scales added), since the softmax difference and the gate's dot product cancel;
- fp32(n): the fp32 computation's error relative to that scale: 1e-5 (the bound those tests hold
  the kernels to against the torch backend), or 8 * sqrt(n) * 2**-24 where a reduction of n terms
  is longer than theirs (the probabilistic rounding-error bound, Higham and Mary 2019, with margin).

Test seam: with the environment variable MHAR_PREFLIGHT_PERTURB_KERNEL set to a float EPS, the
fused op's forward outputs are shifted by EPS * max|output| before the comparison, so a test can
see the stage FAIL (it only changes the compared copies, not the op).
"""

from __future__ import annotations

import math
import os
import time
from typing import Any

import torch

from kernels.routing import MAX_TRITON_SOURCES, mhar_route_sites, routing_source
from kernels.triton.launch import DEFAULT_TABLES
from mhar_titan.model.sources import BASE_SOURCES, with_null, without_null

PERTURB_ENV = "MHAR_PREFLIGHT_PERTURB_KERNEL"
NORM_EPS = 1e-5  # the model's RMS-norm eps (mhar_titan/model/args.py, every flavor)
SEED = 1234
BATCH = 1
FP32_FLOOR = 1e-5  # tests/test_routing_triton.py: triton against torch in fp32, relative to the scale
FP32_MARGIN = 8.0
PARAMS = ("null", "query", "norm_weight", "gate")
SITES = "abcdefghijklmnop"  # the sites' tags, in the call's order


def perturbation() -> float | None:
    """The test seam's EPS (MHAR_PREFLIGHT_PERTURB_KERNEL), None when unset."""
    value = os.environ.get(PERTURB_ENV)
    return float(value) if value else None


def fp32_relative(n: int) -> float:
    """Error of an fp32 result of n-term reductions, relative to the terms' absolute sum."""
    return max(FP32_FLOOR, FP32_MARGIN * math.sqrt(n) * 2.0**-24)


def source_rounds(sites: int) -> int:
    """A marked source's gradient: rounded once per mix pass (one per MIX["calls"] sites), then by its norm term."""
    return -(-sites // DEFAULT_TABLES.mix["calls"]) + 1


def make_inputs(
    dim: int, num_heads: int, count: int, tokens: int, device: torch.device, sites: int = 2
) -> dict[str, Any]:
    """bf16 leaves from a fixed seed: `count` sources besides the null at scales 0.1-10 (as the tests draw them),
    `sites` sites with non-zero gates of alternating signs (the routed term matters) and a query of scale
    1 / sqrt(head width), so that the logits are O(1) at any width and the softmax's gradient is
    exercised; and the sites' output gradients."""
    gen = torch.Generator(device="cpu").manual_seed(SEED + count)
    k = dim // num_heads

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float32)

    shape = (BATCH, tokens, dim)
    sources = [randn(*shape) * 10.0 ** (2 * torch.rand((), generator=gen).item() - 1) for _ in range(count)]
    params = []
    for site in range(sites):
        gate = (-1.0) ** site * (0.5 + torch.rand(1, generator=gen))
        params.append([0.5 * randn(dim), randn(dim) / math.sqrt(k), 1 + 0.3 * randn(dim), gate])
    grad_outs = [randn(*shape) for _ in range(sites)]

    def bf16(t: torch.Tensor) -> torch.Tensor:
        return t.to(device=device, dtype=torch.bfloat16)

    return {
        "sources": [bf16(s) for s in sources],
        "sites": [[bf16(p) for p in site] for site in params],
        "grad_outs": [bf16(g) for g in grad_outs],
    }


def names(count: int, sites: int = 2) -> list[str]:
    """The checked tensors, in `route`'s order, for `count` sources besides the null (a source's or
    parameter's name stands for its gradient; source0 is the embedding's place)."""
    tags = SITES[:sites]
    params = [f"{p}_{s}" for s in tags for p in PARAMS]
    outs = [f"{kind}_{s}" for kind in ("out", "logits") for s in tags]
    return [*outs, *[f"source{i}" for i in range(count)], *params]


def route(backend: str, inputs: dict[str, Any], num_heads: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """The model's call for a block (`MHARTransformer.route_block`) on fresh leaves in `dtype`, forward
    and backward: [each site's output, each site's logits, each source's gradient, each site's
    parameter gradients]."""
    sources = [s.detach().to(dtype).requires_grad_() for s in inputs["sources"]]
    sites = [[p.detach().to(dtype).requires_grad_() for p in site] for site in inputs["sites"]]
    marked = [routing_source(s, backend) for s in sources]
    routed = mhar_route_sites(marked, sites, num_heads=num_heads, eps=NORM_EPS, backend=backend)
    outs, logits = [out for out, _ in routed], [lg for _, lg in routed]
    leaves = [*sources, *(p for site in sites for p in site)]
    grad_outs = [g.to(dtype) for g in inputs["grad_outs"]]
    grads = torch.autograd.grad(outs, leaves, grad_outs)
    return [t.detach() for t in (*outs, *logits, *grads)]


def site_scales(
    sources: list[torch.Tensor], site: list[torch.Tensor], grad_out: torch.Tensor, num_heads: int
) -> dict[str, float]:
    """Float64 conditioning scales of one site: tests/test_routing_triton.py's `condition_scales`
    (the backward of docs/design.md section 2.3 with every product and sum in absolute value), plus
    the logits' (the dot products' absolute terms) and the output's (the mix in absolute value,
    with each weight's relative error from its head's logits: up to twice their scale)."""
    s_list = [t.double() for t in sources]
    z, q, g, gate = (t.double() for t in site)
    gate = gate.abs().reshape(())
    d = s_list[0].shape[-1]
    k = d // num_heads
    do = grad_out.double().abs().unflatten(-1, (num_heads, k))
    s = torch.stack([z.expand_as(s_list[0]), *s_list])  # [N, B, T, d]
    rstd = torch.rsqrt(s.square().mean(-1, keepdim=True) + NORM_EPS)
    sh = s.unflatten(-1, (num_heads, k))
    w = torch.softmax(((s * rstd * g).unflatten(-1, (num_heads, k)) * q.view(num_heads, k)).sum(-1), dim=0)
    qg = (q * g).abs().view(num_heads, k)
    a = (sh.abs() * qg).sum(-1)  # |<(q g)_h, s_n,h>| bound, [N, B, T, H]
    logit_terms = rstd * a  # the logits' absolute terms
    spread = 1 + 2 * logit_terms.amax(0)  # [B, T, H]: a weight's error, relative, per unit logit error
    out = gate * ((w.unsqueeze(-1) * sh.abs()).sum(0) * spread.unsqueeze(-1))
    c = (do * sh.abs()).sum(-1)
    dot = (w * c).sum(0)
    dl = gate * w * (c + dot)
    t = (dl.unsqueeze(-1) * rstd.unsqueeze(-1) * sh.abs()).sum(dim=(0, 1, 2)).flatten()
    dz_mix = gate * (w[0].unsqueeze(-1) * do).sum(dim=(0, 1)).flatten()
    dz_norm = rstd[0, 0, 0] * (q * g).abs() * dl[0].sum(dim=(0, 1)).repeat_interleave(k)
    coupling = rstd**3 * (dl * a).sum(-1, keepdim=True) / d
    ds = (gate * w).unsqueeze(-1) * do + (rstd * dl).unsqueeze(-1) * qg + coupling.unsqueeze(-1) * sh.abs()
    return {
        "out": out.max().item(),
        "logits": logit_terms.max().item(),
        "null": (dz_mix + 2 * dz_norm).max().item(),
        "query": (t * g.abs()).max().item(),
        "norm_weight": (t * q.abs()).max().item(),
        "gate": (w * c).sum().item(),
        **{f"source{i}": ds[1 + i].max().item() for i in range(len(s_list))},
    }


def scales(inputs: dict[str, Any], num_heads: int) -> dict[str, float]:
    """Per checked tensor its scale: a source's is the sum of every site's (its gradient sums their
    terms), an output's or parameter's its own site's."""
    out: dict[str, float] = {}
    sites = inputs["sites"]
    for tag, site, grad_out in zip(SITES[: len(sites)], sites, inputs["grad_outs"], strict=True):
        for name, value in site_scales(inputs["sources"], site, grad_out, num_heads).items():
            key = name if name.startswith("source") else f"{name}_{tag}"
            out[key] = out.get(key, 0.0) + value
    return out


def bound(name: str, ref: torch.Tensor, dtype: torch.dtype, scale: float, dim: int, rows: int, sites: int = 2) -> float:
    """The largest error the fused result in `dtype` may have against the fp32 reference (module docstring)."""
    unit = torch.finfo(dtype).eps / 2
    rounds = source_rounds(sites) if name.startswith("source") else 0
    is_param = name.rsplit("_", 1)[0] in PARAMS
    n = max(dim, rows) if is_param else dim  # parameter gradients sum over every row and source
    return unit * ref.abs().max().item() + (rounds * unit + fp32_relative(n) * (1 + unit)) * scale


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise identity (NaNs included), not numerical equality."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def _sortable(ratio: float) -> float:
    return math.inf if math.isnan(ratio) else ratio


def check_count(
    dim: int, num_heads: int, sources: int, tokens: int, device: torch.device, perturb: float | None, sites: int = 2
) -> dict[str, Any]:
    """One source count (the null included): per checked tensor its max abs error, bound and their
    ratio; bitwise repeatability."""
    start = time.perf_counter()
    count = without_null(sources)  # the op's `sources`: the null is its own argument
    inputs = make_inputs(dim, num_heads, count, tokens, device, sites)
    ref = route("torch", inputs, num_heads, torch.float32)
    first = route("triton", inputs, num_heads, torch.bfloat16)
    second = route("triton", inputs, num_heads, torch.bfloat16)
    if perturb is not None:  # the test seam: the compared copies of the forward outputs only
        for run in (first, second):
            for i in range(sites):
                run[i] = run[i] + perturb * run[i].abs().max()
    scale = scales(inputs, num_heads)
    rows = BATCH * tokens * sources
    checks = {}
    for name, r, a in zip(names(count, sites), ref, first, strict=True):
        err = (a.double() - r.double()).abs().max().item()
        limit = bound(name, r, a.dtype, scale[name], dim, rows, sites)
        checks[name] = {"error": err, "bound": limit, "ratio": err / limit, "scale": scale[name], "dtype": str(a.dtype)}
    differ = [name for name, a, b in zip(names(count, sites), first, second, strict=True) if not same_bytes(a, b)]
    bitwise = not differ
    ok = bitwise and all(c["ratio"] <= 1.0 for c in checks.values())  # NaN compares False: not ok
    worst = max(checks, key=lambda n: _sortable(checks[n]["ratio"]))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return {
        "sources": sources,
        "ok": ok,
        "bitwise": bitwise,
        "differ": differ,
        "worst": worst,
        "worst_ratio": checks[worst]["ratio"],
        "checks": checks,
        "seconds": time.perf_counter() - start,
    }


def check_kernels(
    dim: int, num_heads: int, max_sources: int, tokens: int, device: torch.device, sites: int = 2
) -> dict[str, Any]:
    """Stage b on this rank: every source count from 2 to `max_sources` (the null included), `sites` sites
    (a block's) a call; a count the op refuses (or that raises) is recorded with its error and fails the stage."""
    start = time.perf_counter()
    perturb = perturbation()
    result: dict[str, Any] = {
        "op": "kernels.mhar_route_sites (backend triton, marked sources, no x), as MHARTransformer.route_block",
        "sites": sites,
        "reference": "backend torch, fp32 from the same bf16 inputs",
        "dim": dim,
        "num_heads": num_heads,
        "max_sources": max_sources,
        "max_triton_sources": with_null(MAX_TRITON_SOURCES),  # the null included, as max_sources
        "batch": BATCH,
        "tokens": tokens,
        "dtype": "bfloat16",
        "seed": SEED,
        "perturb": perturb,
        "counts": [],
    }
    for sources in range(len(BASE_SOURCES), max_sources + 1):
        try:
            result["counts"].append(check_count(dim, num_heads, sources, tokens, device, perturb, sites))
        except Exception as e:  # recorded per count: the others still run
            result["counts"].append({"sources": sources, "ok": False, "error": f"{type(e).__name__}: {e}"})
    result["ok"] = bool(result["counts"]) and all(c["ok"] for c in result["counts"])
    result["seconds"] = time.perf_counter() - start
    return result
