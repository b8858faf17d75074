"""Backward kernels of the routing op: stats (coefficients and weight-gradient partials), finish, mix, norm term.

None uses atomics (repeated runs are bitwise equal), and they need only the op's inputs and the
routing logits its forward wrote:
- stats: per row, a first pass over the sources that sums each one's product with the output
  gradient per head (and its norm, unless a marked source's 1 / rms is given), takes the softmax
  of the forward's logits (read, not recomputed: the query and norm weight are not read), and
  writes, per source, row and head, the coefficients the sources' gradients are linear in; a
  second pass over the same tiles (from L1) adds the query/norm-weight term to the program's
  sums over its rows, so a call's parameter gradients need nothing else;
- finish: sums those per-program partials in a fixed order;
- mix: a streaming kernel over (row block, column block) tiles, with no row-wide reduction,
  that turns the coefficients into every source's gradient (for up to 4 calls over the same
  sources in one pass, kernels/triton/shared.py);
- norm: a shared source's norm term, applied once its gradient sum is complete.
The math is docs/design.md section 2.3.
"""

import triton
import triton.language as tl

from kernels.triton.tiles import (
    cast_to,
    head_sum,
    head_sums2,
    head_sums3,
    lead_tiles,
    load_raw,
    param,
    pick,
    row_rstd,
    row_tile_offsets,
    store,
)


@triton.jit
def _stats_row(
    w0do,
    dl0,
    dgate,
    lg_t,
    c_t,
    r_t,
    do,
    gate,
    COEF,
    row,
    M,
    plane,
    D: tl.constexpr,
    H: tl.constexpr,
    NUM_SRC: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """A site's row from its [heads, sources] tiles (the forward's logits, the products c_n =
    <dout, s_n> and the sources' rstd; the null in column 0): its coefficients stored, its sums
    over rows updated; returns them and the per-source B (rstd_n dl_n) the second pass weighs
    sources by. A tile's row is one head, held whole by each thread of that head's warp, so the
    sums over sources are a thread's own."""
    nn = tl.arange(0, BLOCK_N)[None, :]
    hw = tl.arange(0, BLOCK_H)[:, None]
    used = nn < NUM_SRC + 1
    # `+ 0 c_t` gives the logits c_t's layout, where each thread of a head's warp holds the head's
    # whole row, so the sums over sources below are a thread's own; in the load's layout they
    # crossed warps, through shared memory
    lg_t = tl.where(used, lg_t + 0.0 * c_t, float("-inf"))
    m = tl.max(lg_t, axis=1)
    e = tl.where(used, tl.exp(lg_t - m[:, None]), 0.0)
    w = e * (1.0 / tl.sum(e, axis=1))[:, None]
    dot = tl.sum(w * c_t, axis=1)
    a_t = gate * w
    dl = a_t * (c_t - dot[:, None])
    b_t = dl * r_t
    c_t = dl * tl.where(used, lg_t, 0.0) * (r_t * r_t / D)
    w0do += tl.sum(tl.where(nn == 0, a_t, 0.0), axis=1)[:, None, None] * do
    dl0 += tl.sum(tl.where(nn == 0, dl, 0.0), axis=1)
    dgate += dot
    # column n of the tiles is source n - 1's coefficients (COEF holds the caller's sources only)
    offs = (nn - 1) * (M * H) + row * H + hw
    valid = (nn >= 1) & used & (hw < H) & (row < M)
    tl.store(COEF + offs, a_t, mask=valid)
    tl.store(COEF + plane + offs, b_t, mask=valid)
    tl.store(COEF + 2 * plane + offs, c_t, mask=valid)
    bs = ()
    for i in tl.static_range(NUM_SRC):
        bs = bs + (tl.sum(tl.where(nn == i + 1, b_t, 0.0), axis=1),)
    return w0do, dl0, dgate, bs


@triton.jit
def _store_partials(
    PARTS,
    pid,
    slots,
    t,
    w0do,
    dl0,
    dgate,
    cols,
    mask,
    D: tl.constexpr,
    H: tl.constexpr,
    BLOCK_H: tl.constexpr,
    EVEN: tl.constexpr,
):
    """This program's sums over its rows, in its slot `pid` of the `slots` partials (_partials)."""
    hv = tl.arange(0, BLOCK_H)
    T_PART, W0DO_PART, DL0_PART, DGATE_PART = _partials(PARTS, slots, D, H)
    part = pid.to(tl.int64) * D + cols
    store(T_PART + part, t, mask, EVEN)
    store(W0DO_PART + part, w0do, mask, EVEN)
    tl.store(DL0_PART + pid * H + hv, dl0, mask=hv < H)
    tl.store(DGATE_PART + pid, tl.sum(tl.where(hv < H, dgate, 0.0)))


@triton.jit
def route_bwd_stats_kernel(
    DOUT,
    SRCS,
    RSTDS,
    NULL,
    LG,
    GATE,
    COEF,
    PARTS,
    DOUT2,
    NULL2,
    LG2,
    GATE2,
    COEF2,
    PARTS2,
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
    SITES: tl.constexpr,
    PREFETCH: tl.constexpr,
    GROUPS: tl.constexpr,
):
    # Per row and head, with c_n = <dout_h, s_n,h>, l_n = rstd_n <(q g)_h, s_n,h> the logits the
    # forward saved (LG, [N, M, H], the null's in plane 0), w = softmax_n(l_n),
    # dot = sum_n w_n c_n, dl_n = gate w_n (c_n - dot):
    #   ds_n = A_n dout + B_n (q g) - C_n s_n   with   A_n = gate w_n,  B_n = rstd_n dl_n,
    #   C_n = rstd_n^2 sum_h(dl_n l_n) / D.
    # COEF[k, n - 1, row, h] holds A, B and C's terms per head (the mix kernel sums them) for the
    # sources n >= 1. The weight gradients are sums over rows: of sum_n B_n s_n (query, norm
    # weight), of A_0 dout (null), of dl_0 (the null's norm term) and of dot (gate); this
    # program sums them over its ROWS rows into PARTS (_partials). B_n needs dot, known only
    # after the last source, so each row takes two passes over its sources: the first reduces
    # them to per-head scalars (c_n, norms), the second adds sum_n B_n s_n to the running sum,
    # re-reading the row's sources, which the first pass has just brought into L1. The logits
    # are read, not recomputed: the first pass has one product per site and source to sum, and
    # the query and norm weight are not read at all.
    # SITES = 2: a second site over the same sources (DOUT2 .. PARTS2), each source read once for both.
    # GROUPS: the per-site arguments are tuples, one entry per group of sites over the same sources (a
    # block's layers); program p serves group p % GROUPS, so that the programs of one row block run side by
    # side and all but the first find the block's sources in L2.
    # PREFETCH: a row's first loads (its output gradients and first two sources) are issued while
    # the row before finishes (its softmax, coefficients and second pass), so a program, one per
    # SM, always has loads in flight; without it each row starts by waiting for memory.
    group = tl.program_id(0) % GROUPS
    slot, slots = tl.program_id(0) // GROUPS, tl.num_programs(0) // GROUPS
    DOUT, NULL, LG, GATE = (
        pick(DOUT, group, GROUPS),
        pick(NULL, group, GROUPS),
        pick(LG, group, GROUPS),
        pick(GATE, group, GROUPS),
    )
    COEF, PARTS = pick(COEF, group, GROUPS), pick(PARTS, group, GROUPS)
    DOUT2, NULL2, LG2 = pick(DOUT2, group, GROUPS), pick(NULL2, group, GROUPS), pick(LG2, group, GROUPS)
    GATE2, COEF2, PARTS2 = pick(GATE2, group, GROUPS), pick(COEF2, group, GROUPS), pick(PARTS2, group, GROUPS)
    cols, mask = row_tile_offsets(BLOCK_H, BLOCK_S, BLOCK_I, H, K)
    nn = tl.arange(0, BLOCK_N)[None, :]
    hw = tl.arange(0, BLOCK_H)[:, None]
    lg_ok = (nn < NUM_SRC + 1) & (hw < H)
    plane = NUM_SRC * M * H
    gate = tl.load(GATE).to(tl.float32)
    t = tl.zeros([BLOCK_H, BLOCK_S, BLOCK_I], tl.float32)
    w0do = tl.zeros([BLOCK_H, BLOCK_S, BLOCK_I], tl.float32)
    dl0 = tl.zeros([BLOCK_H], tl.float32)
    dgate = tl.zeros([BLOCK_H], tl.float32)
    if SITES > 1:
        gate2 = tl.load(GATE2).to(tl.float32)
        t2 = tl.zeros([BLOCK_H, BLOCK_S, BLOCK_I], tl.float32)
        w0do2 = tl.zeros([BLOCK_H, BLOCK_S, BLOCK_I], tl.float32)
        dl02 = tl.zeros([BLOCK_H], tl.float32)
        dgate2 = tl.zeros([BLOCK_H], tl.float32)
    start = slot.to(tl.int64) * ROWS
    if PREFETCH:
        n_do, n_do2, n_a, n_b = lead_tiles(DOUT, DOUT2, SRCS, start * D + cols, mask & (start < M), NUM_SRC, SITES)
    for r in range(ROWS):
        row = start + r
        row_mask = mask & (row < M)
        base = row * D
        # loads run two sources ahead of the reductions, as in the forward
        if PREFETCH:
            do, do2, s_a, s_b = n_do.to(tl.float32), n_do2.to(tl.float32), n_a, n_b
        else:  # inline, not lead_tiles, as in the forward: fewer registers (docs/history/kernels-notebook.md)
            do = load_raw(DOUT + base + cols, row_mask, EVEN).to(tl.float32)
            do2 = do
            if SITES > 1:
                do2 = load_raw(DOUT2 + base + cols, row_mask, EVEN).to(tl.float32)
            s_a = load_raw(SRCS[0] + base + cols, row_mask, EVEN)
            s_b = s_a
            if NUM_SRC > 1:
                s_b = load_raw(SRCS[1] + base + cols, row_mask, EVEN)
        lg_offs = nn * (M * H) + row * H + hw
        lg_t = tl.load(LG + lg_offs, mask=lg_ok & (row < M), other=0.0)  # finite past the last row
        c_t = tl.where(nn == 0, head_sum(do * param(NULL, cols, mask))[:, None], 0.0)
        r_t = tl.zeros([BLOCK_H, BLOCK_N], tl.float32)
        if SITES > 1:
            lg_t2 = tl.load(LG2 + lg_offs, mask=lg_ok & (row < M), other=0.0)
            c_t2 = tl.where(nn == 0, head_sum(do2 * param(NULL2, cols, mask))[:, None], 0.0)
        for i in tl.static_range(NUM_SRC):
            s = s_a.to(tl.float32)
            if i + 1 < NUM_SRC:
                s_a = s_b
            if i + 2 < NUM_SRC:
                s_b = load_raw(SRCS[i + 2] + base + cols, row_mask, EVEN)
            if SITES > 1:
                if (KNOWN >> i) & 1:
                    sd, sd2 = head_sums2(s * do, s * do2, JOINT)
                    rstd = row_rstd(RSTDS[i], row, M, EVEN)
                else:
                    ss, sd, sd2 = head_sums3(s * s, s * do, s * do2, JOINT)
                    rstd = tl.rsqrt(tl.sum(ss) / D + eps)
                c_t2 = tl.where(nn == i + 1, sd2[:, None], c_t2)
            elif (KNOWN >> i) & 1:
                sd = head_sum(s * do)
                rstd = row_rstd(RSTDS[i], row, M, EVEN)
            else:
                ss, sd = head_sums2(s * s, s * do, JOINT)
                rstd = tl.rsqrt(tl.sum(ss) / D + eps)
            c_t = tl.where(nn == i + 1, sd[:, None], c_t)
            r_t = tl.where(nn == i + 1, rstd, r_t)
        if PREFETCH:  # the next row of this program's, if any
            n_mask = mask & (r + 1 < ROWS) & (row + 1 < M)
            n_do, n_do2, n_a, n_b = lead_tiles(DOUT, DOUT2, SRCS, base + D + cols, n_mask, NUM_SRC, SITES)
        w0do, dl0, dgate, bs = _stats_row(
            w0do,
            dl0,
            dgate,
            lg_t,
            c_t,
            r_t,
            do,
            gate,
            COEF,
            row,
            M,
            plane,
            D,
            H,
            NUM_SRC,
            BLOCK_H,
            BLOCK_N,
        )
        if SITES > 1:
            w0do2, dl02, dgate2, bs2 = _stats_row(
                w0do2,
                dl02,
                dgate2,
                lg_t2,
                c_t2,
                r_t,
                do2,
                gate2,
                COEF2,
                row,
                M,
                plane,
                D,
                H,
                NUM_SRC,
                BLOCK_H,
                BLOCK_N,
            )
        # the second pass: sum_n B_n s_n, the sources re-read (from L1: the first pass just loaded them)
        for i in tl.static_range(NUM_SRC):
            s = load_raw(SRCS[i] + base + cols, row_mask, EVEN).to(tl.float32)
            t += bs[i][:, None, None] * s
            if SITES > 1:
                t2 += bs2[i][:, None, None] * s
    _store_partials(PARTS, slot, slots, t, w0do, dl0, dgate, cols, mask, D, H, BLOCK_H, EVEN)
    if SITES > 1:
        _store_partials(PARTS2, slot, slots, t2, w0do2, dl02, dgate2, cols, mask, D, H, BLOCK_H, EVEN)


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
def route_bwd_mix_kernel(
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
    its norm term -C s is applied once, when the sum is complete (route_bwd_norm_kernel):
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
    do0 = load_raw(DOUTS[0] + tile, mask, EVEN).to(tl.float32)
    qg0 = (param(QS[0], col, kc < K) * param(GS[0], col, kc < K))[None, :]
    if NUM_CALLS > 1:
        do1 = load_raw(DOUTS[1] + tile, mask, EVEN).to(tl.float32)
        qg1 = (param(QS[1], col, kc < K) * param(GS[1], col, kc < K))[None, :]
    if NUM_CALLS > 2:
        do2 = load_raw(DOUTS[2] + tile, mask, EVEN).to(tl.float32)
        qg2 = (param(QS[2], col, kc < K) * param(GS[2], col, kc < K))[None, :]
    if NUM_CALLS > 3:
        do3 = load_raw(DOUTS[3] + tile, mask, EVEN).to(tl.float32)
        qg3 = (param(QS[3], col, kc < K) * param(GS[3], col, kc < K))[None, :]
    # the next source's running sum (and, unshared, the source) load while this one is mixed
    if ACCUM & 1:
        prev_next = load_raw(DSRCS[0] + tile, mask, EVEN)
    if not SHARED & 1:
        s_next = load_raw(SRCS[0] + tile, mask, EVEN)
    for i in tl.static_range(NUM_SRC):
        if (ACCUM >> i) & 1:
            prev = prev_next
        if not (SHARED >> i) & 1:
            s = s_next
        if i + 1 < NUM_SRC:
            if (ACCUM >> (i + 1)) & 1:
                prev_next = load_raw(DSRCS[i + 1] + tile, mask, EVEN)
            if not (SHARED >> (i + 1)) & 1:
                s_next = load_raw(SRCS[i + 1] + tile, mask, EVEN)
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
        store(DSRCS[i] + tile, ds, mask, EVEN)


@triton.jit
def route_bwd_norm_kernel(
    SRC, DSRC, CSUM, M, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, EVEN: tl.constexpr
):
    """A shared source's norm term, once its gradient sum is complete: ds -= csum[row] * s."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    tile = rows[:, None] * D + cols[None, :]
    mask = (rows < M)[:, None] & (cols < D)[None, :]
    c = tl.load(CSUM + rows, mask=rows < M, other=0.0)[:, None]
    s = load_raw(SRC + tile, mask, EVEN).to(tl.float32)
    ds = load_raw(DSRC + tile, mask, EVEN).to(tl.float32) - c * s
    store(DSRC + tile, ds, mask, EVEN)


@triton.jit
def route_bwd_finish_kernel(
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

    cols, mask = row_tile_offsets(BLOCK_H, BLOCK_S, BLOCK_I, H, K)
    z2 = param(NULL, cols, mask)
    z_rstd = tl.rsqrt(tl.sum(z2 * z2) / D + eps)
    a0 = head_sum(param(Q, cols, mask) * param(G, cols, mask) * z2)
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
    z = param(NULL, cc, cmask)
    q = param(Q, cc, cmask)
    g = param(G, cc, cmask)
    tl.store(DQ + cc, cast_to(t * g + dl0_c * z_rstd * z * g, DQ), mask=cmask)
    tl.store(DG + cc, cast_to(t * q + dl0_c * z_rstd * z * q, DG), mask=cmask)
    tl.store(DZ + cc, cast_to(w0do + z_rstd * q * g * dl0_c - z * coupling, DZ), mask=cmask)
    tl.store(DGATE, cast_to(tl.sum(dgate), DGATE), mask=pid == 0)
