"""GPU time of one profiled training step, by kind of kernel, from a torch profiler chrome trace.

`make bench-step` with `--profile` writes one trace per arm (torchtitan's profiler) and prints
these summaries side by side, so the MHAR arm's extra time can be read by kind: routing kernels,
matmuls, attention, compiled elementwise/reduction kernels, eager elementwise, collectives, copies.

    python -m benchmarks.trace_summary [--gaps N] TRACE.json[.gz] [TRACE.json[.gz] ...]
"""

from __future__ import annotations

import argparse
import gzip
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


def load_events(trace_path: str | Path) -> list[dict]:
    """A chrome trace's events (plain or gzipped JSON); a file that is not one is refused by name."""
    path = Path(trace_path)
    try:
        raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
        events = json.loads(raw)["traceEvents"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a profiler chrome trace ({type(e).__name__}: {e})") from e
    if not isinstance(events, list):
        raise ValueError(f"{path}: not a profiler chrome trace (traceEvents is not a list)")
    return events


def summarise(trace_path: str | Path) -> dict[str, object]:
    """Milliseconds of GPU time per kind, the top kernels, and the profiled span."""
    events = load_events(trace_path)
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
        "by_name": dict(by_name),
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


SYNC = re.compile(r"Synchronize|cudaMemcpy(?!Async)|cudaFree|cudaMalloc|cuMemcpyDtoH", re.I)


def gap_report(trace_path: str | Path, top: int = 15, at_least_ms: float = 0.1) -> list[dict[str, object]]:
    """The `top` longest GPU idle gaps (no kernel or copy on any stream) of at least `at_least_ms`,
    each with the kernels either side, the CPU op that launched the next one (by its External id)
    and the host calls that block (synchronisations, allocations) overlapping the gap: where the
    host did not keep the GPU fed."""
    events = load_events(trace_path)
    gpu = sorted(
        (e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
        key=lambda e: e["ts"],
    )
    ops = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation"):
            ext = (e.get("args") or {}).get("External id")
            if ext is not None and (ext not in ops or e.get("dur", 0) < ops[ext].get("dur", 0)):
                ops[ext] = e  # the innermost op of that id
    blocking = [e for e in events if e.get("ph") == "X" and e.get("cat") == "cuda_runtime" and SYNC.search(e["name"])]
    if not gpu:
        return []
    start = gpu[0]["ts"]
    gaps, end, before = [], None, None
    for e in gpu:
        if end is not None and e["ts"] - end >= at_least_ms * 1e3:
            gaps.append((e["ts"] - end, end, before, e))
        if end is None or e["ts"] + e.get("dur", 0.0) > end:
            end, before = e["ts"] + e.get("dur", 0.0), e
    report = []
    for length, at, prev, nxt in sorted(gaps, key=lambda g: -g[0])[:top]:
        op = ops.get((nxt.get("args") or {}).get("External id"))
        host = [b for b in blocking if b["ts"] < at + length and b["ts"] + b.get("dur", 0) > at]
        report.append(
            {
                "ms": length / 1e3,
                "at_ms": (at - start) / 1e3,
                "after": prev["name"][:60],
                "before": nxt["name"][:60],
                "launched_by": op["name"][:60] if op else "?",
                "host_blocking": ", ".join(f"{b['name']} {b.get('dur', 0) / 1e3:.2f} ms" for b in host[:3]),
            }
        )
    return report


def print_gaps(arm: str, report: list[dict[str, object]]) -> None:
    print(f"\nlongest idle gaps, {arm}: ms, at (ms), kernel -> next kernel [its CPU op], blocking host calls")
    for g in report:
        where = f"{g['after']} -> {g['before']} [{g['launched_by']}]"
        print(f"  {g['ms']:6.2f} at {g['at_ms']:7.1f}: {where} {g['host_blocking']}")


def print_name_diff(summaries: dict[str, dict[str, object]], top: int = 15) -> None:
    """Kernels whose GPU time differs most between two arms (same names: the same code)."""
    (a, sa), (b, sb) = summaries.items()
    names = set(sa["by_name"]) | set(sb["by_name"])
    diff = sorted(names, key=lambda n: -abs(sb["by_name"].get(n, 0.0) - sa["by_name"].get(n, 0.0)))[:top]
    print(f"\nkernels differing most, {b} minus {a} (ms)")
    for n in diff:
        va, vb = sa["by_name"].get(n, 0.0), sb["by_name"].get(n, 0.0)
        print(f"  {vb - va:+8.2f}  ({va:7.2f} -> {vb:7.2f})  {n}")


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


def label(trace_path: str | Path) -> str:
    """A trace's arm: the folder holding torchtitan's profile_traces/, else the trace's folder."""
    parts = Path(trace_path).parts
    return parts[parts.index("profile_traces") - 1] if "profile_traces" in parts[1:] else Path(trace_path).parent.name


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("traces", nargs="+", help="profiler chrome traces (JSON), summarised side by side")
    parser.add_argument("--gaps", type=int, default=0, help="also list each trace's N longest idle gaps")
    args = parser.parse_args(argv)
    labels = [label(t) for t in args.traces]
    if len(set(labels)) < len(labels):  # two traces of one folder: their paths tell them apart
        labels = list(args.traces)
    try:
        summaries = {name: summarise(t) for name, t in zip(labels, args.traces, strict=True)}
        gaps = [(name, gap_report(t, args.gaps)) for name, t in zip(labels, args.traces, strict=True) if args.gaps]
    except ValueError as e:
        parser.error(str(e))
    print_side_by_side(summaries)
    if len(summaries) == 2:
        print_name_diff(summaries)
    for name, report in gaps:
        print_gaps(name, report)


if __name__ == "__main__":
    main()
