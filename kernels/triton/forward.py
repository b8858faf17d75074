"""Forward kernels of the routing op: the fused routing pass over a row, and a source's 1 / rms per row.

Forward: one pass over the sources per token row, all heads at once; online softmax, the
full-width RMS norm fused (or a marked source's 1 / rms read, computed once for all its
calls), fp32 statistics, the null source read as one vector. Writes the routing weights
[N, M, H] (fp32) beside the output, which is x + gate * R, or gate * R alone without x (the
model adds x inside its compiled block, where the add is free). Two sites over the same
sources (a layer's attention and MLP inputs) share one pass: each source is read once for both.
"""

import triton
import triton.language as tl

from kernels.triton.tiles import (
    head_sum,
    head_sums2,
    head_sums3,
    load_raw,
    null_logit,
    param,
    row_rstd,
    row_tile_offsets,
    store,
)


@triton.jit
def source_rstd_kernel(SRC, RSTD, M, eps, D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
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
def _softmax_step(m, den, acc, logits, lg, s, nn, i: tl.constexpr):
    """One source's turn in a site's online softmax: the running max, denominator and
    accumulator rescaled, the source's logit kept for the weights."""
    m_new = tl.maximum(m, lg)
    alpha = tl.exp(m - m_new)
    p = tl.exp(lg - m_new)
    den = den * alpha + p
    acc = acc * alpha[:, None, None] + s * p[:, None, None]
    logits = tl.where(nn == i + 1, lg[:, None], logits)
    return m_new, den, acc, logits


@triton.jit
def _site_result(acc, m, den, logits, z_logit, NULL, gate, cols, mask):
    """A site's gate * R and routing weights once every source is in: the null source enters
    the accumulator last, so its tile is not held in registers across the loop."""
    acc += tl.exp(z_logit - m)[:, None, None] * param(NULL, cols, mask)
    return gate * (acc / den[:, None, None]), tl.exp(logits - m[:, None]) / den[:, None]


@triton.jit
def route_fwd_kernel(
    X,
    SRCS,
    RSTDS,
    NULL,
    Q,
    G,
    GATE,
    OUT,
    W,
    NULL2,
    Q2,
    G2,
    GATE2,
    OUT2,
    W2,
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
    HAS_X: tl.constexpr,
    SITES: tl.constexpr,
):
    # KNOWN: bit i set if source i's 1 / rms per row is given (RSTDS[i]); HAS_X: add x (X) to the
    # output, else write gate * R alone (X is not read). SITES = 2: a second site over the same
    # sources (NULL2 .. W2; the two sites of a layer), each source loaded once for both; without x.
    cols, mask = row_tile_offsets(BLOCK_H, BLOCK_S, BLOCK_I, H, K)
    # per-source statistics as [heads, sources] tiles, laid out as the heads' sums come
    nn = tl.arange(0, BLOCK_N)[None, :]
    hw = tl.arange(0, BLOCK_H)[:, None]
    w_mask = (nn < NUM_SRC + 1) & (hw < H)
    z_logit = null_logit(NULL, Q, G, cols, mask, D, eps, JOINT)
    gate = tl.load(GATE).to(tl.float32)
    if SITES > 1:
        z_logit2 = null_logit(NULL2, Q2, G2, cols, mask, D, eps, JOINT)
        gate2 = tl.load(GATE2).to(tl.float32)

    start = tl.program_id(0).to(tl.int64) * ROWS
    for r in range(ROWS):
        row = start + r
        row_mask = mask & (row < M)
        base = row * D
        # Online softmax over [null, sources...] per head. The null source enters the
        # running max and denominator from the start, the accumulator at the end.
        m = z_logit
        den = tl.full([BLOCK_H], 1.0, tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_S, BLOCK_I], tl.float32)
        logits = tl.where(nn == 0, z_logit[:, None], 0.0)
        if SITES > 1:
            m2 = z_logit2
            den2 = tl.full([BLOCK_H], 1.0, tl.float32)
            acc2 = tl.zeros([BLOCK_H, BLOCK_S, BLOCK_I], tl.float32)
            logits2 = tl.where(nn == 0, z_logit2[:, None], 0.0)
        # Loads run two sources ahead (then x, if added), so they overlap the reductions of
        # the previous two: s_a is the tile in use next, s_b the one after it.
        s_a = load_raw(SRCS[0] + base + cols, row_mask, EVEN)
        if NUM_SRC > 1:
            s_b = load_raw(SRCS[1] + base + cols, row_mask, EVEN)
        elif HAS_X:
            s_b = load_raw(X + base + cols, row_mask, EVEN)
        for i in tl.static_range(NUM_SRC):
            s = s_a.to(tl.float32)
            if i + 1 < NUM_SRC or HAS_X:
                s_a = s_b
            if i + 2 < NUM_SRC:
                s_b = load_raw(SRCS[i + 2] + base + cols, row_mask, EVEN)
            elif i + 2 == NUM_SRC and HAS_X:
                s_b = load_raw(X + base + cols, row_mask, EVEN)
            qg = param(Q, cols, mask) * param(G, cols, mask)
            if SITES > 1:
                qg2 = param(Q2, cols, mask) * param(G2, cols, mask)
                if (KNOWN >> i) & 1:
                    sq, sq2 = head_sums2(s * qg, s * qg2, JOINT)
                    rstd = row_rstd(RSTDS[i], row, M, EVEN)
                else:
                    ss, sq, sq2 = head_sums3(s * s, s * qg, s * qg2, JOINT)
                    rstd = tl.rsqrt(tl.sum(ss) / D + eps)
                m2, den2, acc2, logits2 = _softmax_step(m2, den2, acc2, logits2, sq2 * rstd, s, nn, i)
                lg = sq * rstd
            elif (KNOWN >> i) & 1:
                lg = head_sum(s * qg) * row_rstd(RSTDS[i], row, M, EVEN)
            else:
                ss, sq = head_sums2(s * s, s * qg, JOINT)
                lg = sq * tl.rsqrt(tl.sum(ss) / D + eps)
            m, den, acc, logits = _softmax_step(m, den, acc, logits, lg, s, nn, i)
        routed, w = _site_result(acc, m, den, logits, z_logit, NULL, gate, cols, mask)
        if HAS_X:
            routed += s_a.to(tl.float32)  # s_a holds x by now
        store(OUT + base + cols, routed, row_mask, EVEN)
        w_offs = nn * (M * H) + row * H + hw
        tl.store(W + w_offs, w, mask=w_mask & (row < M))
        if SITES > 1:
            routed2, w2 = _site_result(acc2, m2, den2, logits2, z_logit2, NULL2, gate2, cols, mask)
            store(OUT2 + base + cols, routed2, row_mask, EVEN)
            tl.store(W2 + w_offs, w2, mask=w_mask & (row < M))
