"""Fused Triton kernels for `mhar_route` (the `triton` backend).

Forward: one pass over the sources per token row, all heads at once; online
softmax, the full-width RMS norm fused, fp32 statistics, the null source read
as one vector per program. Saves only the routing weights [N, M, H] (fp32).

Backward: two passes over the sources per row (the first gathers the per-head
dot products the softmax gradient couples, the second writes each source's
gradient), the norm recomputed. Weight gradients (query, norm weight, null,
gate) are per-program partials that a finishing kernel sums in a fixed order: no
atomics, so repeated runs are bitwise identical.

Registered as `torch.ops.mhar.route_fwd` / `route_bwd` custom ops with autograd,
so torch.compile keeps them in its graph instead of breaking at every call; eager
calls go through a plain autograd.Function over the same launchers.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from kernels.routing import MAX_TRITON_SOURCES as MAX_SOURCES


@triton.jit
def _row_tile_offsets(BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, H: tl.constexpr, K: tl.constexpr):
    hh = tl.arange(0, BLOCK_H)[:, None]
    kk = tl.arange(0, BLOCK_K)[None, :]
    return hh * K + kk, (hh < H) & (kk < K)


@triton.jit
def _load(ptr, mask, EVEN: tl.constexpr):
    """A row tile as fp32; unmasked when the tile shape is exact (EVEN), which saves
    the mask registers and instructions at the 8B shapes."""
    if EVEN:
        return tl.load(ptr).to(tl.float32)
    return tl.load(ptr, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _load_raw(ptr, mask, EVEN: tl.constexpr):
    """A row tile in its storage dtype: issued early (prefetch) and widened where used."""
    if EVEN:
        return tl.load(ptr)
    return tl.load(ptr, mask=mask, other=0.0)


@triton.jit
def _store(ptr, val, mask, EVEN: tl.constexpr):
    if EVEN:
        tl.store(ptr, _cast_to(val, ptr))
    else:
        tl.store(ptr, _cast_to(val, ptr), mask=mask)


@triton.jit
def _cast_to(val, PTR):
    """fp32 -> the element type of PTR; bf16 rounds to nearest even, bit-exactly here and in
    Triton's interpreter (whose own fp32 -> bf16 cast truncates)."""
    if PTR.dtype.element_ty == tl.bfloat16:
        bits = val.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return val.to(PTR.dtype.element_ty)


@triton.jit
def _route_fwd_kernel(
    X,
    SRCS,
    NULL,
    Q,
    G,
    GATE,
    OUT,
    W,
    M,
    eps,
    D: tl.constexpr,
    H: tl.constexpr,
    K: tl.constexpr,
    NUM_SRC: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ROWS: tl.constexpr,
    EVEN: tl.constexpr,
):
    cols, mask = _row_tile_offsets(BLOCK_H, BLOCK_K, H, K)
    nn = tl.arange(0, BLOCK_N)[:, None]
    hw = tl.arange(0, BLOCK_H)[None, :]
    w_mask = (nn < NUM_SRC + 1) & (hw < H)

    qg = tl.load(Q + cols, mask=mask, other=0.0).to(tl.float32) * tl.load(G + cols, mask=mask, other=0.0).to(tl.float32)
    z = tl.load(NULL + cols, mask=mask, other=0.0).to(tl.float32)
    z_rstd = tl.rsqrt(tl.sum(z * z) / D + eps)
    z_logit = tl.sum(z * qg, axis=1) * z_rstd  # [BLOCK_H], the same for every row
    gate = tl.load(GATE).to(tl.float32)

    start = tl.program_id(0).to(tl.int64) * ROWS
    for r in range(ROWS):
        row = start + r
        row_mask = mask & (row < M)
        base = row * D
        # online softmax over [null, sources...], per head
        m = z_logit
        den = tl.full([BLOCK_H], 1.0, tl.float32)
        acc = z
        logits = tl.where(nn == 0, z_logit[None, :], 0.0)
        # Each source's load is issued one iteration ahead, so it overlaps the
        # reductions of the previous one.
        s_next = _load_raw(SRCS[0] + base + cols, row_mask, EVEN)
        for i in tl.static_range(NUM_SRC):
            s = s_next.to(tl.float32)
            if i + 1 < NUM_SRC:
                s_next = _load_raw(SRCS[i + 1] + base + cols, row_mask, EVEN)
            else:
                s_next = _load_raw(X + base + cols, row_mask, EVEN)
            rstd = tl.rsqrt(tl.sum(s * s) / D + eps)
            lg = tl.sum(s * qg, axis=1) * rstd
            m_new = tl.maximum(m, lg)
            alpha = tl.exp(m - m_new)
            p = tl.exp(lg - m_new)
            den = den * alpha + p
            acc = acc * alpha[:, None] + s * p[:, None]
            m = m_new
            logits = tl.where(nn == i + 1, lg[None, :], logits)
        x = s_next.to(tl.float32)
        out = x + gate * (acc / den[:, None])
        _store(OUT + base + cols, out, row_mask, EVEN)
        w = tl.exp(logits - m[None, :]) / den[None, :]
        tl.store(W + nn * (M * H) + row * H + hw, w, mask=w_mask & (row < M))


@triton.jit
def _route_bwd_kernel(
    DOUT,
    SRCS,
    DSRCS,
    NULL,
    Q,
    G,
    GATE,
    W,
    T_PART,
    W0DO_PART,
    DL0_PART,
    DGATE_PART,
    M,
    eps,
    D: tl.constexpr,
    H: tl.constexpr,
    K: tl.constexpr,
    NUM_SRC: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ROWS: tl.constexpr,
    EVEN: tl.constexpr,
):
    # Per row, with c_n = <dout_h, s_n,h>, a_n = <(q g)_h, s_n,h>, dot = sum_n w_n c_n:
    #   dl_n = gate * w_n * (c_n - dot)                       (softmax backward)
    #   ds_n = gate w_n dout + rstd_n (q g) dl_n - s_n rstd_n^3 sum_h(dl_n a_n) / D
    #   query/norm weight: sum over rows and sources of dl_n rstd_n s_n, times g or q
    #   null: gate w_0 dout summed over rows, plus its norm term from sum over rows of dl_0
    #   gate: sum over rows of dot
    cols, mask = _row_tile_offsets(BLOCK_H, BLOCK_K, H, K)
    nn = tl.arange(0, BLOCK_N)[:, None]
    hw = tl.arange(0, BLOCK_H)[None, :]
    w_mask = (nn < NUM_SRC + 1) & (hw < H)

    qg = tl.load(Q + cols, mask=mask, other=0.0).to(tl.float32) * tl.load(G + cols, mask=mask, other=0.0).to(tl.float32)
    gate = tl.load(GATE).to(tl.float32)
    z = tl.load(NULL + cols, mask=mask, other=0.0).to(tl.float32)

    t_acc = tl.zeros([BLOCK_H, BLOCK_K], tl.float32)
    w0do_acc = tl.zeros([BLOCK_H, BLOCK_K], tl.float32)
    dl0_acc = tl.zeros([BLOCK_H], tl.float32)
    dgate_acc = tl.zeros([BLOCK_H], tl.float32)

    pid = tl.program_id(0)
    start = pid.to(tl.int64) * ROWS
    for r in range(ROWS):
        row = start + r
        row_mask = mask & (row < M)
        base = row * D
        do = _load(DOUT + base + cols, row_mask, EVEN)
        w = tl.load(W + nn * (M * H) + row * H + hw, mask=w_mask & (row < M), other=0.0)
        # pass 1: per-head dot products with dout and with (q g), and each source's rstd
        c = tl.where(nn == 0, tl.sum(do * z, axis=1)[None, :], 0.0)
        a = tl.zeros([BLOCK_N, BLOCK_H], tl.float32)
        rstds = tl.zeros([BLOCK_N, 1], tl.float32)
        s_next = _load_raw(SRCS[0] + base + cols, row_mask, EVEN)
        for i in tl.static_range(NUM_SRC):
            s = s_next.to(tl.float32)
            # prefetch the next source, or source 0 again for pass 2
            s_next = _load_raw(SRCS[(i + 1) % NUM_SRC] + base + cols, row_mask, EVEN)
            rstd = tl.rsqrt(tl.sum(s * s) / D + eps)
            c = tl.where(nn == i + 1, tl.sum(do * s, axis=1)[None, :], c)
            a = tl.where(nn == i + 1, tl.sum(s * qg, axis=1)[None, :], a)
            rstds = tl.where(nn == i + 1, rstd, rstds)
        dot = tl.sum(w * c, axis=0)  # [BLOCK_H]
        dl = gate * w * (c - dot[None, :])  # [BLOCK_N, BLOCK_H]
        dgate_acc += dot
        w0 = tl.sum(tl.where(nn == 0, w, 0.0), axis=0)
        w0do_acc += w0[:, None] * do
        dl0_acc += tl.sum(tl.where(nn == 0, dl, 0.0), axis=0)
        # pass 2: each source's gradient
        for i in tl.static_range(NUM_SRC):
            s = s_next.to(tl.float32)
            if i + 1 < NUM_SRC:
                s_next = _load_raw(SRCS[i + 1] + base + cols, row_mask, EVEN)
            sel = nn == i + 1
            w_i = tl.sum(tl.where(sel, w, 0.0), axis=0)
            dl_i = tl.sum(tl.where(sel, dl, 0.0), axis=0)
            a_i = tl.sum(tl.where(sel, a, 0.0), axis=0)
            rstd = tl.sum(tl.where(sel, rstds, 0.0))
            coupling = tl.sum(dl_i * a_i) * rstd * rstd * rstd / D
            ds = gate * w_i[:, None] * do + rstd * qg * dl_i[:, None] - s * coupling
            _store(DSRCS[i] + base + cols, ds, row_mask, EVEN)
            t_acc += (dl_i * rstd)[:, None] * s

    part = pid.to(tl.int64) * D
    tl.store(T_PART + part + cols, t_acc, mask=mask)
    tl.store(W0DO_PART + part + cols, w0do_acc, mask=mask)
    hv = tl.arange(0, BLOCK_H)
    tl.store(DL0_PART + pid.to(tl.int64) * H + hv, dl0_acc, mask=hv < H)
    tl.store(DGATE_PART + pid, tl.sum(dgate_acc))


@triton.jit
def _route_bwd_finish_kernel(
    T_PART,
    W0DO_PART,
    DL0_PART,
    DGATE_PART,
    NULL,
    Q,
    G,
    GATE,
    DZ,
    DQ,
    DG,
    DGATE,
    eps,
    P: tl.constexpr,
    D: tl.constexpr,
    H: tl.constexpr,
    K: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Sums the backward's per-program partials in a fixed order and finishes the
    weight gradients; the null source's norm term depends on the rows only through
    sum_rows dl_0. Each program owns BLOCK_C columns."""
    pid = tl.program_id(0)
    hv = tl.arange(0, BLOCK_H)
    pv = tl.arange(0, BLOCK_P)
    dl0 = tl.zeros([BLOCK_H], tl.float32)
    dgate = tl.zeros([BLOCK_P], tl.float32)
    for p0 in tl.static_range(0, P, BLOCK_P):
        pp = p0 + pv
        part = tl.load(DL0_PART + pp[:, None] * H + hv[None, :], mask=(pp < P)[:, None] & (hv < H)[None, :], other=0.0)
        dl0 += tl.sum(part, axis=0)
        dgate += tl.load(DGATE_PART + pp, mask=pp < P, other=0.0)

    cols, mask = _row_tile_offsets(BLOCK_H, BLOCK_K, H, K)
    z2 = tl.load(NULL + cols, mask=mask, other=0.0).to(tl.float32)
    qg2 = tl.load(Q + cols, mask=mask, other=0.0).to(tl.float32) * tl.load(G + cols, mask=mask, other=0.0).to(
        tl.float32
    )
    z_rstd = tl.rsqrt(tl.sum(z2 * z2) / D + eps)
    coupling = tl.sum(dl0 * tl.sum(qg2 * z2, axis=1)) * z_rstd * z_rstd * z_rstd / D

    cc = pid * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cc < D
    t = tl.zeros([BLOCK_C], tl.float32)
    w0do = tl.zeros([BLOCK_C], tl.float32)
    for p0 in tl.static_range(0, P, BLOCK_P):
        pp = p0 + pv
        pmask = (pp < P)[:, None] & cmask[None, :]
        offs = pp[:, None] * D + cc[None, :]
        t += tl.sum(tl.load(T_PART + offs, mask=pmask, other=0.0), axis=0)
        w0do += tl.sum(tl.load(W0DO_PART + offs, mask=pmask, other=0.0), axis=0)
    dl0_c = tl.sum(tl.where((cc // K)[None, :] == hv[:, None], dl0[:, None], 0.0), axis=0)
    z = tl.load(NULL + cc, mask=cmask, other=0.0).to(tl.float32)
    q = tl.load(Q + cc, mask=cmask, other=0.0).to(tl.float32)
    g = tl.load(G + cc, mask=cmask, other=0.0).to(tl.float32)
    gate = tl.load(GATE).to(tl.float32)
    tl.store(DQ + cc, _cast_to(t * g + dl0_c * z_rstd * z * g, DQ), mask=cmask)
    tl.store(DG + cc, _cast_to(t * q + dl0_c * z_rstd * z * q, DG), mask=cmask)
    tl.store(DZ + cc, _cast_to(gate * w0do + z_rstd * q * g * dl0_c - z * coupling, DZ), mask=cmask)
    tl.store(DGATE, _cast_to(tl.sum(dgate), DGATE), mask=pid == 0)


def _launch_shape(d: int, num_heads: int, num_sources: int) -> dict[str, int]:
    k = d // num_heads
    return {
        "D": d,
        "H": num_heads,
        "K": k,
        "NUM_SRC": num_sources,
        "BLOCK_H": triton.next_power_of_2(num_heads),
        "BLOCK_K": triton.next_power_of_2(k),
        "BLOCK_N": triton.next_power_of_2(num_sources + 1),
    }


# Launch shapes (measured on an H200, see docs/performance.md): programs per SM (each
# walks a power-of-two number of rows) and warps per 4096 columns.
FWD = {"programs_per_sm": 32, "warps_per_4096": 4}
BWD = {"programs_per_sm": 4, "warps_per_4096": 8}


def _even(m: int, rows: int, d: int, num_heads: int) -> bool:
    """Tiles need no masks: power-of-two heads and head width, whole row blocks."""
    k = d // num_heads
    return m % rows == 0 and triton.next_power_of_2(num_heads) == num_heads and triton.next_power_of_2(k) == k


def _num_warps(d: int, warps_per_4096: int) -> int:
    return max(1, min(16, triton.next_power_of_2(triton.cdiv(d * warps_per_4096, 4096))))


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _rows_per_program(m: int, device: torch.device, per_sm: int) -> int:
    """Rows each program walks: about per_sm programs per SM, rounded to a power of two
    (a compile-time constant, so few kernel variants)."""
    programs = per_sm * _sm_count(device.index or 0) if device.type == "cuda" else 4
    return triton.next_power_of_2(triton.cdiv(m, programs))


def _empty(*shape_and_args, **kwargs) -> torch.Tensor:
    return torch.empty(*shape_and_args, **kwargs)


def _empty_like(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(t)


def _check_inputs(x: torch.Tensor, sources: Sequence[torch.Tensor]) -> None:
    if not x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("backend='triton' needs CUDA tensors (or TRITON_INTERPRET=1 on CPU)")
    if not 1 <= len(sources) <= MAX_SOURCES:
        raise ValueError(f"backend='triton' routes over 1..{MAX_SOURCES} sources, got {len(sources)}")


def _forward(
    x: torch.Tensor,
    sources: list[torch.Tensor],
    null: torch.Tensor,
    query: torch.Tensor,
    norm_weight: torch.Tensor,
    gate: torch.Tensor,
    num_heads: int,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    _check_inputs(x, sources)
    d = x.shape[-1]
    m = x.numel() // d
    xs = x.contiguous()
    srcs = tuple(s.contiguous() for s in sources)
    out = _empty_like(xs)
    weights = _empty((len(srcs) + 1, *x.shape[:-1], num_heads), device=x.device, dtype=torch.float32)
    rows = _rows_per_program(m, x.device, per_sm=FWD["programs_per_sm"])
    _route_fwd_kernel[(triton.cdiv(m, rows),)](
        xs,
        srcs,
        null.contiguous(),
        query.contiguous(),
        norm_weight.contiguous(),
        gate.contiguous(),
        out,
        weights,
        m,
        eps,
        num_warps=_num_warps(d, FWD["warps_per_4096"]),
        ROWS=rows,
        EVEN=_even(m, rows, d, num_heads),
        **_launch_shape(d, num_heads, len(srcs)),
    )
    return out, weights


@torch.library.custom_op("mhar::route_fwd", mutates_args=())
def route_fwd(
    x: torch.Tensor,
    sources: list[torch.Tensor],
    null: torch.Tensor,
    query: torch.Tensor,
    norm_weight: torch.Tensor,
    gate: torch.Tensor,
    num_heads: int,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _forward(x, sources, null, query, norm_weight, gate, num_heads, eps)


@route_fwd.register_fake
def _(x, sources, null, query, norm_weight, gate, num_heads, eps):
    weights = x.new_empty((len(sources) + 1, *x.shape[:-1], num_heads), dtype=torch.float32)
    return torch.empty_like(x), weights


def _backward(
    grad_out: torch.Tensor,
    sources: list[torch.Tensor],
    null: torch.Tensor,
    query: torch.Tensor,
    norm_weight: torch.Tensor,
    gate: torch.Tensor,
    weights: torch.Tensor,
    num_heads: int,
    eps: float,
) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    _check_inputs(grad_out, sources)
    d = grad_out.shape[-1]
    m = grad_out.numel() // d
    dout = grad_out.contiguous()
    srcs = tuple(s.contiguous() for s in sources)
    dsrcs = tuple(_empty_like(s) for s in srcs)
    rows = _rows_per_program(m, grad_out.device, per_sm=BWD["programs_per_sm"])
    programs = triton.cdiv(m, rows)
    f32 = {"device": grad_out.device, "dtype": torch.float32}
    t_part = _empty((programs, d), **f32)
    w0do_part = _empty((programs, d), **f32)
    dl0_part = _empty((programs, num_heads), **f32)
    dgate_part = _empty((programs,), **f32)
    z, q, g, gate = (t.contiguous() for t in (null, query, norm_weight, gate))
    _route_bwd_kernel[(programs,)](
        dout,
        srcs,
        dsrcs,
        z,
        q,
        g,
        gate,
        weights,
        t_part,
        w0do_part,
        dl0_part,
        dgate_part,
        m,
        eps,
        num_warps=_num_warps(d, BWD["warps_per_4096"]),
        ROWS=rows,
        EVEN=_even(m, rows, d, num_heads),
        **_launch_shape(d, num_heads, len(srcs)),
    )
    dz, dq, dg, dgate = (_empty_like(t) for t in (z, q, g, gate))
    block_c = 32  # many programs: the partials are read once, at bandwidth
    _route_bwd_finish_kernel[(triton.cdiv(d, block_c),)](
        t_part,
        w0do_part,
        dl0_part,
        dgate_part,
        z,
        q,
        g,
        gate,
        dz,
        dq,
        dg,
        dgate,
        eps,
        P=programs,
        D=d,
        H=num_heads,
        K=d // num_heads,
        BLOCK_H=triton.next_power_of_2(num_heads),
        BLOCK_K=triton.next_power_of_2(d // num_heads),
        BLOCK_P=32,
        BLOCK_C=block_c,
        num_warps=4,
    )
    return list(dsrcs), dz, dq, dg, dgate


@torch.library.custom_op("mhar::route_bwd", mutates_args=())
def route_bwd(
    grad_out: torch.Tensor,
    sources: list[torch.Tensor],
    null: torch.Tensor,
    query: torch.Tensor,
    norm_weight: torch.Tensor,
    gate: torch.Tensor,
    weights: torch.Tensor,
    num_heads: int,
    eps: float,
) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _backward(grad_out, sources, null, query, norm_weight, gate, weights, num_heads, eps)


@route_bwd.register_fake
def _(grad_out, sources, null, query, norm_weight, gate, weights, num_heads, eps):
    return (
        [torch.empty_like(s) for s in sources],
        torch.empty_like(null),
        torch.empty_like(query),
        torch.empty_like(norm_weight),
        torch.empty_like(gate),
    )


def _setup_context(ctx, inputs, output) -> None:
    x, sources, null, query, norm_weight, gate, num_heads, eps = inputs
    _, weights = output
    ctx.num_sources = len(sources)
    ctx.num_heads, ctx.eps = num_heads, eps
    ctx.save_for_backward(null, query, norm_weight, gate, weights, *sources)


def _op_backward(ctx, grad_out, grad_weights):
    null, query, norm_weight, gate, weights, *sources = ctx.saved_tensors
    dsrcs, dz, dq, dg, dgate = route_bwd(
        grad_out, sources, null, query, norm_weight, gate, weights, ctx.num_heads, ctx.eps
    )
    return grad_out, dsrcs, dz, dq, dg, dgate, None, None


route_fwd.register_autograd(_op_backward, setup_context=_setup_context)


class _Route(torch.autograd.Function):
    """The same kernels for eager mode, without the custom-op dispatch, whose Python
    cost per call (about half a millisecond, measured) exceeds the kernels' own."""

    @staticmethod
    def forward(ctx, x, null, query, norm_weight, gate, num_heads, eps, *sources):
        out, weights = _forward(x, list(sources), null, query, norm_weight, gate, num_heads, eps)
        ctx.num_heads, ctx.eps = num_heads, eps
        ctx.save_for_backward(null, query, norm_weight, gate, weights, *sources)
        ctx.mark_non_differentiable(weights)
        return out, weights

    @staticmethod
    def backward(ctx, grad_out, grad_weights):
        null, query, norm_weight, gate, weights, *sources = ctx.saved_tensors
        dsrcs, dz, dq, dg, dgate = _backward(
            grad_out, sources, null, query, norm_weight, gate, weights, ctx.num_heads, ctx.eps
        )
        return grad_out, dz, dq, dg, dgate, None, None, *dsrcs


def route_triton(
    x: torch.Tensor,
    sources: Sequence[torch.Tensor],
    null: torch.Tensor,
    query: torch.Tensor,
    norm_weight: torch.Tensor,
    gate: torch.Tensor,
    *,
    num_heads: int,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused routing: (x + gate * R, routing weights [N, *x.shape[:-1], H] fp32).

    Under torch.compile the custom op keeps the call in the graph; in eager mode
    an autograd.Function runs the same kernels with less Python per call.
    """
    if torch.compiler.is_compiling():
        return torch.ops.mhar.route_fwd(x, list(sources), null, query, norm_weight, gate, num_heads, eps)
    return _Route.apply(x, null, query, norm_weight, gate, num_heads, eps, *sources)
