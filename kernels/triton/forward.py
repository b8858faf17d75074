"""Forward kernels of the routing op: the fused routing pass over a row, and a source's 1 / rms per row.

Forward: per token row, all heads at once, two passes over the sources: the first reduces each
source to its per-head logit (the full-width RMS norm fused, or a marked source's 1 / rms read,
computed once for all its calls), the second re-reads the tiles the first just brought into L1
and sums them with their softmax weights; only per-head scalars live between the passes, which
keeps registers low (docs/history/kernels-notebook.md, "two passes over a row's sources"). fp32 statistics, the
null source read as one vector.
The output is x + gate * R, or gate * R alone without x (the model adds x inside its compiled
block, where the add is free); beside it the routing logits [N, M, H] (fp32, the null's first),
which the backward reads instead of recomputing them and statistics turn into weights. Two sites
over the same sources (a layer's attention and MLP inputs) share the passes: each source is read
from memory once for both."""

import triton
import triton.language as tl

from kernels.triton.tiles import (
    head_sum,
    head_sums2,
    head_sums3,
    lead_sources,
    load_raw,
    null_logit,
    param,
    pick,
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
def route_fwd_kernel(
    X,
    SRCS,
    RSTDS,
    NULL,
    Q,
    G,
    GATE,
    OUT,
    LG,
    NULL2,
    Q2,
    G2,
    GATE2,
    OUT2,
    LG2,
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
    PREFETCH: tl.constexpr,
    GROUPS: tl.constexpr,
):
    # GROUPS: the per-site arguments (NULL .. LG2) are tuples, one entry per group of sites over the same sources
    # (a block's pairs); program p serves group p % GROUPS, so that the groups' programs of a row block run side
    # by side and all but the first find the sources in L2.
    group = tl.program_id(0) % GROUPS
    NULL, Q, G, GATE = (
        pick(NULL, group, GROUPS),
        pick(Q, group, GROUPS),
        pick(G, group, GROUPS),
        pick(GATE, group, GROUPS),
    )
    OUT, LG, NULL2, Q2 = (
        pick(OUT, group, GROUPS),
        pick(LG, group, GROUPS),
        pick(NULL2, group, GROUPS),
        pick(Q2, group, GROUPS),
    )
    G2, GATE2, OUT2, LG2 = (
        pick(G2, group, GROUPS),
        pick(GATE2, group, GROUPS),
        pick(OUT2, group, GROUPS),
        pick(LG2, group, GROUPS),
    )
    # KNOWN: bit i set if source i's 1 / rms per row is given (RSTDS[i]); HAS_X: add x (X) to the
    # output, else write gate * R alone (X is not read). SITES = 2: a second site over the same
    # sources (NULL2 .. LG2; the two sites of a layer), each source loaded once for both; without x.
    # PREFETCH: a row's first two sources are loaded while the row before finishes (ROWS > 1).
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

    start = (tl.program_id(0) // GROUPS).to(tl.int64) * ROWS
    if PREFETCH:
        n_a, n_b = lead_sources(SRCS, start * D + cols, mask & (start < M), NUM_SRC)
    for r in range(ROWS):
        row = start + r
        row_mask = mask & (row < M)
        base = row * D
        # Two passes over the row's sources: the first reduces each to its per-head logit, the
        # second (re-reading the tiles the first just brought into L1) sums them with their final
        # weights. Only per-head scalars live across the passes; no running accumulator is rescaled.
        m = z_logit
        logits = tl.where(nn == 0, z_logit[:, None], 0.0)
        if SITES > 1:
            m2 = z_logit2
            logits2 = tl.where(nn == 0, z_logit2[:, None], 0.0)
        lgs, lgs2 = (), ()
        if PREFETCH:
            s_a, s_b = n_a, n_b
        else:  # inline, not lead_sources: fewer registers (docs/history/kernels-notebook.md)
            s_a = load_raw(SRCS[0] + base + cols, row_mask, EVEN)
            s_b = s_a
            if NUM_SRC > 1:
                s_b = load_raw(SRCS[1] + base + cols, row_mask, EVEN)
        for i in tl.static_range(NUM_SRC):
            s = s_a.to(tl.float32)
            if i + 1 < NUM_SRC:
                s_a = s_b
            if i + 2 < NUM_SRC:
                s_b = load_raw(SRCS[i + 2] + base + cols, row_mask, EVEN)
            qg = param(Q, cols, mask) * param(G, cols, mask)
            if SITES > 1:
                qg2 = param(Q2, cols, mask) * param(G2, cols, mask)
                if (KNOWN >> i) & 1:
                    sq, sq2 = head_sums2(s * qg, s * qg2, JOINT)
                    rstd = row_rstd(RSTDS[i], row, M, EVEN)
                else:
                    ss, sq, sq2 = head_sums3(s * s, s * qg, s * qg2, JOINT)
                    rstd = tl.rsqrt(tl.sum(ss) / D + eps)
                lg2 = sq2 * rstd
                m2 = tl.maximum(m2, lg2)
                logits2 = tl.where(nn == i + 1, lg2[:, None], logits2)
                lgs2 = lgs2 + (lg2,)
                lg = sq * rstd
            elif (KNOWN >> i) & 1:
                lg = head_sum(s * qg) * row_rstd(RSTDS[i], row, M, EVEN)
            else:
                ss, sq = head_sums2(s * s, s * qg, JOINT)
                lg = sq * tl.rsqrt(tl.sum(ss) / D + eps)
            m = tl.maximum(m, lg)
            logits = tl.where(nn == i + 1, lg[:, None], logits)
            lgs = lgs + (lg,)
        if PREFETCH:  # the next row of this program's, if any
            n_a, n_b = lead_sources(SRCS, base + D + cols, mask & (r + 1 < ROWS) & (row + 1 < M), NUM_SRC)
        w = tl.where(w_mask, tl.exp(logits - m[:, None]), 0.0)
        inv = 1.0 / tl.sum(w, axis=1)
        acc = (tl.exp(z_logit - m) * inv * gate)[:, None, None] * param(NULL, cols, mask)
        if SITES > 1:
            w2 = tl.where(w_mask, tl.exp(logits2 - m2[:, None]), 0.0)
            inv2 = 1.0 / tl.sum(w2, axis=1)
            acc2 = (tl.exp(z_logit2 - m2) * inv2 * gate2)[:, None, None] * param(NULL2, cols, mask)
        for i in tl.static_range(NUM_SRC):
            s = tl.load(SRCS[i] + base + cols, mask=row_mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
            acc += (tl.exp(lgs[i] - m) * inv * gate)[:, None, None] * s
            if SITES > 1:
                acc2 += (tl.exp(lgs2[i] - m2) * inv2 * gate2)[:, None, None] * s
        if HAS_X:
            acc += load_raw(X + base + cols, row_mask, EVEN).to(tl.float32)
        store(OUT + base + cols, acc, row_mask, EVEN)
        lg_offs = nn * (M * H) + row * H + hw
        tl.store(LG + lg_offs, logits, mask=w_mask & (row < M))
        if SITES > 1:
            store(OUT2 + base + cols, acc2, row_mask, EVEN)
            tl.store(LG2 + lg_offs, logits2, mask=w_mask & (row < M))


@triton.jit
def route_fwd_sites_kernel(
    SRCS,
    RSTDS,
    NULLS,
    QS,
    GS,
    GATES,
    OUTS,
    LGS,
    M,
    eps,
    D: tl.constexpr,
    H: tl.constexpr,
    K: tl.constexpr,
    NUM_SRC: tl.constexpr,
    SITES: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_I: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ROWS: tl.constexpr,
    EVEN: tl.constexpr,
    JOINT: tl.constexpr,
):
    # A block's sites over the same sources (SITES of them; NULLS .. LGS hold one entry per site), gate * R
    # without x. Per row the sites take turns, each with route_fwd_kernel's two passes (logits, then the
    # weighted sum); the first site's first pass brings the row's sources into L1, where every later pass
    # finds them, so each source is read from memory once for all the sites. The loop over sites runs at
    # run time: unrolled, the compiler merged the sites' loads of the same tiles and held them in registers
    # (190 at 8 sources and 8 sites, against 128 now, whatever SITES is: benchmarks.compile_report). Every
    # source's 1 / rms per row is given (RSTDS): no full-width sum here.
    cols, mask = row_tile_offsets(BLOCK_H, BLOCK_S, BLOCK_I, H, K)
    nn = tl.arange(0, BLOCK_N)[None, :]
    hw = tl.arange(0, BLOCK_H)[:, None]
    w_mask = (nn < NUM_SRC + 1) & (hw < H)
    start = tl.program_id(0).to(tl.int64) * ROWS
    for r in range(ROWS):
        row = start + r
        row_mask = mask & (row < M)
        base = row * D
        rstds = ()
        for i in tl.static_range(NUM_SRC):
            rstds = rstds + (row_rstd(RSTDS[i], row, M, EVEN),)
        for k in range(SITES):
            null, q, g = pick(NULLS, k, SITES), pick(QS, k, SITES), pick(GS, k, SITES)
            z_logit = null_logit(null, q, g, cols, mask, D, eps, JOINT)
            qg = param(q, cols, mask) * param(g, cols, mask)
            m = z_logit
            logits = tl.where(nn == 0, z_logit[:, None], 0.0)
            lgs = ()
            # loads two sources ahead of the reductions (from memory for the first site, L1 after)
            s_a = load_raw(SRCS[0] + base + cols, row_mask, EVEN)
            s_b = s_a
            if NUM_SRC > 1:
                s_b = load_raw(SRCS[1] + base + cols, row_mask, EVEN)
            for i in tl.static_range(NUM_SRC):
                s = s_a.to(tl.float32)
                if i + 1 < NUM_SRC:
                    s_a = s_b
                if i + 2 < NUM_SRC:
                    s_b = load_raw(SRCS[i + 2] + base + cols, row_mask, EVEN)
                lg = head_sum(s * qg) * rstds[i]
                m = tl.maximum(m, lg)
                logits = tl.where(nn == i + 1, lg[:, None], logits)
                lgs = lgs + (lg,)
            w = tl.where(w_mask, tl.exp(logits - m[:, None]), 0.0)
            inv = 1.0 / tl.sum(w, axis=1)
            gate = tl.load(pick(GATES, k, SITES)).to(tl.float32)
            acc = (tl.exp(z_logit - m) * inv * gate)[:, None, None] * param(null, cols, mask)
            # re-read (from L1) with a cache hint the first pass's loads lack, so that the compiler does not merge
            # the two loads and keep every source's tile in registers across the softmax
            for i in tl.static_range(NUM_SRC):
                s = tl.load(SRCS[i] + base + cols, mask=row_mask, other=0.0, eviction_policy="evict_last")
                s = s.to(tl.float32)
                acc += (tl.exp(lgs[i] - m) * inv * gate)[:, None, None] * s
            store(pick(OUTS, k, SITES) + base + cols, acc, row_mask, EVEN)
            lg_offs = nn * (M * H) + row * H + hw
            tl.store(pick(LGS, k, SITES) + lg_offs, logits, mask=w_mask & (row < M))
