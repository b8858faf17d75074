"""GPU time of one profiled training step, by kind of kernel, from a torch profiler chrome trace.

`make bench-step` with `--profile` writes one trace per arm (torchtitan's profiler) and prints
these summaries side by side, so the MHAR arm's extra time can be read by kind: routing kernels,
matmuls, attention, compiled elementwise/reduction kernels, eager elementwise, collectives, copies.

    python -m benchmarks.trace_summary TRACE.json [TRACE.json ...]
"""

from __future__ import annotations

import argparse
import json
import re
from collections import Counter
from pathlib import Path

# first match wins; names are CUDA kernel names as the profiler records them
KINDS = [
    ("routing", re.compile(r"_route_")),
    ("matmul", re.compile(r"gemm|nvjet|cutlass|xmma|sm90_|cublas", re.I)),
    ("attention", re.compile(r"flash|fmha|attention|cudnn", re.I)),
    ("nccl", re.compile(r"nccl", re.I)),
    ("compiled (triton)", re.compile(r"^triton_")),
    ("optimizer, EMA", re.compile(r"multi_tensor_apply|fused_adam|foreach|lerp", re.I)),
    ("eager elementwise/reduce", re.compile(r"at::native|elementwise|reduce_kernel", re.I)),
]


def kind_of(name: str) -> str:
    for kind, pattern in KINDS:
        if pattern.search(name):
            return kind
    return "other"


def summarise(trace_path: str | Path) -> dict[str, object]:
    """Milliseconds of GPU time per kind, the top kernels, and the profiled span."""
    events = json.loads(Path(trace_path).read_text())["traceEvents"]
    by_kind: Counter[str] = Counter()
    by_name: Counter[str] = Counter()
    first, last = float("inf"), 0.0
    for e in events:
        if e.get("ph") != "X" or e.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        ms = e.get("dur", 0.0) / 1e3
        kind = kind_of(e["name"]) if e["cat"] == "kernel" else "copies/memset"
        by_kind[kind] += ms
        by_name[e["name"][:80]] += ms
        first, last = min(first, e["ts"]), max(last, e["ts"] + e.get("dur", 0.0))
    span = (last - first) / 1e3 if last else 0.0
    return {"gpu_ms": sum(by_kind.values()), "span_ms": span, "by_kind": dict(by_kind), "top": by_name.most_common(12)}


def print_side_by_side(summaries: dict[str, dict[str, object]]) -> None:
    arms = list(summaries)
    kinds = sorted(
        {k for s in summaries.values() for k in s["by_kind"]}, key=lambda k: -summaries[arms[-1]]["by_kind"].get(k, 0)
    )
    print("| GPU ms per profiled step | " + " | ".join(arms) + (" | difference |" if len(arms) == 2 else " |"))
    print("|---|" + "---|" * (len(arms) + (len(arms) == 2)))
    for kind in [*kinds, "all kernels", "step span"]:
        if kind == "all kernels":
            vals = [s["gpu_ms"] for s in summaries.values()]
        elif kind == "step span":
            vals = [s["span_ms"] for s in summaries.values()]
        else:
            vals = [s["by_kind"].get(kind, 0.0) for s in summaries.values()]
        diff = f" | {vals[1] - vals[0]:+.1f}" if len(vals) == 2 else ""
        print(f"| {kind} | " + " | ".join(f"{v:.1f}" for v in vals) + diff + " |")
    for arm, s in summaries.items():
        print(f"\ntop kernels, {arm}:")
        for name, ms in s["top"]:
            print(f"  {ms:8.2f} ms  {name}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("traces", nargs="+")
    args = parser.parse_args(argv)
    print_side_by_side({Path(t).parent.name or t: summarise(t) for t in args.traces})


if __name__ == "__main__":
    main()
