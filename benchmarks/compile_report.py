"""Registers, spills and shared memory of the routing kernels for sm_90, without a GPU.

Compiles each kernel at the 8B launch shapes with Triton's own compiler and runs the
`ptxas` that Triton ships on the result. Registers decide how many rows an SM keeps in
flight, which is what bounds these memory-bound kernels. `--sass` also counts the row kernels'
machine instructions by opcode (Triton's `cuobjdump` on the cubin, at the tables' launch shapes):
in the training step the GPU runs at its power cap and these kernels slow with its clock, so
the instructions a row costs are what a change has to cut (docs/history/kernels-notebook.md).

    python -m benchmarks.compile_report [--sources 8] [--dtype bf16] [--sass]
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kernels.triton.backward import route_bwd_mix_kernel, route_bwd_stats_kernel
from kernels.triton.forward import route_fwd_kernel, route_fwd_sites_kernel
from kernels.triton.launch import DEFAULT_TABLES, MAX_SOURCES, fwd_launch, mix_launch, sites_launch, stats_launch
from mhar_titan.model.sources import SourceLayout

GEOMETRY_8B = SourceLayout(num_blocks=8, n_layers=32)  # docs/design.md section 2.7
BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
PTXAS = os.path.join(BIN, "ptxas")


def compile_sm90(fn, types: dict[str, object], consts: dict[str, object], num_warps: int, maxnreg: int | None = None):
    """Triton-compile `fn` for sm_90 with every pointer and M assumed 16-aligned (as at 8B)."""
    signature, constexprs, attrs = {}, {}, {}
    for i, name in enumerate(p.name for p in fn.params):
        if name in consts:
            signature[name], constexprs[(i,)] = "constexpr", consts[name]
            continue
        kind = types[name]
        signature[name] = kind
        if isinstance(kind, tuple):
            attrs.update({(i, j): [["tt.divisibility", 16]] for j in range(len(kind))})
        elif kind.startswith("*") or name == "M":
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    options = {"num_warps": num_warps} if maxnreg is None else {"num_warps": num_warps, "maxnreg": maxnreg}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def _run_on_file(data: str | bytes, suffix: str, *command: str) -> subprocess.CompletedProcess:
    """`command` with the path of a temporary file holding `data` appended; fails if it fails."""
    with tempfile.NamedTemporaryFile("wb" if isinstance(data, bytes) else "w", suffix=suffix, delete=False) as f:
        f.write(data)
    try:
        return subprocess.run([*command, f.name], capture_output=True, text=True, check=True)
    finally:
        os.unlink(f.name)


def ptxas_usage(ptx: str) -> dict[str, int]:
    log = _run_on_file(ptx, ".ptx", PTXAS, "-arch=sm_90a", "-v", "-o", os.devnull).stderr
    regs = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores", log)
    return {"registers": int(regs.group(1)), "spill_bytes": int(spills.group(1)) if spills else 0}


def sass_opcodes(cubin: bytes) -> collections.Counter:
    """Static instruction counts by opcode (predicates and modifiers dropped) of a cubin."""
    sass = _run_on_file(cubin, ".cubin", os.path.join(BIN, "cuobjdump"), "-sass").stdout
    found = re.findall(r"^\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", sass, re.M)
    if not found:  # an empty count would print as a kernel of no instructions
        raise RuntimeError(f"cuobjdump -sass listed no instruction:\n{sass[:2000]}")
    return collections.Counter(found)


def block_rows(args, types: dict[str, object], m: int, itemsize: int) -> dict[str, collections.Counter]:
    """The block forward's rows (`args.sites` sites) at 1, 2 and 4 rows a program; its opcodes at its table's shape."""
    n, p, f32 = args.sources, types["X"], "*fp32"
    block = DEFAULT_TABLES.fwd_sites[n]
    block_types = {**types, **{k: (p,) * args.sites for k in ("NULLS", "QS", "GS", "GATES", "OUTS")}}
    block_types["LGS"] = (f32,) * args.sites
    name, opcodes = f"fwd, {args.sites} sites (block)", {}
    for rows in sorted({1, 2, 4, block["rows"]}):
        shape = (m, args.dim, args.heads, n, itemsize, rows, block["warps_per_4096"], True, args.sites)
        _, warps, consts = sites_launch(*shape)
        compiled = compile_sm90(route_fwd_sites_kernel, block_types, consts, warps, block["maxnreg"])
        use = ptxas_usage(compiled.asm["ptx"])
        print(f"| {name} | rows {rows} | {warps} | {use['registers']} | {use['spill_bytes']} |")
        if args.sass and rows == block["rows"]:
            opcodes[f"{name}, rows {rows}"] = sass_opcodes(compiled.asm["cubin"])
    return opcodes


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sources", type=int, default=GEOMETRY_8B.max_caller_sources, help="caller sources (N - 1; the 8B's most)"
    )
    parser.add_argument("--dim", type=int, default=4096, help="model width d")
    parser.add_argument("--heads", type=int, default=8, help="routing heads H")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"], help="the sources' dtype")
    parser.add_argument(
        "--sites", type=int, default=GEOMETRY_8B.sites_per_block, help="sites of the block forward (an 8B block's)"
    )
    parser.add_argument("--sass", action="store_true", help="also count the row kernels' instructions by opcode")
    args = parser.parse_args()
    if not 1 <= args.sources <= MAX_SOURCES:
        parser.error(f"--sources {args.sources}: the kernels take 1 to {MAX_SOURCES} caller sources")
    if args.sites < 1:
        parser.error(f"--sites {args.sites}: a block routes at least one site")
    return args


def main() -> None:
    args = parse_args()
    n, d, h, m = args.sources, args.dim, args.heads, 8192
    p, f32 = f"*{args.dtype}", "*fp32"
    itemsize = 2 if args.dtype == "bf16" else 4
    calls = DEFAULT_TABLES.mix["calls"]
    types = {
        "X": p,
        "SRCS": (p,) * n,
        "DSRCS": (p,) * n,
        "NULL": p,
        "Q": p,
        "G": p,
        "GATE": p,
        "OUT": p,
        "DOUT": p,
        "LG": f32,
        "COEF": f32,
        "PARTS": f32,
        "M": "i32",
        "eps": "fp32",
        "DOUTS": (p,) * calls,
        "COEFS": (f32,) * calls,
        "QS": (p,) * calls,
        "GS": (p,) * calls,
        "CSUMS": (f32,) * n,
        "RSTDS": (f32,) * n,
        "NULL2": p,
        "Q2": p,
        "G2": p,
        "GATE2": p,
        "OUT2": p,
        "LG2": f32,
        "DOUT2": p,
        "COEF2": f32,
        "PARTS2": f32,
    }
    per_group = ("DOUT", "NULL", "Q", "G", "LG", "GATE", "OUT", "COEF", "PARTS")
    grouped_types = {**types, **{name: (types[name],) for base in per_group for name in (base, base + "2")}}
    # the layout Triton picks for the row tiles (and so registers and barriers) changes between versions
    print(f"sm_90, triton {triton.__version__}, d={d}, H={h}, {n} sources, {args.dtype}")
    print("| kernel | launch | warps | registers | spill bytes |")
    print("|---|---|---|---|---|")
    kernels = [
        ("fwd", route_fwd_kernel, DEFAULT_TABLES.fwd[n], 1),
        ("stats", route_bwd_stats_kernel, DEFAULT_TABLES.stats[n], 1),
        ("fwd, 2 sites", route_fwd_kernel, DEFAULT_TABLES.fwd_pair[n], 2),
        ("stats, 2 sites", route_bwd_stats_kernel, DEFAULT_TABLES.stats_pair[n], 2),
    ]
    opcodes = {}
    for name, fn, launch, sites in [k for k in kernels if k[2] is not None]:
        # as the model's eager path launches them: marked sources, their rstd given where the table says;
        # the forward without x (the model adds it in its compiled block)
        known = (1 << n) - 1 if launch["given_rstd"] else 0
        has_x = False if fn is route_fwd_kernel else None
        for warps_per_4096 in sorted({4, 8, 16, launch["warps_per_4096"]}):
            shape = (m, d, h, n, itemsize, launch["rows"], warps_per_4096, True, known)
            # one group of sites a launch (the per-site arguments are tuples, one entry a group)
            if fn is route_fwd_kernel:
                _, warps, consts = fwd_launch(*shape, has_x, sites, launch["prefetch"], 1)
            else:
                _, warps, consts = stats_launch(*shape, sites, launch["prefetch"], 1)
            # the forward's register cap applies to its own launch shape only
            cap = launch.get("maxnreg") if warps_per_4096 == launch["warps_per_4096"] else None
            compiled = compile_sm90(fn, grouped_types, consts, warps, cap)
            use = ptxas_usage(compiled.asm["ptx"])
            shape = f"rows {launch['rows']}" + (f", registers <= {cap}" if cap else "")
            print(f"| {name} | {shape} | {warps} | {use['registers']} | {use['spill_bytes']} |")
            if args.sass and warps_per_4096 == launch["warps_per_4096"]:
                opcodes[f"{name}, {shape}"] = sass_opcodes(compiled.asm["cubin"])
    opcodes.update(block_rows(args, types, m, itemsize))
    shared = (1 << n) - 1  # every source shared, the rest of the sum accumulated: the eager path
    for block_m, block_kc, warps in [(32, 64, 4), (32, 128, 4), (64, 64, 4), (32, 128, 8)]:
        _, consts = mix_launch(m, d, h, n, calls, block_m, block_kc, shared, shared)
        use = ptxas_usage(compile_sm90(route_bwd_mix_kernel, types, consts, warps).asm["ptx"])
        print(f"| mix | {block_m}x{block_kc}, {calls} calls | {warps} | {use['registers']} | {use['spill_bytes']} |")
    if opcodes:  # static counts: the row loop's body once (sources unrolled), the set-up and the stores
        print("\n| kernel, launch | SASS instructions | most frequent opcodes |")
        print("|---|---|---|")
        for kernel, counts in opcodes.items():
            top = ", ".join(f"{op} {k}" for op, k in counts.most_common(10))
            print(f"| {kernel} | {sum(counts.values())} | {top} |")


if __name__ == "__main__":
    main()
