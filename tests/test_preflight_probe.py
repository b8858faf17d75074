"""The preflight's probe (stages a-c) on 2 CPU ranks over gloo, the kernels in Triton's interpreter, and its judging.

One probe run, shared by the tests; the rest judges its rank files, real or edited. The kernel test seam
(MHAR_PREFLIGHT_PERTURB_KERNEL) failing stage b alone is tests/test_preflight.py's, through the whole CLI.
"""

import copy
import json
import os
import shutil
import subprocess
import sys
import tomllib

import pytest
from conftest import REPO
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from mhar_titan.preflight.probe import _section
from mhar_titan.preflight.probe_report import (
    PINS,
    gpu_memory_bytes,
    hardware_stage,
    load_ranks,
    outliers,
    probe_stages,
)

GEOMETRY = ["--dim", "256", "--num-heads", "8", "--tokens", "32", "--sites", "4"]  # a block of 2 layers


def _launch(out, max_sources):
    cmd = [
        *(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1", "--nproc-per-node", "2"),
        *("-m", "mhar_titan.preflight.probe", "--out", str(out)),
        *GEOMETRY,
        *("--max-sources", str(max_sources)),
    ]
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    env.pop("MHAR_PREFLIGHT_PERTURB_KERNEL", None)
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.fixture(scope="module")
def probes(tmp_path_factory):
    """{"plain": dir} of a finished 2-rank probe."""
    root = tmp_path_factory.mktemp("probe")
    proc = _launch(root / "plain", 3)
    log, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, f"plain probe exited {proc.returncode}\n{log[-6000:]}"
    return {"plain": root / "plain"}


def _by_key(stages):
    assert [s.key for s in stages] == ["a", "b", "c"]
    return {s.key: s for s in stages}


def test_a_plain_probe_passes_every_stage_with_its_fields(probes):
    stages = _by_key(probe_stages(probes["plain"], 1000.0))
    assert all(s.ok for s in stages.values()), [(s.key, s.figure) for s in stages.values()]
    assert stages["a"].figure.startswith("torch 2.13") and "2 CPU ranks" in stages["a"].figure
    assert "host memory available (min over ranks)" in stages["a"].figure
    assert stages["b"].figure.startswith(
        "2-3 sources (null included), 4 sites a call, at width 256, 8 heads, 32 tokens: worst error"
    )
    assert stages["b"].figure.endswith("bitwise repeatable")
    assert "TFLOP/s" in stages["c"].figure and "all-gather busbw" in stages["c"].figure
    assert "reduce-scatter busbw" in stages["c"].figure and "CPU ranks: timed, not judged" in stages["c"].figure
    assert sum(s.seconds for s in stages.values()) == pytest.approx(1000.0)  # a: the rest of the wall time
    assert sum(line.startswith("| source1 |") for line in stages["b"].details) == 1  # a table per count
    for rank in (0, 1):
        record = json.loads((probes["plain"] / f"rank-{rank}.json").read_text())
        assert "error" not in record and record["rank"] == rank and record["world_size"] == 2
        env = record["environment"]
        for key in (
            "python",
            "torch",
            "torch_cuda",
            "triton",
            "torchtitan",
            "driver",
            "gpu_name",
            "hostname",
            "local_rank",
            "memory_total_bytes",
            "memory_free_bytes",
        ):
            assert key in env, key
        assert env["device"] == "cpu" and env["driver"] is None and env["memory_free_bytes"] > 0
        kernels = record["kernels"]
        assert [c["sources"] for c in kernels["counts"]] == [2, 3] and kernels["ok"] and kernels["perturb"] is None
        for count in kernels["counts"]:
            assert count["bitwise"] and count["seconds"] > 0
            sources = [f"source{i}" for i in range(count["sources"] - 1)]
            params = [f"{p}_{s}" for s in "abcd" for p in ("null", "query", "norm_weight", "gate")]
            outs = [f"{kind}_{s}" for kind in ("out", "logits") for s in "abcd"]
            assert set(count["checks"]) == {*outs, *sources, *params}
            assert all(0 <= c["ratio"] <= 1 for c in count["checks"].values())
        hardware = record["hardware"]
        assert hardware["gemm"]["tflops"] > 0 and hardware["gemm"]["shape"] == [32, 256, 896]
        for name in ("all_gather", "reduce_scatter"):
            c = hardware[name]
            assert c["supported"] and c["busbw_gbps"] == pytest.approx(c["algbw_gbps"] / 2)
    assert gpu_memory_bytes(probes["plain"]) is None  # CPU ranks: no GPU memory to plan with


def test_a_missing_or_unreadable_rank_file_fails_every_stage_naming_the_rank(probes, tmp_path):
    missing = tmp_path / "missing"
    shutil.copytree(probes["plain"], missing)
    (missing / "rank-1.json").unlink()
    for stage in probe_stages(missing, 10.0):
        assert not stage.ok and "rank 1: no rank-1.json" in stage.figure, (stage.key, stage.figure)
    (missing / "rank-1.json").write_text('{"rank": 1, "world_')
    for stage in probe_stages(missing, 10.0):
        assert not stage.ok and "rank 1: unreadable rank-1.json" in stage.figure
    empty = tmp_path / "empty"
    empty.mkdir()
    assert all(not s.ok and "no rank files" in s.figure for s in probe_stages(empty, 1.0))


def _edited(probes, tmp_path, edit):
    """A copy of the plain probe's files with `edit(rank, record)` applied to each."""
    folder = tmp_path / "edited"
    folder.mkdir()
    for rank in (0, 1):
        record = json.loads((probes["plain"] / f"rank-{rank}.json").read_text())
        edit(rank, record)
        (folder / f"rank-{rank}.json").write_text(json.dumps(record))
    return folder


def test_versions_outside_the_pins_or_differing_between_ranks_fail_stage_a(probes, tmp_path):
    def old_torch_on_rank_1(rank, record):
        if rank == 1:
            record["environment"]["torch"] = "2.10.0+cpu"

    stage = probe_stages(_edited(probes, tmp_path, old_torch_on_rank_1), 1.0)[0]
    assert not stage.ok
    assert "torch 2.10.0+cpu outside the pin >=2.11,<2.14 (pyproject.toml) on rank 1" in stage.figure
    assert "ranks differ in torch: 2.13.0+cpu on rank 0, 2.10.0+cpu on rank 1" in stage.figure


def test_an_untested_combination_inside_the_pins_passes_and_says_so(probes, tmp_path):
    def triton_365(rank, record):
        record["environment"]["triton"] = "3.6.5"

    stage = probe_stages(_edited(probes, tmp_path, triton_365), 1.0)[0]
    assert stage.ok and stage.figure.endswith("; untested combination: stage b checks the kernels on it")


def test_a_rank_that_raised_fails_its_stage_by_name(probes, tmp_path):
    record: dict = {}
    _section(record, "kernels", lambda: 1 / 0)
    assert record["error"] == "kernels: ZeroDivisionError: division by zero"

    def kernels_raised_on_rank_0(rank, rec):
        if rank == 0:
            rec["kernels"], rec["error"] = record["kernels"], record["error"]

    stages = _by_key(probe_stages(_edited(probes, tmp_path, kernels_raised_on_rank_0), 1.0))
    assert stages["a"].ok and stages["c"].ok
    assert not stages["b"].ok and stages["b"].figure == "rank 0: ZeroDivisionError: division by zero"


def test_the_outlier_rule_flags_a_rank_20_percent_off_and_not_one_5_percent_off():
    base = {rank: 1.0 + 0.01 * (rank % 3) for rank in range(8)}
    assert outliers(base) == {}
    slow = {**base, 3: 1.2 * 1.01}
    assert list(outliers(slow)) == [3] and outliers(slow)[3] == pytest.approx(0.2, abs=0.01)
    assert outliers({**base, 3: 1.05}) == {}
    assert list(outliers({**base, 5: 0.8})) == [5]  # faster is as suspicious as slower
    assert outliers({}) == {}


def test_gpu_ranks_are_judged_by_the_outlier_rule_and_cpu_ranks_are_not(probes):
    records, problems = load_ranks(probes["plain"])
    gpu = {}
    for rank in range(8):
        r = copy.deepcopy(records[rank % 2])
        r["hardware"]["device"] = "cuda"
        r["hardware"]["gemm"]["seconds"] = 1e-3 * (1.2 if rank == 6 else 1.0)
        for name in ("all_gather", "reduce_scatter"):
            r["hardware"][name]["seconds"] = 2e-3 * (1.05 if rank == 2 else 1.0)
        gpu[rank] = r
    stage = hardware_stage(gpu, [], 1.0)
    assert not stage.ok and stage.figure == "rank 6: GEMM 20% slower than the median over ranks"
    cpu = {rank: copy.deepcopy(r) for rank, r in gpu.items()}
    for r in cpu.values():
        r["hardware"]["device"] = "cpu"
    stage = hardware_stage(cpu, [], 1.0)
    assert stage.ok and stage.figure.endswith("CPU ranks: timed, not judged")


def test_the_plan_gets_the_least_free_gpu_memory_over_ranks(probes, tmp_path):
    def on_a_gpu(rank, record):
        record["environment"] |= {"device": "cuda", "memory_free_bytes": (100 - rank) * 2**30}

    assert gpu_memory_bytes(_edited(probes, tmp_path, on_a_gpu)) == 99 * 2**30


def test_the_pins_agree_with_pyproject():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    declared = {req.name: req.specifier for req in map(Requirement, project["dependencies"])}
    for package, spec in PINS.items():
        assert SpecifierSet(spec) == declared[package], f"{package}: {spec} here, {declared[package]} in pyproject.toml"
