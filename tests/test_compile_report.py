"""benchmarks.compile_report: the routing kernels compile for sm_90 on a CPU machine, and ptxas reports on them."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_every_kernel_compiles_for_sm90_and_ptxas_reports_registers():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the compiler, not the interpreter
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.compile_report", "--sources", "2", "--sass"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    ).stdout
    rows = re.findall(r"^\| (fwd|stats|mix) \| [^|]+ \| (\d+) \| (\d+) \| (\d+) \|$", out, re.M)
    assert {r[0] for r in rows} == {"fwd", "stats", "mix"} and len(rows) == 10, out
    assert all(0 < int(regs) <= 255 for _, _, regs, _ in rows), out
    block = re.findall(r"^\| fwd, 8 sites \(block\) \| rows (\d+) \| (\d+) \| (\d+) \| (\d+) \|$", out, re.M)
    assert [r[0] for r in block] == ["1", "2", "4"] and all(0 < int(r[2]) <= 255 for r in block), out
    # --sass: each row kernel at its table's shape, counted by opcode (every one multiplies and adds)
    sass = re.findall(r"^\| ((?:fwd|stats)[^|]*) \| (\d+) \| ([^|]+) \|$", out, re.M)
    assert [s[0].split(",")[0] for s in sass] == ["fwd", "stats", "fwd", "stats", "fwd"], out
    for _, total, top in sass:
        counts = dict(item.rsplit(" ", 1) for item in top.split(", "))
        assert int(counts["FFMA"]) > 0 and sum(map(int, counts.values())) <= int(total), top


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--sources", "9"], "--sources 9: the kernels take 1 to 8 caller sources"),
        (["--sites", "0"], "--sites 0: a block routes at least one site"),
    ],
)
def test_a_shape_the_kernels_do_not_take_is_refused_by_name(argv, message):
    command = [sys.executable, "-m", "benchmarks.compile_report", *argv]
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
