"""float8 as an option of the pair (docs/memory.md): both arms through torchtitan's float8 converter (here torchao's
emulation on CPU, the tensorwise recipe without compile), the MHAR arm at init computing what the control computes
under float8 too, the parity benchmark, the run's fingerprint, the memory plan, and the refusals."""

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys

import pytest
from conftest import REPO
from torch.utils.tensorboard import SummaryWriter

import mhar_titan.config as config_mod
from benchmarks import float8_parity
from mhar_titan.components import fingerprint
from mhar_titan.components.step_log import mfu_note
from mhar_titan.components.tensorboard_scalars import LOSS_TAG
from mhar_titan.config import parse_config
from mhar_titan.hf.export import init_hf
from mhar_titan.plan import estimate, geometry

FLOAT8 = [
    *("--model.converters", "quantize.linear.float8", "--quantize.linear.float8.recipe_name", "rowwise"),
    *("--quantize.linear.float8.filter_fqns", "output"),
]
TINY = str(REPO / "configs" / "tiny_cpu.toml")


@pytest.fixture(scope="module")
def parity(tmp_path_factory):
    """The parity benchmark's four tiny jobs (control and MHAR, without and with float8), 8 steps each."""
    tmp = tmp_path_factory.mktemp("float8")
    base = tmp / "base"
    init_hf(str(base), "tiny", tokenizer_dir=str(REPO / "assets" / "tiny"), seed=3)
    root = tmp / "parity"
    cmd = [
        *(sys.executable, "-m", "benchmarks.float8_parity", "run", str(root), "--base", str(base), "--steps", "8"),
        *("--emulate", "--control", "configs/tiny_cpu.toml", "--mhar", "configs/tiny_cpu_mhar.toml"),
        *("--parallel", "2", "--mhar.num_blocks", "2", "--compile.no-enable"),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return root, proc.stdout


def test_the_mhar_arm_at_init_computes_the_control_under_float8_and_float8_changes_the_loss(parity):
    root, _ = parity
    result = json.loads((root / "float8_parity.json").read_text())
    for precision in ("bf16", "float8"):  # "bf16": the configs' own precision (fp32 in the tiny CPU configs)
        start = result["start"][precision]
        assert start["step"] == 1 and start["control"] == start["mhar"], start  # gate 0: bit for bit
    assert result["start"]["float8"]["control"] != result["start"]["bf16"]["control"]  # the converter ran
    for arm in ("control", "mhar"):
        a = result["arms"][arm]
        assert a["steps"] == list(range(1, 9)) and a["noise"] > 0 and len(a["quarters"]) == 4
        assert any(d != 0 for d in a["deltas"])
    assert (root / "float8_parity.png").read_bytes()[:4] == b"\x89PNG"
    report = (root / "float8_parity.md").read_text()
    assert "| mhar | 4 | 7-8 |" in report
    assert result["run"]["parallel"] == 2 and "2 jobs at a time shared the GPUs: not a job's own speed" in report


def test_the_repeated_bf16_jobs_run_the_bf16_command_and_the_report_sets_float8_against_them(tmp_path):
    """--repeat-bf16: each arm's bf16 job once more, the same command but its folder; the report puts bf16 again -
    bf16 (here 0 for the control, as two runs on a CPU are, and a known offset for MHAR) beside float8 - bf16."""
    args = argparse.Namespace(
        control="configs/tiny_cpu.toml", mhar="configs/tiny_cpu_mhar.toml", nproc=1, emulate=True, base="B", steps=8
    )
    assert float8_parity.runs_of(True) == [
        "control-bf16",
        "control-float8",
        "control-bf16-again",
        "mhar-bf16",
        "mhar-float8",
        "mhar-bf16-again",
    ]
    again, bf16 = (float8_parity.job(tmp_path, "mhar", p, args, ["--x.y", "1"]) for p in ("bf16-again", "bf16"))
    renamed = [a.replace("bf16-again", "bf16") for a in again]
    assert renamed == bf16 and str(tmp_path / "mhar-bf16-again") in again
    loss = {n: [8.0 - 0.1 * s + 0.05 * (s % 3) for s in range(1, 9)] for n in float8_parity.runs_of(True)}
    for n, offset in (("control-float8", 0.01), ("mhar-float8", 0.02), ("mhar-bf16-again", 0.004)):
        loss[n] = [v + offset for v in loss[n]]
    for name, values in loss.items():
        with SummaryWriter(str(tmp_path / name / "tb")) as w:
            for step, v in enumerate(values, 1):
                w.add_scalar(LOSS_TAG, v, step)
    (tmp_path / float8_parity.RUN_FILE).write_text(json.dumps({"parallel": 1, "repeat_bf16": True}))
    result = float8_parity.report(argparse.Namespace(root=str(tmp_path)))
    assert result["floor"]["control"]["deltas"] == [0.0] * 8
    assert result["floor"]["mhar"]["deltas"] == pytest.approx([0.004] * 8, abs=1e-6)  # float32 in the event file
    report = (tmp_path / "float8_parity.md").read_text()
    assert "| control | 4 | 7-8 | 0.00e+00 | 0.00e+00 | 0.000 | 0.000 |" in report
    assert "compare it with two bf16 runs' (--repeat-bf16), not with 0" in report  # the CI's steps are not independent
    assert (
        "- control, last quarter: mean abs delta, float8 1.00e-02 against bf16 again 0.00e+00 (the two bf16 runs' "
        "losses equal, bit for bit)" in report
    )
    assert "- mhar, last quarter: mean abs delta, float8 2.00e-02 against bf16 again 4.00e-03 (5.00x)" in report
    one = tmp_path / "control-only"  # --arms control: its three runs, no comparison of the arms at init
    for name in float8_parity.runs_of(True, ("control",)):
        shutil.copytree(tmp_path / name, one / name)
    (one / float8_parity.RUN_FILE).write_text(json.dumps({"parallel": 1, "repeat_bf16": True, "arms": ["control"]}))
    alone = float8_parity.report(argparse.Namespace(root=str(one)))
    assert list(alone["arms"]) == list(alone["floor"]) == ["control"] and alone["start"] == {}
    assert (one / "float8_parity.md").read_text().startswith("# float8 against bf16, the control arm only")
    shutil.rmtree(tmp_path / "mhar-bf16-again")
    with pytest.raises(SystemExit) as stop:  # the command's main (the last test runs the command itself)
        float8_parity.main(["report", str(tmp_path)])
    assert str(stop.value.code) == (
        f"float8_parity: {tmp_path}: no TensorBoard log of mhar-bf16-again (give the ROOT `run` wrote)"
    )


def test_a_float8_job_logs_its_mfu_as_bf16_equivalent_and_records_its_precision(parity):
    root, _ = parity
    log = (root / "mhar-float8.log").read_text()
    assert "Float8 tensorwise scaled training active" in log  # torchtitan's converter swapped the linear layers
    assert "% (bf16-equivalent)" in log
    assert "bf16-equivalent" not in (root / "mhar-bf16.log").read_text()
    recorded = json.loads((root / "mhar-float8" / fingerprint.FILE).read_text())
    assert recorded["schedule"]["precision"] == {
        "converters": ["quantize.linear.float8"],
        "float8": {"recipe_name": None, "filter_fqns": ["output"], "emulate": True},
    }
    plain = json.loads((root / "mhar-bf16" / fingerprint.FILE).read_text())
    assert "precision" not in plain["schedule"]  # as every run recorded before converters were


def test_resuming_a_run_with_another_precision_is_refused_unless_the_schedule_may_change():
    plain = parse_config(["--job.config_file", TINY])
    f8 = parse_config(["--job.config_file", TINY, *FLOAT8])
    recorded = {"schedule": fingerprint.schedule_group(plain, 8)}
    current = {"schedule": fingerprint.schedule_group(f8, 8)}
    refused = r"(?s)schedule\.precision\.converters: \"<absent>\" in the run.*allow_changes schedule"
    with pytest.raises(ValueError, match=refused):
        fingerprint.check(recorded, current, [], "runs/x")
    lines = fingerprint.check(recorded, current, ["schedule"], "runs/x")
    assert any(line.startswith("schedule.precision.float8.recipe_name") for line in lines)
    assert fingerprint.check(current, current, [], "runs/x") == []
    assert mfu_note(f8) == " (bf16-equivalent)" and mfu_note(plain) == ""


def test_converters_other_than_float8_or_without_torchao_are_refused_before_any_work(monkeypatch):
    with pytest.raises(ValueError, match=r"quantize\.linear\.mx not supported \(tested with both arms: quantize"):
        parse_config(["--job.config_file", TINY, "--model.converters", "quantize.linear.mx"])
    real = importlib.util.find_spec
    monkeypatch.setattr(config_mod.importlib.util, "find_spec", lambda name: None if name == "torchao" else real(name))
    with pytest.raises(ValueError, match=r"needs torchao, which is not installed: pip install -e '\.\[float8\]'"):
        parse_config(["--job.config_file", TINY, *FLOAT8])


@pytest.mark.parametrize("gpus", [1, 8])
def test_the_plan_under_float8_keeps_less_only_without_activation_checkpointing(gpus):
    bench = ["--model.flavor", "marin8b_16l", "--training.seq_len", "4096", "--training.local_batch_size", "2"]
    for mhar in (False, True):
        plain = geometry(parse_config(["--job.config_file", TINY, *bench]), gpus, mhar)
        f8 = geometry(parse_config(["--job.config_file", TINY, *bench, *FLOAT8]), gpus, mhar)
        assert f8.float8 and not plain.float8
        for mode in ("full", "selective"):  # measured on one H200: the same memory as bf16
            assert estimate(f8, mode)["moments"] == estimate(plain, mode)["moments"]
        kept = {g: estimate(g, "none")["moments"]["backward start"]["blocks"] for g in (plain, f8)}
        # measured: the size of q, k, v, w1's and w3's bf16 outputs and the MLP's product, a token and layer
        dropped = f8.layers * f8.tokens * 2 * (f8.dim + 2 * f8.kv_dim + 3 * f8.hidden)
        assert kept[plain] - kept[f8] == dropped


def test_the_report_of_a_folder_without_the_four_runs_is_one_line(tmp_path):
    (tmp_path / "control-bf16" / "tb").mkdir(parents=True)
    cmd = [sys.executable, "-m", "benchmarks.float8_parity", "report", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and proc.stderr.strip().splitlines() == [
        f"float8_parity: {tmp_path}: no TensorBoard log of control-bf16, control-float8, mhar-bf16, mhar-float8 "
        "(give the ROOT `run` wrote)"
    ], proc.stderr
