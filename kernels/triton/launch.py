"""Launch tables and the launcher of the routing kernels: the one module that touches Triton's internals.

Launch shapes are per kernel tables (`FWD`, `STATS`, their two-site `FWD_PAIR`, `STATS_PAIR`, the block
forward's `FWD_SITES`, and `MIX`, `NORM`, `RSTD`, `FINISH`, gathered in `DEFAULT_TABLES`); the host wrappers take a
`LaunchTables` argument, so a benchmark tunes them by passing another one
(`DEFAULT_TABLES.replace(...)`), never by assigning into these dicts.
`Launcher` launches a compiled kernel through its binary (Triton's `CompiledKernel.run`, a
private API), after the first call of each specialisation went through Triton itself.

Test seams (what tests may monkeypatch, and the host code reads through this module's
attributes at every call so that a patch takes effect):
- `empty`, `empty_like`: every buffer the op allocates (tests fill them with NaN);
- the launchers `fwd_launcher`, `sites_launcher`, `stats_launcher`, `mix_launcher`, `norm_launcher`,
  `rstd_launcher`, `finish_launcher` (tests count launches);
- the default tables' entries, e.g. `monkeypatch.setitem(launch.MIX, "calls", 1)`: the dicts
  that `DEFAULT_TABLES` holds, so an item patched here is what the default launches use.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Mapping

import torch

from kernels.triton.backward import (
    route_bwd_finish_kernel,
    route_bwd_mix_kernel,
    route_bwd_norm_kernel,
    route_bwd_stats_kernel,
)
from kernels.triton.forward import route_fwd_kernel, route_fwd_sites_kernel, source_rstd_kernel

MAX_SOURCES = 8  # the kernels' source pointer arguments: the most caller sources a call takes

# Launch shapes, chosen with `python -m benchmarks.bench_routing --tune`, which times the
# alternatives (the runs and their figures: docs/history/kernels-notebook.md, docs/performance.md). Row kernels:
# rows each program walks, warps per 4096 columns and a register cap per thread (None: ptxas
# decides), by the number of caller sources, since registers grow with it. Mix kernel: tile rows,
# tile columns (within one head) and warps.
# given_rstd (forward and stats): read a marked source's rstd (computed once, host.source_rstd)
# instead of computing its full-width norm, the row kernels' one cross-warp sum per source
FWD = {
    1: {"rows": 1, "warps_per_4096": 8, "maxnreg": None, "given_rstd": True, "prefetch": False},
    2: {"rows": 1, "warps_per_4096": 8, "maxnreg": None, "given_rstd": True, "prefetch": False},
    3: {"rows": 2, "warps_per_4096": 8, "maxnreg": 80, "given_rstd": True, "prefetch": False},
    4: {"rows": 4, "warps_per_4096": 8, "maxnreg": None, "given_rstd": True, "prefetch": False},
    5: {"rows": 2, "warps_per_4096": 8, "maxnreg": 80, "given_rstd": True, "prefetch": False},
    6: {"rows": 2, "warps_per_4096": 8, "maxnreg": 80, "given_rstd": True, "prefetch": False},
    7: {"rows": 1, "warps_per_4096": 8, "maxnreg": None, "given_rstd": True, "prefetch": False},
    8: {"rows": 2, "warps_per_4096": 8, "maxnreg": None, "given_rstd": True, "prefetch": False},
}
STATS = {
    n: {
        "rows": 32,
        "warps_per_4096": 8,
        "maxnreg": 128 if n <= 3 else None,
        "given_rstd": n not in (5, 6),
        "prefetch": n in (5, 6, 7),
    }
    for n in FWD
}
# Two sites over the same sources in one pass (a layer's two sites: host.forward_pair and
# host.backward_stats_pair), from `--tune pair`. A STATS_PAIR entry None takes two single-site
# stats passes instead; no entry is None now (kernels/README.md, "The launch tables").
_FWD_PAIR_SHAPES = {  # sources: (rows, register cap, prefetch)
    1: (4, None, True),
    2: (4, None, True),
    3: (4, None, True),
    4: (2, 128, False),
    5: (1, None, False),
    6: (1, 128, False),
    7: (1, 128, False),
    8: (2, 128, False),
}
FWD_PAIR = {
    n: {"rows": rows, "warps_per_4096": 8, "maxnreg": cap, "given_rstd": True, "prefetch": prefetch}
    for n, (rows, cap, prefetch) in _FWD_PAIR_SHAPES.items()
}
# STATS_PAIR from `--tune pair_load`, which runs the kernels after matmuls, as the step does. grouped: a block's
# pairs in one launch, off until a GPU has checked it against the reference (kernels/README.md, the dataflow)
STATS_PAIR = {
    n: {"rows": 64, "warps_per_4096": 8, "maxnreg": None, "given_rstd": True, "prefetch": n <= 3, "grouped": False}
    for n in FWD
}
# A block's sites over the same sources (host.forward_sites): at most `sites` a pass (2: the two-site
# kernel, FWD_PAIR's shapes; more: the block kernel, at these rows, warps and register cap). From
# `--tune block`: the two-site passes were the faster at every source count (docs/history/kernels-notebook.md).
# grouped (with `sites` 2): every pair of a block in one launch, sharing the sources through L2; not yet timed.
FWD_SITES = {n: {"sites": 2, "grouped": False, "rows": 4, "warps_per_4096": 8, "maxnreg": None} for n in FWD}
MIX = {"block_m": 32, "block_kc": 64, "warps": 4, "calls": 4}  # calls: most calls one pass serves
NORM = {"block_m": 32, "block_d": 128, "warps": 4}
RSTD = {"block_r": 4, "block_c": 1024, "warps": 4}
FINISH = {"block_c": 32, "block_p": 256, "warps": 8}  # columns per program, partials per step


@dataclasses.dataclass(frozen=True, eq=False)
class LaunchTables:
    """Every kernel's launch shapes: `fwd`, `stats` and their two-site forms keyed by the number of
    caller sources (1..MAX_SOURCES), the others one shape each (the keys of the module's tables)."""

    fwd: Mapping[int, Mapping] = dataclasses.field(default_factory=lambda: FWD)
    stats: Mapping[int, Mapping] = dataclasses.field(default_factory=lambda: STATS)
    fwd_pair: Mapping[int, Mapping] = dataclasses.field(default_factory=lambda: FWD_PAIR)
    stats_pair: Mapping[int, Mapping] = dataclasses.field(default_factory=lambda: STATS_PAIR)
    fwd_sites: Mapping[int, Mapping] = dataclasses.field(default_factory=lambda: FWD_SITES)
    mix: Mapping = dataclasses.field(default_factory=lambda: MIX)
    norm: Mapping = dataclasses.field(default_factory=lambda: NORM)
    rstd: Mapping = dataclasses.field(default_factory=lambda: RSTD)
    finish: Mapping = dataclasses.field(default_factory=lambda: FINISH)

    def replace(self, **changes) -> LaunchTables:
        """These tables with some entries changed, merged into the current ones: `fwd={3: {...}}`
        changes the forward's shape at 3 sources only, `mix={"calls": 1}` one key of the mix's."""
        merged = {}
        for name, change in changes.items():
            current = getattr(self, name)
            if name in ("fwd", "stats", "fwd_pair", "stats_pair", "fwd_sites"):
                merged[name] = {**current, **{n: {**(current[n] or {}), **shape} for n, shape in change.items()}}
            else:
                merged[name] = {**current, **change}
        return dataclasses.replace(self, **merged)


DEFAULT_TABLES = LaunchTables()


class Launcher:
    """Launches a jitted kernel through its compiled binary once Triton has built it.

    Triton's own launch binds and specialises every argument in Python on each call
    (with a tuple of source pointers it costs more than the kernels take: docs/history/kernels-notebook.md).
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
        if interpreting():
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
            grid[0],
            grid[1],
            grid[2],
            stream,
            binary.function,
            binary.packed_metadata,
            None,
            None,
            None,
            *args,
            *consts.values(),
        )


fwd_launcher = Launcher(route_fwd_kernel)
sites_launcher = Launcher(route_fwd_sites_kernel)
stats_launcher = Launcher(route_bwd_stats_kernel)
mix_launcher = Launcher(route_bwd_mix_kernel)
norm_launcher = Launcher(route_bwd_norm_kernel)
rstd_launcher = Launcher(source_rstd_kernel)
finish_launcher = Launcher(route_bwd_finish_kernel)


def empty(*shape_and_args, **kwargs) -> torch.Tensor:
    return torch.empty(*shape_and_args, **kwargs)


def empty_like(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(t)


_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # read by Triton when it decorates the kernels


def interpreting() -> bool:
    return _INTERPRET


def cpu_rows(m: int) -> int:
    """Rows per program in Triton's interpreter, where every program runs as Python: about four
    programs per kernel, as many rows each as that takes."""
    return pow2(cdiv(m, 4))


def pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _head_chunks(k: int, itemsize: int) -> dict[str, int]:
    """A head's columns as BLOCK_S chunks of BLOCK_I: a chunk is 32 threads x 16 bytes, the
    most one warp loads in one instruction (tiles.row_tile_offsets)."""
    block_k = pow2(k)
    chunk = min(block_k, 32 * 16 // itemsize)
    return {"BLOCK_S": block_k // chunk, "BLOCK_I": chunk}


@functools.cache
def row_launch(
    m: int,
    d: int,
    num_heads: int,
    num_sources: int,
    itemsize: int,
    rows: int,
    warps_per_4096: int,
    joint: bool = True,
    known: int | None = None,
    has_x: bool | None = None,
    sites: int | None = None,
    prefetch: bool | None = None,
) -> tuple:
    """(grid, num_warps, constexprs) of a row kernel over itemsize-byte elements; cached per
    shape, since computing it costs more Python time per call than launching the kernel.
    `known`: bit i set if source i's rstd is given (RSTDS[i]); `has_x`, for the forward: whether
    the output adds x; `sites`: 1, or 2 for two sites over the same sources; `prefetch`: a row's
    first loads issued while the row before finishes."""
    k = d // num_heads
    exact = m % rows == 0 and pow2(num_heads) == num_heads and pow2(k) == k
    consts = {
        "D": d,
        "H": num_heads,
        "K": k,
        "NUM_SRC": num_sources,
        "BLOCK_H": pow2(num_heads),
        **_head_chunks(k, itemsize),
        "BLOCK_N": pow2(num_sources + 1),
        "ROWS": rows,
        "EVEN": exact,
        "JOINT": joint,
        **({} if known is None else {"KNOWN": known}),
        **({} if has_x is None else {"HAS_X": has_x}),
        **({} if sites is None else {"SITES": sites}),
        **({} if prefetch is None else {"PREFETCH": prefetch}),
    }
    warps = max(1, min(16, pow2(cdiv(d * warps_per_4096, 4096))))
    return (cdiv(m, rows),), warps, consts


@functools.cache
def sites_launch(
    m: int,
    d: int,
    num_heads: int,
    num_sources: int,
    itemsize: int,
    rows: int,
    warps_per_4096: int,
    joint: bool,
    sites: int,
) -> tuple:
    """(grid, num_warps, constexprs) of the block kernel (route_fwd_sites_kernel), in its signature's order."""
    grid, warps, consts = row_launch(m, d, num_heads, num_sources, itemsize, rows, warps_per_4096, joint)
    order = ("D", "H", "K", "NUM_SRC", "SITES", "BLOCK_H", "BLOCK_S", "BLOCK_I", "BLOCK_N", "ROWS", "EVEN", "JOINT")
    return grid, warps, {name: sites if name == "SITES" else consts[name] for name in order}


@functools.cache
def fwd_launch(
    m: int,
    d: int,
    num_heads: int,
    num_sources: int,
    itemsize: int,
    rows: int,
    warps_per_4096: int,
    joint: bool,
    known: int,
    has_x: bool,
    sites: int,
    prefetch: bool,
    groups: int,
) -> tuple:
    """(grid, num_warps, constexprs) of the forward over `groups` groups of `sites` sites (a program per row block
    and group)."""
    grid, warps, consts = row_launch(
        m, d, num_heads, num_sources, itemsize, rows, warps_per_4096, joint, known, has_x, sites, prefetch
    )
    return (grid[0] * groups,), warps, {**consts, "GROUPS": groups}


@functools.cache
def stats_launch(
    m: int,
    d: int,
    num_heads: int,
    num_sources: int,
    itemsize: int,
    rows: int,
    warps_per_4096: int,
    joint: bool,
    known: int,
    sites: int,
    prefetch: bool,
    groups: int,
) -> tuple:
    """(grid, num_warps, constexprs) of the stats kernel over `groups` groups of `sites` sites (a program per
    row block and group)."""
    grid, warps, consts = row_launch(
        m, d, num_heads, num_sources, itemsize, rows, warps_per_4096, joint, known, None, sites, prefetch
    )
    return (grid[0] * groups,), warps, {**consts, "GROUPS": groups}


@functools.cache
def mix_launch(
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
    """(grid, constexprs) of the mix kernel."""
    k = d // num_heads
    block_kc = min(block_kc, pow2(k))
    consts = {
        "D": d,
        "H": num_heads,
        "K": k,
        "NUM_SRC": num_sources,
        "NUM_CALLS": num_calls,
        "BLOCK_H": pow2(num_heads),
        "BLOCK_M": block_m,
        "BLOCK_KC": block_kc,
        "EVEN": m % block_m == 0 and k % block_kc == 0,
        "ACCUM": accum,
        "SHARED": shared,
    }
    return (cdiv(m, block_m), num_heads * cdiv(k, block_kc)), consts


@functools.cache
def norm_launch(m: int, d: int, block_m: int, block_d: int) -> tuple:
    """(grid, constexprs) of the norm-term kernel."""
    block_d = min(block_d, pow2(d))
    consts = {"D": d, "BLOCK_M": block_m, "BLOCK_D": block_d, "EVEN": m % block_m == 0 and d % block_d == 0}
    return (cdiv(m, block_m), cdiv(d, block_d)), consts


@functools.cache
def finish_launch(d: int, num_heads: int, itemsize: int, parts: int, block_c: int, block_p: int, warps: int) -> tuple:
    """(grid, num_warps, constexprs) of the finishing kernel over `parts` partials."""
    k = d // num_heads
    consts = {
        "P": parts,
        "D": d,
        "H": num_heads,
        "K": k,
        "BLOCK_H": pow2(num_heads),
        **_head_chunks(k, itemsize),
        "BLOCK_P": min(block_p, pow2(parts)),
        "BLOCK_C": block_c,
    }
    return (cdiv(d, block_c),), warps, consts


@functools.cache
def rstd_launch(m: int, d: int, block_r: int, block_c: int) -> tuple:
    """(grid, constexprs) of the source-rstd kernel."""
    return (cdiv(m, block_r),), {"D": d, "BLOCK_R": block_r, "BLOCK_C": min(pow2(d), block_c)}
