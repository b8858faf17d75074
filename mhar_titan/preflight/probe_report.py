"""The probe's rank files (probe.py) judged as the preflight table's rows a (environment), b (kernels), c (hardware).

Pure: reads DIR/rank-R.json and returns `Stage`s; imports neither torch nor triton, so the driver
can judge a probe that crashed. A missing or unreadable rank file fails every stage, naming the rank.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from packaging.specifiers import SpecifierSet

from mhar_titan.preflight.stages import Stage, failed

# The project's pins, as pyproject.toml's [project] dependencies (tests/test_preflight_probe.py
# checks that they agree): the package does not read the repository's file at run time.
PINS = {"torch": ">=2.11,<2.14", "triton": ">=3.6,<3.8", "torchtitan": "==0.2.2"}
# What the kernels and the pipeline were tested on (docs/install.md, "Training on GPUs"): device, torch,
# triton (any of), and the GPU model's name containing this (None: CPU).
TESTED = (
    ("cuda", "==2.11.0+cu130", ("==3.6.0",), "H200"),
    ("cpu", "==2.13.0", ("==3.6.0", "==3.7.*"), None),
)
# Ranks compared in stage a: each must equal the others.
SAME_ON_EVERY_RANK = ("python", "torch", "torch_cuda", "triton", "torchtitan", "driver", "gpu_name")
OUTLIER_TOLERANCE = 0.10  # stage c on GPUs: a rank more than this far off the median over ranks fails
GIB = 2**30
NAMES = {"a": "environment", "b": "kernels", "c": "hardware"}


def outliers(values: Mapping[int, float], tolerance: float = OUTLIER_TOLERANCE) -> dict[int, float]:
    """Ranks whose value is more than `tolerance` (relative) off the median over ranks, with their
    relative deviation (+0.2: 20% above the median). With two ranks the median is their mean, so
    only a gap of more than twice `tolerance` between them shows."""
    if not values:
        return {}
    median = statistics.median(values.values())
    if median <= 0:
        return {}
    off = {rank: value / median - 1 for rank, value in values.items()}
    return {rank: dev for rank, dev in sorted(off.items()) if abs(dev) > tolerance}


def pin_mismatches(env: Mapping[str, Any]) -> list[str]:
    """Each pinned package whose version is missing or outside its pin, named."""
    out = []
    for package, spec in PINS.items():
        version = env.get(package)
        if version is None:
            out.append(f"{package} not installed (pinned {spec} in pyproject.toml)")
        elif not SpecifierSet(spec).contains(version, prereleases=True):
            out.append(f"{package} {version} outside the pin {spec} (pyproject.toml)")
    return out


def is_tested(env: Mapping[str, Any]) -> bool:
    """Whether torch, triton and the device are a combination the project was tested on."""
    for device, torch_spec, triton_specs, gpu in TESTED:
        if env.get("device") != device or not SpecifierSet(torch_spec).contains(env.get("torch") or "0"):
            continue
        if not any(SpecifierSet(s).contains(env.get("triton") or "0", prereleases=True) for s in triton_specs):
            continue
        if gpu is None or gpu in (env.get("gpu_name") or ""):
            return True
    return False


def load_ranks(probe_dir: Path) -> tuple[dict[int, dict[str, Any]], list[str]]:
    """(The readable rank files by rank, the problems: missing or unreadable files, named by rank).
    The world size is the largest any file records."""
    records: dict[int, dict[str, Any]] = {}
    unreadable: dict[int, str] = {}
    for path in sorted(probe_dir.glob("rank-*.json")) if probe_dir.is_dir() else []:
        suffix = path.stem.removeprefix("rank-")
        if not suffix.isdigit():
            continue
        try:
            records[int(suffix)] = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            unreadable[int(suffix)] = f"rank {suffix}: unreadable {path.name} ({type(e).__name__}: {e})"
    recorded = [int(r.get("world_size", 0)) for r in records.values()]
    world = max([*recorded, *[rank + 1 for rank in (*records, *unreadable)]], default=0)
    if world == 0:
        return records, [f"no rank files (rank-R.json) in {probe_dir}: the probe did not run"]
    problems = []
    for rank in range(world):
        if rank in unreadable:
            problems.append(unreadable[rank])
        elif rank not in records:
            problems.append(f"rank {rank}: no rank-{rank}.json (the rank did not finish)")
    return records, problems


def _ranks(ranks: Iterable[int]) -> str:
    ranks = sorted(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(str(r) for r in ranks)


def _sections(records: dict[int, dict[str, Any]], name: str) -> tuple[dict[int, dict[str, Any]], list[str]]:
    """Each rank's section `name` that holds a result, and the problems of the others."""
    good, problems = {}, []
    for rank, record in sorted(records.items()):
        section = record.get(name)
        if section is None:
            problems.append(f"rank {rank}: no {name} result ({record.get('error', 'the rank stopped before it')})")
        elif "error" in section:
            problems.append(f"rank {rank}: {section['error']}")
        else:
            good[rank] = section
    return good, problems


def _figure(problems: list[str]) -> str:
    more = f" (and {len(problems) - 2} more: see the report)" if len(problems) > 2 else ""
    return "; ".join(problems[:2]) + more


def _row(*cells: Any) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def _header(*cells: str) -> list[str]:
    return [_row(*cells), _row(*["---"] * len(cells))]


def _fail(key: str, problems: list[str], nothing: str, seconds: float, details: list[str]) -> Stage:
    """A FAIL row: its problems are the figure (the first two) and the details' end (all)."""
    details = [*details, "", *[f"- {p}" for p in problems]]
    return Stage(key, NAMES[key], False, _figure(problems or [nothing]), seconds, details)


def _gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB"


def environment_stage(records: dict[int, dict[str, Any]], problems: list[str], seconds: float) -> Stage:
    """Stage a: versions inside the pins and the same on every rank; the combination named when untested."""
    envs, more = _sections(records, "environment")
    problems = problems + more
    for mismatch in sorted({m for env in envs.values() for m in pin_mismatches(env)}):
        ranks = [r for r, env in envs.items() if mismatch in pin_mismatches(env)]
        problems.append(f"{mismatch} on {_ranks(ranks)}")
    for key in SAME_ON_EVERY_RANK:
        by_value: dict[str, list[int]] = {}
        for rank, env in envs.items():
            by_value.setdefault(str(env.get(key)), []).append(rank)
        if len(by_value) > 1:
            seen = ", ".join(f"{value} on {_ranks(ranks)}" for value, ranks in by_value.items())
            problems.append(f"ranks differ in {key}: {seen}")
    columns = ("rank", "host", "local rank", "python", "torch", "CUDA", "triton", "torchtitan", "driver", "device")
    details = _header(*columns, "memory free / total")
    for rank, env in envs.items():
        device = env.get("gpu_name") or f"CPU {env.get('cpu_name', '')}".strip()
        memory = f"{_gib(env['memory_free_bytes'])} / {_gib(env['memory_total_bytes'])} ({env['memory_kind']})"
        details.append(
            _row(
                rank,
                env["hostname"],
                env["local_rank"],
                env["python"],
                env["torch"],
                env.get("torch_cuda"),
                env["triton"],
                env["torchtitan"],
                env.get("driver"),
                device,
                memory,
            )
        )
    if problems or not envs:
        return _fail("a", problems, "no rank recorded its environment", seconds, details)
    env = envs[min(envs)]
    parts = [f"torch {env['torch']}", f"triton {env['triton']}"]
    if env.get("torch_cuda"):
        parts.append(f"CUDA {env['torch_cuda']}")
    if env.get("driver"):
        parts.append(f"driver {env['driver']}")
    free = min(e["memory_free_bytes"] for e in envs.values())
    if env["device"] == "cuda":
        parts += [f"{len(envs)}x {env['gpu_name']}", f"{_gib(free)} free (min over ranks)"]
    else:
        ranks = f"{len(envs)} CPU rank{'s' if len(envs) > 1 else ''}"
        parts += [ranks, f"{_gib(free)} host memory available (min over ranks)"]
    figure = ", ".join(parts)
    if not is_tested(env):
        figure += "; untested combination: stage b checks the kernels on it"
        details += ["", f"Untested combination (tested: {_tested_text()}): stage b checks the kernels on it."]
    return Stage("a", NAMES["a"], True, figure, seconds, details)


def _tested_text() -> str:
    return "; ".join(
        f"torch {t.lstrip('=')} with triton {' or '.join(s.lstrip('=') for s in tr)} on {gpu or 'CPU'}"
        for _, t, tr, gpu in TESTED
    )


@dataclass
class _KernelTally:
    """Stage b's findings over every rank's source counts: the problems, each count's worst error per
    tensor over ranks (error, bound, error / bound, dtype, rank), the ranks where it was bitwise
    repeatable, its slowest time, and the worst error / bound of all."""

    problems: list[str]
    worst: tuple[float, str] = (-1.0, "")
    tables: dict[int, dict[str, tuple[float, float, float, str, int]]] = field(default_factory=dict)
    repeatable: dict[int, list[int]] = field(default_factory=dict)
    count_seconds: dict[int, float] = field(default_factory=dict)

    def add(self, rank: int, count: dict[str, Any]) -> None:
        n = count["sources"]
        if "error" in count:
            self.problems.append(f"rank {rank}, {n} sources: {count['error']}")
            return
        self.count_seconds[n] = max(self.count_seconds.get(n, 0.0), count["seconds"])
        if not count["bitwise"]:
            self.problems.append(f"rank {rank}, {n} sources: two runs differ in {', '.join(count['differ'])}")
        else:
            self.repeatable.setdefault(n, []).append(rank)
        for name, c in count["checks"].items():
            self._add_check(rank, n, name, c)

    def _add_check(self, rank: int, n: int, name: str, c: dict[str, Any]) -> None:
        ratio = c["ratio"] if c["ratio"] == c["ratio"] else float("inf")  # NaN: as bad as it gets
        if ratio > 1.0:
            what = f"{name} error {c['error']:.3g} is {ratio:.2f}x its bound {c['bound']:.3g}"
            self.problems.append(f"rank {rank}, {n} sources: {what}")
        row = self.tables.setdefault(n, {}).get(name)
        if row is None or ratio > row[2]:
            self.tables[n][name] = (c["error"], c["bound"], ratio, c["dtype"], rank)
        if ratio > self.worst[0]:
            self.worst = (ratio, f"{name}, {n} sources")

    def table_lines(self) -> list[str]:
        """One table per source count: each tensor's worst error against its bound."""
        details: list[str] = []
        for n in sorted(self.tables):
            ranks = self.repeatable.get(n)
            details += [
                "",
                f"{n} sources (null included), worst over ranks; bitwise repeatable on "
                f"{_ranks(ranks) if ranks else 'no rank'}; {self.count_seconds.get(n, 0):.1f} s",
                "",
                *_header("tensor", "dtype", "max abs error", "bound", "error / bound", "rank"),
            ]
            for name, (err, limit, ratio, dtype, rank) in self.tables[n].items():
                details.append(
                    _row(name, dtype.removeprefix("torch."), f"{err:.3g}", f"{limit:.3g}", f"{ratio:.3f}", rank)
                )
        return details


def _kernel_setup_lines(first: dict[str, Any]) -> list[str]:
    """What the kernel check ran (from the lowest rank's record) and how to read its tables."""
    details = [
        f"{first['op']} against the {first['reference']}; width {first['dim']}, {first['num_heads']} heads, "
        f"batch {first['batch']} x {first['tokens']} tokens, seed {first['seed']}. Bounds: bf16 rounding of the "
        "result plus the fp32 error on the problem's conditioning scale (mhar_titan/preflight/kernel_check.py); "
        "rounding alone can take a bf16 result to nearly 1.0 of its bound, more than 1.0 is an error.",
        "Tensors: out_a/b and logits_a/b, the two sites' forward; sourceI, the gradient of the I-th source after "
        "the null (source0: the embedding's place); null, query, norm_weight and gate _a/b, each site's parameter "
        "gradients.",
    ]
    if first.get("perturb") is not None:
        details.append(f"Test seam on: outputs perturbed by {first['perturb']} x max|output|.")
    return details


def _attention_lines(records: dict[int, dict[str, Any]]) -> list[str]:
    """The attention backward's repeatability by default and under deterministic algorithms, with the latter's
    cost: for the user, not judged (stage d measures its own job's spread instead)."""
    attention = {r: rec["attention"] for r, rec in records.items() if "bitwise" in (rec.get("attention") or {})}
    if not attention:
        return []
    a = attention[min(attention)]
    same = [r for r, x in attention.items() if x["bitwise"]]
    worst_dq = max(x["max_dq_diff"] for x in attention.values())
    differing = sum(x["runs_differing"] for x in attention.values())
    runs = sum(x["runs"] for x in attention.values())
    lines = [
        "",
        f"Not judged: the model's attention (torch's scaled_dot_product_attention, causal, "
        f"{'x'.join(map(str, a['shape']))} {a['dtype']}), forward and backward {a['runs'] + 1} times on the same "
        "inputs: "
        + (
            "repeatable bit for bit on every rank."
            if len(same) == len(attention)
            else f"{differing} of {runs} repeats differ from the first (largest |dq| difference {worst_dq:.3g}, max "
            f"|dq| {a['dq_scale']:.3g}; ranks {_ranks(r for r in attention if r not in same)}): its kernels "
            "accumulate in a varying order, so two runs of the training step are rarely bitwise equal here. "
            "Stage d judges the resume against its own job run twice, not against this reading."
        ),
    ]
    det = a.get("deterministic") or {}
    if "error" in det:
        lines.append(f"Under torch's deterministic algorithms (`--debug.deterministic`): refused, {det['error']}")
    elif det:
        lines.append(
            "Under torch's deterministic algorithms (`--debug.deterministic`): "
            + ("bitwise" if det["bitwise"] else f"still not bitwise ({det['runs_differing']} of {det['runs']} differ)")
            + f", {det['median_ms']:.3g} ms a forward and backward against {a['median_ms']:.3g} ms by default "
            f"({det['median_ms'] / a['median_ms']:.2f}x) on rank {min(attention)}."
        )
    return lines


def kernel_stage(records: dict[int, dict[str, Any]], problems: list[str], seconds: float) -> Stage:
    """Stage b: every source count on every rank within its bounds and bitwise repeatable."""
    kernels, more = _sections(records, "kernels")
    tally = _KernelTally(problems + more)
    for rank, result in kernels.items():
        for count in result["counts"]:
            tally.add(rank, count)
    details = _kernel_setup_lines(kernels[min(kernels)]) if kernels else []
    details += tally.table_lines()
    details += _attention_lines(records)
    if tally.problems or not kernels:
        return _fail("b", tally.problems, "no rank checked the kernels", seconds, details)
    first = kernels[min(kernels)]
    counts = sorted(tally.tables)
    span = f"{counts[0]}-{counts[-1]}" if len(counts) > 1 else str(counts[0])
    worst = tally.worst
    figure = (
        f"{span} sources (null included), {first.get('sites', 2)} sites a call, at width {first['dim']}, "
        f"{first['num_heads']} heads, {first['tokens']} tokens: worst error {worst[0]:.2f} of its bound ({worst[1]}), "
        "bitwise repeatable"
    )
    return Stage("b", NAMES["b"], True, figure, seconds, details)


def _median(values: Iterable[float]) -> float | None:
    values = list(values)
    return statistics.median(values) if values else None


def hardware_stage(records: dict[int, dict[str, Any]], problems: list[str], seconds: float) -> Stage:
    """Stage c: medians over ranks; on GPUs a rank more than 10% off the median in GEMM or collective time fails."""
    results, more = _sections(records, "hardware")
    problems = problems + more
    collectives = {"all_gather": "all-gather", "reduce_scatter": "reduce-scatter"}
    on_gpu = bool(results) and all(r["device"] == "cuda" for r in results.values())
    timings = {"GEMM": {rank: r["gemm"]["seconds"] for rank, r in results.items()}}
    for key, label in collectives.items():
        timings[label] = {rank: r[key]["seconds"] for rank, r in results.items() if r[key].get("supported")}
    if on_gpu:
        for label, values in timings.items():
            for rank, dev in outliers(values).items():
                way = "slower" if dev > 0 else "faster"
                problems.append(f"rank {rank}: {label} {abs(dev):.0%} {way} than the median over ranks")
    details = _header(
        "rank",
        "GEMM ms",
        "TFLOP/s",
        *[f"{label} {unit}" for label in collectives.values() for unit in ("ms", "algbw GB/s", "busbw GB/s")],
    )
    for rank, r in results.items():
        cells = [f"{r['gemm']['seconds'] * 1e3:.3g}", f"{r['gemm']['tflops']:.3g}"]
        for key in collectives:
            c = r[key]
            cells += (
                [f"{c['seconds'] * 1e3:.3g}", f"{c['algbw_gbps']:.3g}", f"{c['busbw_gbps']:.3g}"]
                if c.get("supported")
                else ["unsupported", "-", "-"]
            )
        details.append(_row(rank, *cells))
    if problems or not results:
        return _fail("c", problems, "no rank measured the hardware", seconds, details)
    first = results[min(results)]
    gemm = first["gemm"]
    shape = "x".join(str(n) for n in gemm["shape"])
    parts = [f"GEMM {_median(r['gemm']['tflops'] for r in results.values()):.3g} TFLOP/s ({shape} {gemm['dtype']})"]
    for key, label in collectives.items():
        bus = _median(r[key]["busbw_gbps"] for r in results.values() if r[key].get("supported"))
        parts.append(f"{label} busbw {bus:.3g} GB/s" if bus is not None else f"{label}: {first[key]['error']}")
    figure = ", ".join(parts) + " (medians over ranks)"
    if first["world_size"] == 1:
        figure += "; world size 1: collectives trivially timed"
    if not on_gpu:
        figure += "; CPU ranks: timed, not judged"
        details += ["", "CPU ranks share the host's cores: their times are reported, not compared."]
    else:
        details += ["", f"Every rank's GEMM and collective times within {OUTLIER_TOLERANCE:.0%} of their median."]
    return Stage("c", NAMES["c"], True, figure, seconds, details)


def gpu_memory_bytes(probe_dir: Path) -> float | None:
    """The memory per GPU to plan with: the least free memory any rank's GPU reported at the probe's
    start (other processes' and the rank's own CUDA context already out); None without GPU ranks."""
    records, _ = load_ranks(Path(probe_dir))
    envs = [r.get("environment") or {} for r in records.values()]
    free = [e["memory_free_bytes"] for e in envs if e.get("device") == "cuda" and "memory_free_bytes" in e]
    return float(min(free)) if free else None


def probe_stages(probe_dir: Path, seconds: float) -> list[Stage]:
    """The table's rows a, b, c from the probe's rank files; `seconds`: the probe's wall time, of
    which b and c get their slowest rank's time and a the rest (start-up included)."""
    records, problems = load_ranks(Path(probe_dir))
    if not records:
        return [failed(key, name, _figure(problems), seconds if key == "a" else 0.0) for key, name in NAMES.items()]

    def slowest(name: str) -> float:
        return max((float(r.get(name, {}).get("seconds", 0.0)) for r in records.values()), default=0.0)

    b, c = slowest("kernels"), slowest("hardware")
    return [
        environment_stage(records, problems, max(0.0, seconds - b - c)),
        kernel_stage(records, problems, b),
        hardware_stage(records, problems, c),
    ]
