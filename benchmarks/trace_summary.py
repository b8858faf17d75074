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
    ("routing", re.compile(r"(^|_)route_(fwd|bwd)|source_rstd")),
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
    intervals = []
    for e in events:
        if e.get("ph") != "X" or e.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        ms = e.get("dur", 0.0) / 1e3
        kind = kind_of(e["name"]) if e["cat"] == "kernel" else "copies/memset"
        by_kind[kind] += ms
        by_name[e["name"][:80]] += ms
        intervals.append((e["ts"], e["ts"] + e.get("dur", 0.0)))
    span = (max(b for _, b in intervals) - min(a for a, _ in intervals)) / 1e3 if intervals else 0.0
    return {
        "gpu_ms": sum(by_kind.values()),
        "span_ms": span,
        "idle": idle_gaps(intervals),
        "by_kind": dict(by_kind),
        "top": by_name.most_common(12),
    }


def idle_gaps(intervals: list[tuple[float, float]], at_least_ms: float = 0.1) -> dict[str, float]:
    """Time in the span when no kernel or copy ran (any stream): in all, and in gaps of at least
    `at_least_ms` (a host that did not keep the GPU fed: syncs, Python between steps), in ms."""
    total = long = 0.0
    end = None
    for a, b in sorted(intervals):
        if end is not None and a > end:
            gap = (a - end) / 1e3
            total += gap
            long += gap if gap >= at_least_ms else 0.0
        end = b if end is None else max(end, b)
    return {"idle": total, f"idle in gaps >= {at_least_ms} ms": long}


def print_side_by_side(summaries: dict[str, dict[str, object]]) -> None:
    arms = list(summaries)
    kinds = sorted(
        {k for s in summaries.values() for k in s["by_kind"]}, key=lambda k: -summaries[arms[-1]]["by_kind"].get(k, 0)
    )
    print("| GPU ms per profiled step | " + " | ".join(arms) + (" | difference |" if len(arms) == 2 else " |"))
    print("|---|" + "---|" * (len(arms) + (len(arms) == 2)))
    idle = list(next(iter(summaries.values()))["idle"])
    for kind in [*kinds, "all kernels", "step span", *idle]:
        if kind == "all kernels":
            vals = [s["gpu_ms"] for s in summaries.values()]
        elif kind == "step span":
            vals = [s["span_ms"] for s in summaries.values()]
        elif kind in idle:
            vals = [s["idle"][kind] for s in summaries.values()]
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
    parser.add_argument("traces", nargs="+", help="profiler chrome traces (JSON), summarised side by side")
    args = parser.parse_args(argv)
    print_side_by_side({Path(t).parent.name or t: summarise(t) for t in args.traces})


if __name__ == "__main__":
    main()
