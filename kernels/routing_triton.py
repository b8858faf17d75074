"""Fused Triton kernels for `mhar_route` (the `triton` backend).

Forward: one pass over the sources per token row, all heads at once; online
softmax, the full-width RMS norm fused, fp32 statistics, the null source read
as one vector. Returns the routing weights [N, M, H] (fp32) beside the output.

Backward, none with atomics (repeated runs are bitwise equal):
- stats: one pass over the sources per row that recomputes the softmax from the
  inputs and writes, per source, row and head, the coefficients the sources'
  gradients are linear in; each program also sums the weight gradients over its
  rows (the query/norm-weight term through two online-rescaled running tiles), so
  a call's parameter gradients need nothing else;
- finish: sums those per-program partials in a fixed order;
- mix: a streaming kernel over (row block, column block) tiles, with no row-wide
  reduction, that turns the coefficients into every source's gradient.
The backward needs only the op's inputs. The eager path keeps them on its autograd
context, not through save_for_backward, so an activation checkpoint around a call has
nothing to unpack and never re-runs the forward. A source marked with
`share_source_grad` (kernels.routing.routing_source) has its gradient summed in place
across the eager calls that read it: the mix kernel does not read such a source (its
norm term, a per-row multiple of the source, is summed per row and applied once, when
the sum is complete), and one mix pass serves up to MIX["calls"] consecutive calls over
the same sources (the sites of a layer), one read and write of each sum for all of them;
the source's 1 / rms per row is computed once, for the stats kernels of all those calls.

Registered as `torch.ops.mhar.route_fwd` / `route_bwd` custom ops with autograd,
so torch.compile keeps them in its graph instead of breaking at every call; eager
calls go through a plain autograd.Function over the same launchers.

The row kernels (forward, stats) hold a row as a [heads, chunks, chunk] tile, so that
Triton gives each warp whole heads: the per-head sums are warp shuffles, and the only
cross-warp sum per source is the full-width norm (at 8 sources the PTX has 19 barriers in
the forward, against 66 with [heads, columns] tiles, which spread a 512-wide head over two
warps; stats has 35, as it needs each source's norm before the next for its running tiles,
and 19 where the sources are marked, their norms computed once beforehand and read).
Registers bound them too (each row's tiles live in them): the forward keeps no parameter
tile resident (query, norm weight and null are re-read from L1). `python -m
kernels.compile_report` prints registers and spills per kernel for sm_90 without a GPU.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels.routing import MAX_TRITON_SOURCES as MAX_SOURCES


@triton.jit
def _row_tile_offsets(
    BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_I: tl.constexpr, H: tl.constexpr, K: tl.constexpr
):
    """One row as a [heads, chunks, chunk] tile: head h's columns in BLOCK_S chunks of BLOCK_I,
    a chunk being what one warp loads in one go. Triton then lays the heads across warps and
    a head's chunks within one warp, so every per-head sum is a warp shuffle, with no barrier
    (a [heads, columns] tile spreads a 512-wide head over two warps)."""
    hh = tl.arange(0, BLOCK_H)[:, None, None]
    kk = tl.arange(0, BLOCK_S)[None, :, None] * BLOCK_I + tl.arange(0, BLOCK_I)[None, None, :]
    return hh * K + kk, (hh < H) & (kk < K)


@triton.jit
def _load_raw(ptr, mask, EVEN: tl.constexpr):
    """A tile in its storage dtype, unmasked when its shape is exact (EVEN): issued
    early (prefetch) and widened where used."""
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
def _add2(a0, b0, a1, b1):
    return a0 + a1, b0 + b1


@triton.jit
def _add3(a0, b0, c0, a1, b1, c1):
    return a0 + a1, b0 + b1, c0 + c1


@triton.jit
def _head_sum(a):
    return tl.sum(tl.sum(a, axis=2), axis=1)


@triton.jit
def _head_sums2(a, b, JOINT: tl.constexpr):
    """Per-head sums of two row tiles: one joint reduction on a GPU; two plain sums in
    Triton's interpreter, which runs a custom combine function element by element."""
    if JOINT:
        return tl.reduce(tl.reduce((a, b), 2, _add2), 1, _add2)
    return _head_sum(a), _head_sum(b)


@triton.jit
def _head_sums3(a, b, c, JOINT: tl.constexpr):
    if JOINT:
        return tl.reduce(tl.reduce((a, b, c), 2, _add3), 1, _add3)
    return _head_sum(a), _head_sum(b), _head_sum(c)


@triton.jit
def _param(PTR, cols, mask):
    return tl.load(PTR + cols, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _row_rstd(RSTD, row, M, EVEN: tl.constexpr):
    """A source's 1 / rms for one row, computed beforehand (_source_rstd_kernel)."""
    if EVEN:
        return tl.load(RSTD + row)
    return tl.load(RSTD + row, mask=row < M, other=1.0)


@triton.jit
def _source_rstd_kernel(SRC, RSTD, M, eps, D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """1 / rms of BLOCK_R rows of a source (fp32 sum of squares over the full width): computed
    once for a source that many calls read, instead of by every call, in its row kernels, where
    it is the one sum that crosses warps."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    acc = tl.zeros([BLOCK_R, BLOCK_C], tl.float32)
    for c0 in tl.static_range(0, D, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        mask = (rows < M)[:, None] & (cols < D)[None, :]
        x = tl.load(SRC + rows[:, None] * D + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        acc += x * x
    tl.store(RSTD + rows, tl.rsqrt(tl.sum(acc, axis=1) / D + eps), mask=rows < M)


@triton.jit
def _null_logit(NULL, Q, G, cols, mask, D: tl.constexpr, eps, JOINT: tl.constexpr):
    """The null source's logit per head, the same for every row."""
    z = _param(NULL, cols, mask)
    zz, zq = _head_sums2(z * z, z * _param(Q, cols, mask) * _param(G, cols, mask), JOINT)
    return zq * tl.rsqrt(tl.sum(zz) / D + eps)


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
    BLOCK_S: tl.constexpr,
    BLOCK_I: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ROWS: tl.constexpr,
    EVEN: tl.constexpr,
    JOINT: tl.constexpr,
):
    cols, mask = _row_tile_offsets(BLOCK_H, BLOCK_S, BLOCK_I, H, K)
    # per-source statistics as [heads, sources] tiles, laid out as the heads' sums come
    nn = tl.arange(0, BLOCK_N)[None, :]
    hw = tl.arange(0, BLOCK_H)[:, None]
    w_mask = (nn < NUM_SRC + 1) & (hw < H)
    z_logit = _null_logit(NULL, Q, G, cols, mask, D, eps, JOINT)
    gate = tl.load(GATE).to(tl.float32)

    start = tl.program_id(0).to(tl.int64) * ROWS
    for r in range(ROWS):
        row = start + r
        row_mask = mask & (row < M)
        base = row * D
        # Online softmax over [null, sources...] per head. The null source enters the
        # running max and denominator from the start but the accumulator only at the
        # end, so its tile is not held in registers across the loop.
        m = z_logit
        den = tl.full([BLOCK_H], 1.0, tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_S, BLOCK_I], tl.float32)
        logits = tl.where(nn == 0, z_logit[:, None], 0.0)
        # Loads run two sources ahead (then x), so they overlap the reductions of the
        # previous two: s_a is the tile in use next, s_b the one after it.
        s_a = _load_raw(SRCS[0] + base + cols, row_mask, EVEN)
        if NUM_SRC > 1:
            s_b = _load_raw(SRCS[1] + base + cols, row_mask, EVEN)
        else:
            s_b = _load_raw(X + base + cols, row_mask, EVEN)
        for i in tl.static_range(NUM_SRC):
            s = s_a.to(tl.float32)
            s_a = s_b
            if i + 2 < NUM_SRC:
                s_b = _load_raw(SRCS[i + 2] + base + cols, row_mask, EVEN)
            elif i + 2 == NUM_SRC:
                s_b = _load_raw(X + base + cols, row_mask, EVEN)
            qg = _param(Q, cols, mask) * _param(G, cols, mask)
            ss, sq = _head_sums2(s * s, s * qg, JOINT)
            lg = sq * tl.rsqrt(tl.sum(ss) / D + eps)
            m_new = tl.maximum(m, lg)
            alpha = tl.exp(m - m_new)
            p = tl.exp(lg - m_new)
            den = den * alpha + p
            acc = acc * alpha[:, None, None] + s * p[:, None, None]
            m = m_new
            logits = tl.where(nn == i + 1, lg[:, None], logits)
        acc += tl.exp(z_logit - m)[:, None, None] * _param(NULL, cols, mask)
        out = s_a.to(tl.float32) + gate * (acc / den[:, None, None])  # s_a holds x by now
        _store(OUT + base + cols, out, row_mask, EVEN)
        w = tl.exp(logits - m[:, None]) / den[:, None]
        tl.store(W + nn * (M * H) + row * H + hw, w, mask=w_mask & (row < M))


@triton.jit
def _route_bwd_stats_kernel(
    DOUT,
    SRCS,
    RSTDS,
    NULL,
    Q,
    G,
    GATE,
    COEF,
    PARTS,
    M,
    eps,
    D: tl.constexpr,
    H: tl.constexpr,
    K: tl.constexpr,
    NUM_SRC: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_I: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ROWS: tl.constexpr,
    EVEN: tl.constexpr,
    JOINT: tl.constexpr,
    KNOWN: tl.constexpr,
):
    # Per row and head, with c_n = <dout_h, s_n,h>, a_n = <(q g)_h, s_n,h>, w = softmax_n(a_n rstd_n)
    # (null: its own logit), dot = sum_n w_n c_n, dl_n = gate w_n (c_n - dot):
    #   ds_n = A_n dout + B_n (q g) - C_n s_n   with   A_n = gate w_n,  B_n = rstd_n dl_n,
    #   C_n = rstd_n^3 sum_h(dl_n a_n) / D.
    # COEF[k, n - 1, row, h] holds A, B and C's terms per head (the mix kernel sums them) for the
    # sources n >= 1. The weight gradients are sums over rows: of sum_n B_n s_n (query, norm
    # weight), of A_0 dout (null), of dl_0 (the null's norm term) and of dot (gate); this
    # program sums them over its ROWS rows into PARTS (_partials). sum_n B_n s_n needs dot,
    # known only after the last source, so it is built as gate (U - dot V) / den from two
    # running tiles, U = sum_n rstd_n e_n c_n s_n and V = sum_n rstd_n e_n s_n, rescaled with
    # the online softmax's max as the forward's accumulator is: every source is read once.
    # Per-source statistics are tuples of per-head vectors, which cost a register each.
    cols, mask = _row_tile_offsets(BLOCK_H, BLOCK_S, BLOCK_I, H, K)
    hv = tl.arange(0, BLOCK_H)
    nn = tl.arange(0, BLOCK_N)[None, :]
    hw = hv[:, None]
    z_logit = _null_logit(NULL, Q, G, cols, mask, D, eps, JOINT)
    gate = tl.load(GATE).to(tl.float32)
    plane = NUM_SRC * M * H

    t = tl.zeros([BLOCK_H, BLOCK_S, BLOCK_I], tl.float32)
    w0do = tl.zeros([BLOCK_H, BLOCK_S, BLOCK_I], tl.float32)
    dl0 = tl.zeros([BLOCK_H], tl.float32)
    dgate = tl.zeros([BLOCK_H], tl.float32)
    pid = tl.program_id(0)
    start = pid.to(tl.int64) * ROWS
    for r in range(ROWS):
        row = start + r
        row_mask = mask & (row < M)
        base = row * D
        do = _load_raw(DOUT + base + cols, row_mask, EVEN).to(tl.float32)
        # loads run two sources ahead of the reductions, as in the forward
        s_a = _load_raw(SRCS[0] + base + cols, row_mask, EVEN)
        if NUM_SRC > 1:
            s_b = _load_raw(SRCS[1] + base + cols, row_mask, EVEN)
        m = z_logit
        den = tl.full([BLOCK_H], 1.0, tl.float32)
        u = tl.zeros([BLOCK_H, BLOCK_S, BLOCK_I], tl.float32)
        v = tl.zeros([BLOCK_H, BLOCK_S, BLOCK_I], tl.float32)
        c0 = _head_sum(do * _param(NULL, cols, mask))
        cs, lgs, rstds = (), (), ()
        for i in tl.static_range(NUM_SRC):
            s = s_a.to(tl.float32)
            if i + 1 < NUM_SRC:
                s_a = s_b
            if i + 2 < NUM_SRC:
                s_b = _load_raw(SRCS[i + 2] + base + cols, row_mask, EVEN)
            qg = _param(Q, cols, mask) * _param(G, cols, mask)
            if (KNOWN >> i) & 1:
                sd, sq = _head_sums2(s * do, s * qg, JOINT)
                rstd = _row_rstd(RSTDS[i], row, M, EVEN)
            else:
                ss, sd, sq = _head_sums3(s * s, s * do, s * qg, JOINT)
                rstd = tl.rsqrt(tl.sum(ss) / D + eps)
            lg = sq * rstd
            m_new = tl.maximum(m, lg)
            alpha = tl.exp(m - m_new)
            e = tl.exp(lg - m_new)
            den = den * alpha + e
            er = e * rstd
            u = u * alpha[:, None, None] + s * (er * sd)[:, None, None]
            v = v * alpha[:, None, None] + s * er[:, None, None]
            m = m_new
            cs, lgs, rstds = cs + (sd,), lgs + (lg,), rstds + (rstd,)
        inv = 1.0 / den
        w0 = tl.exp(z_logit - m) * inv
        dot = w0 * c0
        for i in tl.static_range(NUM_SRC):
            dot += tl.exp(lgs[i] - m) * inv * cs[i]
        t += (gate * inv)[:, None, None] * (u - dot[:, None, None] * v)
        w0do += (gate * w0)[:, None, None] * do
        dl0 += gate * w0 * (c0 - dot)
        dgate += dot
        # gathered into [heads, sources] tiles, one store each: a store goes through shared
        # memory (Triton coalesces it), so one per coefficient, not one per source
        a_t = tl.zeros([BLOCK_H, BLOCK_N], tl.float32)
        b_t = tl.zeros([BLOCK_H, BLOCK_N], tl.float32)
        c_t = tl.zeros([BLOCK_H, BLOCK_N], tl.float32)
        for i in tl.static_range(NUM_SRC):
            w = tl.exp(lgs[i] - m) * inv
            dl = gate * w * (cs[i] - dot)
            sel = nn == i
            a_t = tl.where(sel, (gate * w)[:, None], a_t)
            b_t = tl.where(sel, (dl * rstds[i])[:, None], b_t)
            c_t = tl.where(sel, (dl * lgs[i] * (rstds[i] * rstds[i] / D))[:, None], c_t)
        offs = nn * (M * H) + row * H + hw
        valid = (nn < NUM_SRC) & (hw < H) & (row < M)
        tl.store(COEF + offs, a_t, mask=valid)
        tl.store(COEF + plane + offs, b_t, mask=valid)
        tl.store(COEF + 2 * plane + offs, c_t, mask=valid)
    T_PART, W0DO_PART, DL0_PART, DGATE_PART = _partials(PARTS, tl.num_programs(0), D, H)
    part = pid.to(tl.int64) * D + cols
    _store(T_PART + part, t, mask, EVEN)
    _store(W0DO_PART + part, w0do, mask, EVEN)
    tl.store(DL0_PART + pid * H + hv, dl0, mask=hv < H)
    tl.store(DGATE_PART + pid, tl.sum(tl.where(hv < H, dgate, 0.0)))


@triton.jit
def _partials(PARTS, P, D: tl.constexpr, H: tl.constexpr):
    """The stats kernel's partial sums per program (P of them), one after another in one
    buffer: query/norm-weight sums [P, D], the null's mixing term [P, D], dl_0 [P, H], dot [P]."""
    return PARTS, PARTS + P * D, PARTS + 2 * P * D, PARTS + 2 * P * D + P * H


@triton.jit
def _mix_term(ds, do, qg, COEF, off, plane, row_ok):
    """ds + A dout + B (q g), one call's share of a source's gradient."""
    a = tl.load(COEF + off, mask=row_ok, other=0.0)[:, None]
    b = tl.load(COEF + plane + off, mask=row_ok, other=0.0)[:, None]
    return ds + a * do + b * qg


@triton.jit
def _coupling(COEF, off, rows, row_ok, H: tl.constexpr, BLOCK_H: tl.constexpr):
    """C per row: the stats kernel's per-head terms, summed."""
    hv = tl.arange(0, BLOCK_H)[None, :]
    terms = tl.load(COEF + off + rows[:, None] * H + hv, mask=row_ok[:, None] & (hv < H), other=0.0)
    return tl.sum(terms, axis=1)


@triton.jit
def _route_bwd_mix_kernel(
    DOUTS,
    COEFS,
    QS,
    GS,
    SRCS,
    DSRCS,
    CSUMS,
    M,
    D: tl.constexpr,
    H: tl.constexpr,
    K: tl.constexpr,
    NUM_SRC: tl.constexpr,
    NUM_CALLS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_KC: tl.constexpr,
    EVEN: tl.constexpr,
    ACCUM: tl.constexpr,
    SHARED: tl.constexpr,
):
    """One [BLOCK_M rows, BLOCK_KC columns] tile of one head: every source's gradient from the
    per-row coefficients of NUM_CALLS (1..4) calls that read the same sources, one pass over
    the gradients for all of them:  ds_n (+)= sum_calls (A_n dout + B_n (q g)) - C_n s_n.
    Bit i of ACCUM: add to what DSRCS[i] and CSUMS[i] hold instead of overwriting them.
    Bit i of SHARED: source i's gradient is a sum that many calls add to (routing_source), and
    its norm term -C s is applied once, when the sum is complete (_route_bwd_norm_kernel):
    here C is only summed per row into CSUMS[i], and the source itself is not read.
    Unshared sources (SHARED bit clear) take one call (NUM_CALLS = 1)."""
    rb = tl.program_id(0)
    cb = tl.program_id(1)
    chunks: tl.constexpr = (K + BLOCK_KC - 1) // BLOCK_KC
    h = cb // chunks
    kc = (cb % chunks) * BLOCK_KC + tl.arange(0, BLOCK_KC)
    rows = rb.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    col = h * K + kc
    row_ok = rows < M
    tile = rows[:, None] * D + col[None, :]
    mask = row_ok[:, None] & (kc < K)[None, :]
    plane = NUM_SRC * M * H
    off = rows * H + h

    # every call's dout tile stays in registers across the sources
    do0 = _load_raw(DOUTS[0] + tile, mask, EVEN).to(tl.float32)
    qg0 = (_param(QS[0], col, kc < K) * _param(GS[0], col, kc < K))[None, :]
    if NUM_CALLS > 1:
        do1 = _load_raw(DOUTS[1] + tile, mask, EVEN).to(tl.float32)
        qg1 = (_param(QS[1], col, kc < K) * _param(GS[1], col, kc < K))[None, :]
    if NUM_CALLS > 2:
        do2 = _load_raw(DOUTS[2] + tile, mask, EVEN).to(tl.float32)
        qg2 = (_param(QS[2], col, kc < K) * _param(GS[2], col, kc < K))[None, :]
    if NUM_CALLS > 3:
        do3 = _load_raw(DOUTS[3] + tile, mask, EVEN).to(tl.float32)
        qg3 = (_param(QS[3], col, kc < K) * _param(GS[3], col, kc < K))[None, :]
    # the next source's running sum (and, unshared, the source) load while this one is mixed
    if ACCUM & 1:
        prev_next = _load_raw(DSRCS[0] + tile, mask, EVEN)
    if not SHARED & 1:
        s_next = _load_raw(SRCS[0] + tile, mask, EVEN)
    for i in tl.static_range(NUM_SRC):
        if (ACCUM >> i) & 1:
            prev = prev_next
        if not (SHARED >> i) & 1:
            s = s_next
        if i + 1 < NUM_SRC:
            if (ACCUM >> (i + 1)) & 1:
                prev_next = _load_raw(DSRCS[i + 1] + tile, mask, EVEN)
            if not (SHARED >> (i + 1)) & 1:
                s_next = _load_raw(SRCS[i + 1] + tile, mask, EVEN)
        n_off = off + i * M * H
        if (ACCUM >> i) & 1:
            ds = prev.to(tl.float32)
        else:
            ds = tl.zeros([BLOCK_M, BLOCK_KC], tl.float32)
        ds = _mix_term(ds, do0, qg0, COEFS[0], n_off, plane, row_ok)
        if NUM_CALLS > 1:
            ds = _mix_term(ds, do1, qg1, COEFS[1], n_off, plane, row_ok)
        if NUM_CALLS > 2:
            ds = _mix_term(ds, do2, qg2, COEFS[2], n_off, plane, row_ok)
        if NUM_CALLS > 3:
            ds = _mix_term(ds, do3, qg3, COEFS[3], n_off, plane, row_ok)
        if (SHARED >> i) & 1:
            if cb == 0:
                # C is the same for every head: this row block's column-block-0 program sums it
                c_off = 2 * plane + i * M * H
                cs = _coupling(COEFS[0], c_off, rows, row_ok, H, BLOCK_H)
                if NUM_CALLS > 1:
                    cs += _coupling(COEFS[1], c_off, rows, row_ok, H, BLOCK_H)
                if NUM_CALLS > 2:
                    cs += _coupling(COEFS[2], c_off, rows, row_ok, H, BLOCK_H)
                if NUM_CALLS > 3:
                    cs += _coupling(COEFS[3], c_off, rows, row_ok, H, BLOCK_H)
                if (ACCUM >> i) & 1:
                    cs += tl.load(CSUMS[i] + rows, mask=row_ok, other=0.0)
                tl.store(CSUMS[i] + rows, cs, mask=row_ok)
        else:
            c = _coupling(COEFS[0], 2 * plane + i * M * H, rows, row_ok, H, BLOCK_H)
            ds -= c[:, None] * s.to(tl.float32)
        _store(DSRCS[i] + tile, ds, mask, EVEN)


@triton.jit
def _route_bwd_norm_kernel(
    SRC, DSRC, CSUM, M, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, EVEN: tl.constexpr
):
    """A shared source's norm term, once its gradient sum is complete: ds -= csum[row] * s."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    tile = rows[:, None] * D + cols[None, :]
    mask = (rows < M)[:, None] & (cols < D)[None, :]
    c = tl.load(CSUM + rows, mask=rows < M, other=0.0)[:, None]
    s = _load_raw(SRC + tile, mask, EVEN).to(tl.float32)
    ds = _load_raw(DSRC + tile, mask, EVEN).to(tl.float32) - c * s
    _store(DSRC + tile, ds, mask, EVEN)


@triton.jit
def _route_bwd_finish_kernel(
    PARTS,
    NULL,
    Q,
    G,
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
    BLOCK_S: tl.constexpr,
    BLOCK_I: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Sums the stats kernel's per-program partials in a fixed order and finishes the
    weight gradients; the null source's norm term depends on the rows only through
    sum_rows dl_0. Each program owns BLOCK_C columns."""
    T_PART, W0DO_PART, DL0_PART, DGATE_PART = _partials(PARTS, P, D, H)
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

    cols, mask = _row_tile_offsets(BLOCK_H, BLOCK_S, BLOCK_I, H, K)
    z2 = _param(NULL, cols, mask)
    z_rstd = tl.rsqrt(tl.sum(z2 * z2) / D + eps)
    a0 = _head_sum(_param(Q, cols, mask) * _param(G, cols, mask) * z2)
    coupling = tl.sum(dl0 * a0) * z_rstd * z_rstd * z_rstd / D

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
    z = _param(NULL, cc, cmask)
    q = _param(Q, cc, cmask)
    g = _param(G, cc, cmask)
    tl.store(DQ + cc, _cast_to(t * g + dl0_c * z_rstd * z * g, DQ), mask=cmask)
    tl.store(DG + cc, _cast_to(t * q + dl0_c * z_rstd * z * q, DG), mask=cmask)
    tl.store(DZ + cc, _cast_to(w0do + z_rstd * q * g * dl0_c - z * coupling, DZ), mask=cmask)
    tl.store(DGATE, _cast_to(tl.sum(dgate), DGATE), mask=pid == 0)


# Launch shapes (measured on an H200, see docs/performance.md; `python -m kernels.bench_routing
# --tune` times the alternatives). Row kernels: rows each program walks, warps per 4096 columns
# and, for the forward, a register cap per thread (None: ptxas decides), by the number of
# caller sources, since registers grow with it. Mix kernel: tile rows, tile columns (within
# one head) and warps.
FWD = {
    1: {"rows": 1, "warps_per_4096": 8, "maxnreg": None},
    2: {"rows": 1, "warps_per_4096": 8, "maxnreg": None},
    3: {"rows": 2, "warps_per_4096": 8, "maxnreg": 80},
    4: {"rows": 4, "warps_per_4096": 8, "maxnreg": None},
    5: {"rows": 2, "warps_per_4096": 8, "maxnreg": 80},
    6: {"rows": 2, "warps_per_4096": 8, "maxnreg": 80},
    7: {"rows": 1, "warps_per_4096": 8, "maxnreg": None},
    8: {"rows": 2, "warps_per_4096": 8, "maxnreg": None},
}
# given_rstd: read a marked source's rstd (computed once, _source_rstd) instead of computing it
STATS = {
    n: {"rows": 32, "warps_per_4096": 8, "maxnreg": 128 if n <= 3 else None, "given_rstd": n not in (5, 6)} for n in FWD
}
MIX = {"block_m": 32, "block_kc": 64, "warps": 4, "calls": 4}  # calls: most calls one pass serves
NORM = {"block_m": 32, "block_d": 128, "warps": 4}
RSTD = {"block_r": 4, "block_c": 1024, "warps": 4}
FINISH = {"block_c": 32, "block_p": 256, "warps": 8}  # columns per program, partials per step


class _Launcher:
    """Launches a jitted kernel through its compiled binary once Triton has built it.

    Triton's own launch binds and specialises every argument in Python on each call
    (about 0.1 ms with a tuple of source pointers, measured: more than the kernels take).
    Here the binary is looked up by what Triton specialises on (dtypes, 16-byte
    alignment of each pointer, integers equal to 1 or divisible by 16), and the first
    call of each key goes through Triton, which compiles and launches it.
    """

    def __init__(self, fn):
        self.fn = fn
        self.binaries: dict[tuple, tuple[dict, object]] = {}

    @staticmethod
    def _key(args: tuple) -> tuple:
        """What Triton specialises on, flattened: per tensor its dtype and address mod 16
        (Triton: 16-byte alignment), per integer == 1, its value mod 16 and >= 2**31; a
        tuple's tensors in place. One flat loop: it runs for every argument of every launch."""
        key = []
        for arg in args:
            if isinstance(arg, torch.Tensor):
                key += (arg.dtype, arg.data_ptr() & 15)
            elif isinstance(arg, tuple):
                key.append(len(arg))
                for t in arg:
                    key += (t.dtype, t.data_ptr() & 15)
            elif isinstance(arg, int) and not isinstance(arg, bool):
                key += (arg == 1, arg & 15, arg >= 2**31)
            else:
                key.append(None)
        return tuple(key)

    def __call__(self, grid: tuple[int, ...], num_warps: int, consts: dict, *args, maxnreg: int | None = None) -> None:
        if _interpreting():
            self.fn[grid](*args, num_warps=num_warps, **consts)
            return
        device = torch.cuda.current_device()
        # consts come from the cached launch-shape functions: the same dict for the same shape.
        # The entry keeps its dict alive, so its id is never reused for another.
        key = (device, num_warps, maxnreg, id(consts), self._key(args))
        entry = self.binaries.get(key)
        if entry is None:
            if list(consts) != self.fn.arg_names[len(args) :]:  # the binary takes them positionally
                raise RuntimeError(f"{self.fn.__name__}: constexprs {list(consts)} out of signature order")
            cap = {} if maxnreg is None else {"maxnreg": maxnreg}
            self.binaries[key] = consts, self.fn[grid](*args, num_warps=num_warps, **cap, **consts)
            return
        binary = entry[1]
        grid = (*grid, 1, 1)
        stream = torch._C._cuda_getCurrentRawStream(device)
        binary.run(
            grid[0], grid[1], grid[2], stream, binary.function, binary.packed_metadata, None, None, None,
            *args, *consts.values(),
        )  # fmt: skip


_launch_fwd = _Launcher(_route_fwd_kernel)
_launch_stats = _Launcher(_route_bwd_stats_kernel)
_launch_mix = _Launcher(_route_bwd_mix_kernel)
_launch_norm = _Launcher(_route_bwd_norm_kernel)
_launch_rstd = _Launcher(_source_rstd_kernel)
_launch_finish = _Launcher(_route_bwd_finish_kernel)


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _head_chunks(k: int, itemsize: int) -> dict[str, int]:
    """A head's columns as BLOCK_S chunks of BLOCK_I: a chunk is 32 threads x 16 bytes, the
    most one warp loads in one instruction (_row_tile_offsets)."""
    block_k = _pow2(k)
    chunk = min(block_k, 32 * 16 // itemsize)
    return {"BLOCK_S": block_k // chunk, "BLOCK_I": chunk}


@functools.cache
def _row_launch(
    m: int,
    d: int,
    num_heads: int,
    num_sources: int,
    itemsize: int,
    rows: int,
    warps_per_4096: int,
    joint: bool = True,
    known: int | None = None,
) -> tuple:
    """(grid, num_warps, constexprs) of a row kernel over itemsize-byte elements; cached per
    shape, since computing it costs more Python time per call than launching the kernel.
    `known`, for the stats kernel: bit i set if source i's rstd is given (RSTDS[i])."""
    k = d // num_heads
    exact = m % rows == 0 and _pow2(num_heads) == num_heads and _pow2(k) == k
    consts = {
        "D": d,
        "H": num_heads,
        "K": k,
        "NUM_SRC": num_sources,
        "BLOCK_H": _pow2(num_heads),
        **_head_chunks(k, itemsize),
        "BLOCK_N": _pow2(num_sources + 1),
        "ROWS": rows,
        "EVEN": exact,
        "JOINT": joint,
        **({} if known is None else {"KNOWN": known}),
    }
    warps = max(1, min(16, _pow2(_cdiv(d * warps_per_4096, 4096))))
    return (_cdiv(m, rows),), warps, consts


@functools.cache
def _mix_launch(
    m: int,
    d: int,
    num_heads: int,
    num_sources: int,
    num_calls: int,
    block_m: int,
    block_kc: int,
    accum: int,
    shared: int,
) -> tuple:
    k = d // num_heads
    block_kc = min(block_kc, _pow2(k))
    consts = {
        "D": d,
        "H": num_heads,
        "K": k,
        "NUM_SRC": num_sources,
        "NUM_CALLS": num_calls,
        "BLOCK_H": _pow2(num_heads),
        "BLOCK_M": block_m,
        "BLOCK_KC": block_kc,
        "EVEN": m % block_m == 0 and k % block_kc == 0,
        "ACCUM": accum,
        "SHARED": shared,
    }
    return (_cdiv(m, block_m), num_heads * _cdiv(k, block_kc)), consts


@functools.cache
def _norm_launch(m: int, d: int, block_m: int, block_d: int) -> tuple:
    block_d = min(block_d, _pow2(d))
    consts = {"D": d, "BLOCK_M": block_m, "BLOCK_D": block_d, "EVEN": m % block_m == 0 and d % block_d == 0}
    return (_cdiv(m, block_m), _cdiv(d, block_d)), consts


@functools.cache
def _finish_launch(d: int, num_heads: int, itemsize: int, parts: int, block_c: int, block_p: int, warps: int) -> tuple:
    k = d // num_heads
    consts = {
        "P": parts,
        "D": d,
        "H": num_heads,
        "K": k,
        "BLOCK_H": _pow2(num_heads),
        **_head_chunks(k, itemsize),
        "BLOCK_P": min(block_p, _pow2(parts)),
        "BLOCK_C": block_c,
    }
    return (_cdiv(d, block_c),), warps, consts


_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # read by Triton when it decorates the kernels, above


def _interpreting() -> bool:
    return _INTERPRET


def _cpu_rows(m: int) -> int:
    """Rows per program in Triton's interpreter, where every program costs milliseconds of
    Python: about four programs per kernel, as many rows each as that takes."""
    return _pow2(_cdiv(m, 4))


def _empty(*shape_and_args, **kwargs) -> torch.Tensor:
    return torch.empty(*shape_and_args, **kwargs)


def _empty_like(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(t)


def _check_inputs(x: torch.Tensor, sources: Sequence[torch.Tensor]) -> None:
    if not x.is_cuda and not _interpreting():
        raise ValueError("backend='triton' needs CUDA tensors (or TRITON_INTERPRET=1 on CPU)")
    if not 1 <= len(sources) <= MAX_SOURCES:
        raise ValueError(f"backend='triton' routes over 1..{MAX_SOURCES} sources, got {len(sources)}")


def _known_rstds(rstds: Sequence[torch.Tensor | None], n: int, spare: torch.Tensor) -> tuple[int, tuple]:
    """The row kernels' KNOWN bits and RSTDS pointers; `spare` stands in where none is given."""
    rstds = tuple(rstds) or (None,) * n
    known = sum(1 << i for i, r in enumerate(rstds) if r is not None)
    return known, tuple(spare if r is None else r for r in rstds)


def _source_rstd(source: torch.Tensor, eps: float) -> torch.Tensor:
    """1 / rms per row of a source, fp32 [rows]."""
    src = source.contiguous()
    d = src.shape[-1]
    m = src.numel() // d
    rstd = _empty((m,), device=src.device, dtype=torch.float32)
    block_r = _cpu_rows(m) if _interpreting() else RSTD["block_r"]
    block_c = min(_pow2(d), RSTD["block_c"])
    consts = _rstd_consts(d, block_r, block_c)
    _launch_rstd((_cdiv(m, block_r),), RSTD["warps"], consts, src, rstd, m, eps)
    return rstd


@functools.cache
def _rstd_consts(d: int, block_r: int, block_c: int) -> dict:
    return {"D": d, "BLOCK_R": block_r, "BLOCK_C": block_c}


def _forward(
    x: torch.Tensor,
    sources: Sequence[torch.Tensor],
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
    interp = _interpreting()
    launch = FWD[len(srcs)]
    rows = _cpu_rows(m) if interp else launch["rows"]
    itemsize = xs.element_size()
    grid, warps, consts = _row_launch(m, d, num_heads, len(srcs), itemsize, rows, launch["warps_per_4096"], not interp)
    params = (null.contiguous(), query.contiguous(), norm_weight.contiguous(), gate.contiguous())
    _launch_fwd(grid, warps, consts, xs, srcs, *params, out, weights, m, eps, maxnreg=launch["maxnreg"])
    return out, weights


class _MixCall(NamedTuple):
    """What the mix kernel needs of one call, once its stats have run."""

    dout: torch.Tensor
    coef: torch.Tensor  # [3, N, m, H]: A, B, C per source (the stats kernel's COEF)
    query: torch.Tensor
    norm_weight: torch.Tensor


def _stats(
    grad_out: torch.Tensor,
    sources: Sequence[torch.Tensor],
    null: torch.Tensor,
    query: torch.Tensor,
    norm_weight: torch.Tensor,
    gate: torch.Tensor,
    num_heads: int,
    eps: float,
    rstds: Sequence[torch.Tensor | None] = (),
) -> tuple[_MixCall, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One call's backward up to its sources' gradients: the stats and finishing kernels give
    the site's parameter gradients and the coefficients the mix kernel turns into the sources'."""
    _check_inputs(grad_out, sources)
    d = grad_out.shape[-1]
    m = grad_out.numel() // d
    n = len(sources)
    dout = grad_out.contiguous()
    srcs = tuple(s.contiguous() for s in sources)
    z, q, g, gate = (t.contiguous() for t in (null, query, norm_weight, gate))
    interp = _interpreting()
    launch = STATS[n]
    rows = _cpu_rows(m) if interp else launch["rows"]
    parts = _cdiv(m, rows)
    # One allocation: the coefficients [3, N, m, H], then the per-program partials.
    coef_size = 3 * n * m * num_heads
    work = _empty((coef_size + parts * (2 * d + num_heads + 1),), device=dout.device, dtype=torch.float32)
    known, rstd_ptrs = _known_rstds(rstds if launch["given_rstd"] else (), n, work)
    grid, warps, consts = _row_launch(
        m, d, num_heads, n, dout.element_size(), rows, launch["warps_per_4096"], not interp, known
    )
    cap = None if interp else launch["maxnreg"]
    _launch_stats(
        grid, warps, consts, dout, srcs, rstd_ptrs, z, q, g, gate, work, work[coef_size:], m, eps, maxnreg=cap
    )
    dz, dq, dg, dgate = (_empty_like(t) for t in (z, q, g, gate))
    grid, warps, consts = _finish_launch(
        d, num_heads, z.element_size(), parts, FINISH["block_c"], FINISH["block_p"], FINISH["warps"]
    )
    _launch_finish(grid, warps, consts, work[coef_size:], z, q, g, dz, dq, dg, dgate, eps)
    return _MixCall(dout, work[:coef_size], q, g), dz, dq, dg, dgate


def _mix(
    calls: Sequence[_MixCall],
    sources: Sequence[torch.Tensor],
    slots: Sequence[_GradSlot | None],
    num_heads: int,
) -> list[torch.Tensor | None]:
    """The sources' gradients from 1..4 calls over the same sources, in one pass. A source
    with a slot has them added to the slot's sum (its norm term deferred to the slot's
    csum); the others get a new tensor, returned (None in the slots' places)."""
    srcs = tuple(s.contiguous() for s in sources)
    d = srcs[0].shape[-1]
    m = srcs[0].numel() // d
    dsrcs, csums, accum, shared = [], [], 0, 0
    for i, (s, slot) in enumerate(zip(srcs, slots, strict=True)):
        if slot is None:
            dsrcs.append(_empty_like(s))
            csums.append(dsrcs[-1])  # not read or written
            continue
        shared |= 1 << i
        if slot.grad is None:
            slot.grad, slot.csum = _empty_like(s), _empty((m,), device=s.device, dtype=torch.float32)
        else:
            accum |= 1 << i
        dsrcs.append(slot.grad)
        csums.append(slot.csum)
    if not 1 <= len(calls) <= 4:
        raise ValueError(f"mhar_route: one mix pass serves 1..4 calls, got {len(calls)} (MIX['calls'])")
    if len(calls) > 1 and shared != (1 << len(srcs)) - 1:
        raise RuntimeError("mhar_route: one mix pass serves several calls only when every source is shared")
    block_m = _cpu_rows(m) if _interpreting() else MIX["block_m"]
    grid, consts = _mix_launch(m, d, num_heads, len(srcs), len(calls), block_m, MIX["block_kc"], accum, shared)
    by_field = tuple(zip(*calls, strict=True))
    _launch_mix(grid, MIX["warps"], consts, *by_field, srcs, tuple(dsrcs), tuple(csums), m)
    return [None if slot is not None else ds for slot, ds in zip(slots, dsrcs, strict=True)]


def _finish_shared(source: torch.Tensor, slot: _GradSlot) -> torch.Tensor | None:
    """The complete gradient a slot gathered: its norm term applied, once."""
    if slot.pending is not None:
        slot.pending.flush()
    grad, csum, slot.grad, slot.csum = slot.grad, slot.csum, None, None
    if grad is None:
        return None
    src = source.contiguous()
    d = src.shape[-1]
    m = src.numel() // d
    if _interpreting():
        grid, consts = _norm_launch(m, d, _cpu_rows(m), _pow2(d))
    else:
        grid, consts = _norm_launch(m, d, NORM["block_m"], NORM["block_d"])
    _launch_norm(grid, NORM["warps"], consts, src, grad, csum, m)
    return grad


def _backward(
    grad_out: torch.Tensor,
    sources: Sequence[torch.Tensor],
    null: torch.Tensor,
    query: torch.Tensor,
    norm_weight: torch.Tensor,
    gate: torch.Tensor,
    num_heads: int,
    eps: float,
) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of the sources and of the site's parameters, for one call on its own."""
    call, dz, dq, dg, dgate = _stats(grad_out, sources, null, query, norm_weight, gate, num_heads, eps)
    dsrcs = _mix([call], sources, (None,) * len(sources), num_heads)
    return dsrcs, dz, dq, dg, dgate


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


@torch.library.custom_op("mhar::route_bwd", mutates_args=())
def route_bwd(
    grad_out: torch.Tensor,
    sources: list[torch.Tensor],
    null: torch.Tensor,
    query: torch.Tensor,
    norm_weight: torch.Tensor,
    gate: torch.Tensor,
    num_heads: int,
    eps: float,
) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _backward(grad_out, sources, null, query, norm_weight, gate, num_heads, eps)


@route_bwd.register_fake
def _(grad_out, sources, null, query, norm_weight, gate, num_heads, eps):
    return (
        [torch.empty_like(s) for s in sources],
        torch.empty_like(null),
        torch.empty_like(query),
        torch.empty_like(norm_weight),
        torch.empty_like(gate),
    )


def _setup_context(ctx, inputs, output) -> None:
    x, sources, null, query, norm_weight, gate, num_heads, eps = inputs
    ctx.num_heads, ctx.eps = num_heads, eps
    ctx.save_for_backward(null, query, norm_weight, gate, *sources)


def _op_backward(ctx, grad_out, grad_weights):
    null, query, norm_weight, gate, *sources = ctx.saved_tensors
    dsrcs, dz, dq, dg, dgate = route_bwd(grad_out, sources, null, query, norm_weight, gate, ctx.num_heads, ctx.eps)
    return grad_out, dsrcs, dz, dq, dg, dgate, None, None


route_fwd.register_autograd(_op_backward, setup_context=_setup_context)


def _unpack_inputs(ctx) -> tuple[torch.Tensor, ...]:
    """The inputs kept by forward, released here: the graph may outlive the backward (the
    loss of one microbatch is alive during the next), the sources should not."""
    inputs, ctx.inputs = ctx.inputs, None
    if inputs is None:
        raise RuntimeError(
            "mhar_route: backward through the same triton routing call twice (retain_graph=True) is not "
            "supported; use backend='torch' for double backward"
        )
    for i, (t, version) in enumerate(zip(inputs, ctx.versions, strict=True)):
        if t._version != version:
            raise RuntimeError(
                f"mhar_route: input {i} of the routing call (null, query, norm_weight, gate, then the sources) "
                f"was modified in place after the call (version {version} -> {t._version}); its gradient "
                "would be wrong"
            )
    return inputs


class _GradSlot:
    """What the routing calls that read one source share: its gradient, summed in place
    (`grad` without the norm term, whose per-row coefficient the calls sum in `csum`;
    `pending`, the group of calls whose mix pass has not run yet), and its 1 / rms per row,
    computed by the first call that reads it and again if the source changes."""

    __slots__ = ("grad", "csum", "pending", "rstd", "rstd_key")

    def __init__(self) -> None:
        self.grad: torch.Tensor | None = None
        self.csum: torch.Tensor | None = None
        self.pending: _MixGroup | None = None
        self.rstd: torch.Tensor | None = None  # the source's 1 / rms per row, for every call
        self.rstd_key: tuple | None = None  # (eps, the source's version) it was computed for

    def source_rstd(self, source: torch.Tensor, eps: float) -> torch.Tensor:
        key = (eps, source._version)
        if self.rstd_key != key:
            self.rstd, self.rstd_key = _source_rstd(source, eps), key
        return self.rstd


class _MixGroup:
    """Backward calls over the same shared sources whose mix waits for the next such call, so
    that one pass over the sources' gradient sums serves up to MIX["calls"] of them (the two
    sites of a layer read the same sources): per source, one read and one write of its sum
    for the group instead of one of each per call. It runs when full, when a call over other
    sources needs one of its slots, or when a slot's sum is handed on (_finish_shared)."""

    def __init__(self, slots: tuple[_GradSlot, ...], sources: tuple[torch.Tensor, ...], num_heads: int) -> None:
        self.slots, self.sources, self.num_heads = slots, sources, num_heads
        self.calls: list[_MixCall] = []
        for slot in slots:
            slot.pending = self

    def flush(self) -> None:
        for slot in self.slots:
            slot.pending = None
        _mix(self.calls, self.sources, self.slots, self.num_heads)
        self.calls = []


def _mix_shared(call: _MixCall, sources: Sequence[torch.Tensor], slots: tuple[_GradSlot, ...], num_heads: int) -> None:
    """A call whose every source is shared joins the pending group over the same sources, or
    starts one."""
    group = slots[0].pending
    if group is None or group.slots != slots or group.num_heads != num_heads:
        for slot in slots:
            if slot.pending is not None:
                slot.pending.flush()
        group = _MixGroup(slots, tuple(sources), num_heads)
    group.calls.append(call)
    if len(group.calls) >= MIX["calls"]:
        group.flush()


class _SharedGrad(torch.autograd.Function):
    """Identity whose backward hands on the gradient its slot gathered (plus any that reached
    it the usual way, from consumers other than the eager routing calls)."""

    @staticmethod
    def forward(ctx, source, slot):
        ctx.source, ctx.slot = source, slot  # the source is alive for its readers' backward anyway
        ctx.set_materialize_grads(False)
        return source.view_as(source)

    @staticmethod
    def backward(ctx, grad):
        summed = _finish_shared(ctx.source, ctx.slot)
        ctx.source = None
        if summed is None:
            return grad, None
        if grad is not None:
            summed.add_(grad)
        return summed, None


_SLOT_ATTR = "_mhar_grad_slot"


def share_source_grad(source: torch.Tensor) -> torch.Tensor:
    """`source`, as a tensor whose gradient the eager triton routing calls that read it add
    into one buffer in place, inside their backward kernel, instead of each returning a new
    tensor for autograd to add (one read and write less per call, and no separate add kernel).
    Apply it once where a source is made; every other consumer sees an ordinary tensor."""
    if not (source.requires_grad and torch.is_grad_enabled()) or torch.compiler.is_compiling():
        return source
    slot = _GradSlot()
    shared = _SharedGrad.apply(source, slot)
    setattr(shared, _SLOT_ATTR, slot)
    return shared


def _grad_slots(sources: Sequence[torch.Tensor]) -> tuple[_GradSlot | None, ...]:
    slots, seen = [], set()
    for s in sources:
        slot = getattr(s, _SLOT_ATTR, None)
        if slot is not None and id(slot) in seen:
            slot = None  # the same source twice in one call: one kernel cannot add twice in place
        if slot is not None:
            seen.add(id(slot))
        slots.append(slot)
    return tuple(slots)


class _Route(torch.autograd.Function):
    """The same kernels for eager mode, without the custom-op dispatch, whose Python
    cost per call (about half a millisecond, measured) exceeds the kernels' own."""

    @staticmethod
    def forward(ctx, x, null, query, norm_weight, gate, num_heads, eps, *sources):
        ctx.slots = _grad_slots(sources)
        out, weights = _forward(x, sources, null, query, norm_weight, gate, num_heads, eps)
        # a marked source's rstd, for the stats kernel: computed by the first call that reads it
        rstds = [None if slot is None else slot.source_rstd(s, eps) for s, slot in zip(sources, ctx.slots, strict=True)]
        ctx.num_heads, ctx.eps, ctx.rstds = num_heads, eps, rstds
        # The backward needs the inputs only. Kept on ctx rather than saved with
        # save_for_backward, so an activation checkpoint around the call has no saved
        # tensor to unpack and never re-runs the forward; the version check that
        # save_for_backward would do is done in backward.
        ctx.inputs = (null, query, norm_weight, gate, *sources)
        ctx.versions = [t._version for t in ctx.inputs]
        ctx.mark_non_differentiable(weights)
        ctx.set_materialize_grads(False)  # no zero-filled gradient for the weights
        return out, weights

    @staticmethod
    def backward(ctx, grad_out, grad_weights):
        null, query, norm_weight, gate, *sources = _unpack_inputs(ctx)
        if grad_out is None:  # the output did not reach the loss
            return (None,) * (7 + len(sources))
        rstds, ctx.rstds = ctx.rstds, None
        call, dz, dq, dg, dgate = _stats(
            grad_out, sources, null, query, norm_weight, gate, ctx.num_heads, ctx.eps, rstds
        )
        # A shared source's gradient goes to its slot (None to autograd), the others to autograd.
        if all(slot is not None for slot in ctx.slots):
            _mix_shared(call, sources, ctx.slots, ctx.num_heads)
            dsrcs = [None] * len(sources)
        else:
            dsrcs = _mix([call], sources, ctx.slots, ctx.num_heads)
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
