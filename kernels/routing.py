"""The delta-MHAR routing op and its explicit backend dispatch (docs/design.md sections 1 and 2).

    out = x + gate * R(sources),   R_[h] = sum_n softmax_n(<q_h, k_{n,[h]}>) * s_{n,[h]}
    k_n = s_n / rms(s_n) * g       (rms over the full width, fp32, eps = the model's norm eps)

Source 0 is the site's learnable null vector z, broadcast over tokens; the
caller's sources (embedding, then completed block deltas) follow in order.

Backends, named by the caller (`backend=`), each one code path:
- `torch`: `route_torch`, the plain reference every other backend is tested against;
- `triton`: the fused kernels through an eager autograd.Function (kernels/triton/autograd.py,
  `route_eager`; `route_sites_eager` for sites over the same sources, `mhar_route_sites`),
  which sums the gradients of sources marked with `routing_source` in place.
  Inside a torch.compile graph it is `triton_op`: autograd.py declares that substitution once,
  with torch.compile's `substitute_in_graph` (the eager path cannot be traced). The model's
  training routes outside its compiled block bodies, so it runs this path, compiled or not;
- `triton_op`: the same kernels through the custom op `torch.ops.mhar.route_fwd` (`route_op`),
  in eager mode too;
- `auto`: `triton` on CUDA, `torch` elsewhere.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kernels.triton.autograd import cast_site, route_eager, route_op, route_sites_eager
from kernels.triton.launch import MAX_SOURCES as MAX_TRITON_SOURCES
from kernels.triton.shared import share_source_grad

BACKENDS = ("auto", "torch", "triton", "triton_op")
__all__ = [
    "BACKENDS",
    "MAX_TRITON_SOURCES",
    "autocast_dtype",
    "compute_dtype",
    "mhar_route",
    "mhar_route_sites",
    "mhar_route_with_logits",
    "mhar_route_with_weights",
    "resolve_backend",
    "route_torch",
    "routing_source",
]


def _check(x: torch.Tensor | None, sources: Sequence[torch.Tensor], query: torch.Tensor, num_heads: int) -> None:
    if len(sources) == 0:
        raise ValueError("mhar_route needs at least one source besides the null source")
    ref, what = (sources[0], "sources[0]") if x is None else (x, "x")
    d = ref.shape[-1]
    if num_heads <= 0 or d % num_heads:
        raise ValueError(f"num_heads={num_heads} must be positive and divide the width {d}")
    for i, s in enumerate(sources):
        if s.shape != ref.shape:
            raise ValueError(f"sources[{i}] has shape {tuple(s.shape)}, {what} has {tuple(ref.shape)}")
    if query.shape != (d,):
        raise ValueError(f"query has shape {tuple(query.shape)}, expected ({d},)")


def route_torch(
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
    """Reference routing: returns (x + gate * R, or gate * R when x is None; routing logits
    [N, *shape[:-1], H], whose softmax over N is the routing weights). Its parameters as given
    (`mhar_route` casts them under autocast).

    Statistics and accumulation run in fp32 (fp64 for fp64 inputs); the output has x's dtype,
    or without x `out_dtype` (`compute_dtype`: the autocast dtype, else the site parameters').
    The stacked copy of the sources is fine for a reference.
    """
    _check(x, sources, query, num_heads)
    ref = sources[0] if x is None else x
    acc = torch.promote_types(torch.promote_types(ref.dtype, query.dtype), torch.float32)
    d = ref.shape[-1]
    head_dim = d // num_heads
    s = torch.stack([null.to(acc).expand_as(ref)] + [t.to(acc) for t in sources])  # [N, ..., d]
    rstd = torch.rsqrt(s.square().mean(dim=-1, keepdim=True) + eps)
    k = s * rstd * norm_weight.to(acc)
    heads = (*s.shape[:-1], num_heads, head_dim)
    logits = (k.view(heads) * query.to(acc).view(num_heads, head_dim)).sum(dim=-1)  # [N, ..., H]
    weights = torch.softmax(logits, dim=0)
    mixed = (weights.unsqueeze(-1) * s.view(heads)).sum(dim=0).reshape(ref.shape)
    out = gate.to(acc).reshape(()) * mixed
    if x is None:
        return out.to(out_dtype or query.dtype), logits
    return (x.to(acc) + out).to(x.dtype), logits


def autocast_dtype(device: torch.device) -> torch.dtype | None:
    """Under autocast the op reads its site parameters (null, query, norm weight, gate) in the
    autocast dtype, as autocast's matmuls read their weights and as FSDP's mixed precision gathers
    them: one GPU computes what N ranks compute. None where autocast is off."""
    return torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else None


def compute_dtype(query: torch.Tensor) -> torch.dtype:
    """The dtype of gate * R without x: autocast's where it is on (one GPU without FSDP, whose
    fp32 parameters would otherwise make every routed term and its gradient fp32), else the site
    parameters' (bf16 under FSDP's mixed precision, whatever the sources')."""
    return autocast_dtype(query.device) or query.dtype


def resolve_backend(backend: str, device: torch.device) -> str:
    """`auto`: the fused Triton kernels (eager path) on CUDA, the reference elsewhere."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}: expected one of {BACKENDS}")
    if backend == "auto":
        return "triton" if device.type == "cuda" else "torch"
    return backend


def routing_source(source: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """Mark a tensor that many routing calls will read (the embedding, a block delta).

    With the triton backend, eager calls then add their gradients for it into one buffer
    inside their backward kernel, rather than autograd summing one new tensor per call.
    Other backends (triton_op included: the custom op returns its gradients), and code
    that only reads the tensor, see it unchanged.
    """
    if resolve_backend(backend, source.device) == "triton":
        return share_source_grad(source)
    return source


def mhar_route_with_logits(
    x: torch.Tensor | None,
    sources: Sequence[torch.Tensor],
    null: torch.Tensor,
    query: torch.Tensor,
    norm_weight: torch.Tensor,
    gate: torch.Tensor,
    *,
    num_heads: int,
    eps: float,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """`mhar_route` that also returns the routing logits [N, B, T, H] (fp32, or fp64 for fp64
    inputs with the torch backend; source 0 the null): the fused backward reads them, and their
    softmax over N is the routing weights (`mhar_route_with_weights`)."""
    _check(x, sources, query, num_heads)
    backend = resolve_backend(backend, sources[0].device)
    kw = {"num_heads": num_heads, "eps": eps, "out_dtype": None if x is not None else compute_dtype(query)}
    param_dtype = autocast_dtype(sources[0].device)
    if backend == "triton":
        return route_eager(x, sources, null, query, norm_weight, gate, param_dtype=param_dtype, **kw)
    site = cast_site((null, query, norm_weight, gate), param_dtype)
    if backend == "triton_op":
        return route_op(x, sources, *site, **kw)
    return route_torch(x, sources, *site, **kw)


def mhar_route_with_weights(
    x: torch.Tensor | None,
    sources: Sequence[torch.Tensor],
    null: torch.Tensor,
    query: torch.Tensor,
    norm_weight: torch.Tensor,
    gate: torch.Tensor,
    *,
    num_heads: int,
    eps: float,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """`mhar_route` that also returns the routing weights [N, B, T, H] (fp32) for statistics."""
    out, logits = mhar_route_with_logits(
        x, sources, null, query, norm_weight, gate, num_heads=num_heads, eps=eps, backend=backend
    )
    return out, torch.softmax(logits, dim=0)


def mhar_route(
    x: torch.Tensor | None,
    sources: Sequence[torch.Tensor],
    null: torch.Tensor,
    query: torch.Tensor,
    norm_weight: torch.Tensor,
    gate: torch.Tensor,
    *,
    num_heads: int,
    eps: float,
    backend: str = "auto",
) -> torch.Tensor:
    """x + gate * R(sources) for one routing site.

    x: [B, T, d] the site's stream input, or None for gate * R alone, in `compute_dtype`
    (the model adds x inside its compiled block, where the add costs nothing); sources: [B, T, d] tensors
    (embedding, then completed block deltas), in order; null, query, norm_weight: [d];
    gate: one element (0-dim, or [1] as FSDP2 stores it, since it cannot shard
    0-dim parameters). Under autocast the parameters are read in its dtype (`autocast_dtype`).
    """
    out, _ = mhar_route_with_logits(
        x, sources, null, query, norm_weight, gate, num_heads=num_heads, eps=eps, backend=backend
    )
    return out


def mhar_route_sites(
    sources: Sequence[torch.Tensor],
    sites: Sequence[Sequence[torch.Tensor]],
    *,
    num_heads: int,
    eps: float,
    backend: str = "auto",
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """gate * R(sources) for sites over the same sources (a block's attention and MLP inputs), with
    each site's routing logits [N, B, T, H]: `mhar_route_with_logits(None, ...)` per site, computed
    together. Each site is (null, query, norm_weight, gate). With the triton backend the forward
    reads each source once for several sites, and each backward stats pass once for two."""
    if not sites or any(len(site) != 4 for site in sites):
        raise ValueError("mhar_route_sites takes one or more sites, each (null, query, norm_weight, gate)")
    for site in sites:
        _check(None, sources, site[1], num_heads)
    backend = resolve_backend(backend, sources[0].device)
    if backend == "triton" and len({site[1].dtype for site in sites}) == 1:
        out_dtype, param_dtype = compute_dtype(sites[0][1]), autocast_dtype(sources[0].device)
        return route_sites_eager(
            sources, sites, num_heads=num_heads, eps=eps, out_dtype=out_dtype, param_dtype=param_dtype
        )
    return [
        mhar_route_with_logits(None, sources, *site, num_heads=num_heads, eps=eps, backend=backend) for site in sites
    ]
