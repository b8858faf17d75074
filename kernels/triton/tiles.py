"""Shared `@triton.jit` tile helpers of the routing kernels: row tiles, loads and stores, per-head sums.

The row kernels (forward, stats) hold a row as a [heads, chunks, chunk] tile (`row_tile_offsets`),
so that Triton gives each warp whole heads: the per-head sums are warp shuffles, and the only
cross-warp sum per source is the full-width norm ([heads, columns] tiles spread a 512-wide head
over two warps, with many more barriers: docs/history/kernels-notebook.md, "Layout decides the barriers").
Registers bound them too (each row's tiles live in them): the forward keeps no parameter tile
resident (query, norm weight and null are re-read from L1). `python -m benchmarks.compile_report`
prints registers and spills per kernel for sm_90 without a GPU.
"""

import os

import triton
import triton.language as tl


@triton.jit
def row_tile_offsets(
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
def load_raw(ptr, mask, EVEN: tl.constexpr):
    """A tile in its storage dtype, unmasked when its shape is exact (EVEN): issued
    early (prefetch) and widened where used."""
    if EVEN:
        return tl.load(ptr)
    return tl.load(ptr, mask=mask, other=0.0)


@triton.jit
def store(ptr, val, mask, EVEN: tl.constexpr):
    if EVEN:
        tl.store(ptr, cast_to(val, ptr))
    else:
        tl.store(ptr, cast_to(val, ptr), mask=mask)


# Triton's interpreter casts fp32 to bf16 by truncation, a GPU to nearest even (one instruction per
# two elements): interpreted, the kernels round by hand (four integer instructions an element), so
# that the CPU tests see the GPU's values
ROUND_BY_HAND = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")


@triton.jit
def cast_to(val, PTR):
    """fp32 -> the element type of PTR; bf16 rounds to nearest even."""
    if ROUND_BY_HAND:
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
def head_sum(a):
    return tl.sum(tl.sum(a, axis=2), axis=1)


@triton.jit
def head_sums2(a, b, JOINT: tl.constexpr):
    """Per-head sums of two row tiles: one joint reduction on a GPU; two plain sums in
    Triton's interpreter, which runs a custom combine function element by element."""
    if JOINT:
        return tl.reduce(tl.reduce((a, b), 2, _add2), 1, _add2)
    return head_sum(a), head_sum(b)


@triton.jit
def head_sums3(a, b, c, JOINT: tl.constexpr):
    if JOINT:
        return tl.reduce(tl.reduce((a, b, c), 2, _add3), 1, _add3)
    return head_sum(a), head_sum(b), head_sum(c)


@triton.jit
def param(PTR, cols, mask):
    return tl.load(PTR + cols, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def row_rstd(RSTD, row, M, EVEN: tl.constexpr):
    """A source's 1 / rms for one row, computed beforehand (source_rstd_kernel)."""
    if EVEN:
        return tl.load(RSTD + row)
    return tl.load(RSTD + row, mask=row < M, other=1.0)


@triton.jit
def null_logit(NULL, Q, G, cols, mask, D: tl.constexpr, eps, JOINT: tl.constexpr):
    """The null source's logit per head, the same for every row."""
    z = param(NULL, cols, mask)
    zz, zq = head_sums2(z * z, z * param(Q, cols, mask) * param(G, cols, mask), JOINT)
    return zq * tl.rsqrt(tl.sum(zz) / D + eps)


@triton.jit
def lead_sources(SRCS, offs, mask, NUM_SRC: tl.constexpr):
    """A row's first two sources, raw (the first twice with one source); masked: a row past the
    program's or the input's end loads nothing."""
    s_a = tl.load(SRCS[0] + offs, mask=mask, other=0.0)
    s_b = s_a
    if NUM_SRC > 1:
        s_b = tl.load(SRCS[1] + offs, mask=mask, other=0.0)
    return s_a, s_b


@triton.jit
def lead_tiles(DOUT, DOUT2, SRCS, offs, mask, NUM_SRC: tl.constexpr, SITES: tl.constexpr):
    """The stats kernel's first loads of a row: its output gradient(s) (the first twice with one
    site) and `lead_sources`."""
    do = tl.load(DOUT + offs, mask=mask, other=0.0)
    do2 = do
    if SITES > 1:
        do2 = tl.load(DOUT2 + offs, mask=mask, other=0.0)
    s_a, s_b = lead_sources(SRCS, offs, mask, NUM_SRC)
    return do, do2, s_a, s_b


@triton.jit
def pick(PTRS, k, COUNT: tl.constexpr):
    """PTRS[k] for a k known only at run time (a tuple of pointers indexed by a loop variable or a
    program's group): a chain of selects."""
    ptr = PTRS[0]
    for j in tl.static_range(1, COUNT):
        ptr = tl.where(k == j, PTRS[j], ptr)
    return ptr
