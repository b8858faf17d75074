"""Evaluation while the pair runs (`python -m mhar_titan.eval PAIR --watch` / `--once`), offline on tiny runs whose
checkpoints are written in-process (tests/tiny_runs.py): checkpoints appearing while the watcher runs, a SIGKILL
and a restart with each (arm, step, weights, task) recorded exactly once and no scratch export left, the base
as step 0, the end of both runs, and the refusals (other settings, a damaged record, a second watcher, a step
saved again); lm-eval runs for real in the subprocess test and is counted through a stand-in elsewhere."""

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest
from conftest import REPO
from tiny_runs import write_tiny_pair, write_tiny_run

from mhar_titan.components.run_lock import RunLock
from mhar_titan.eval import cli, harness, steps
from mhar_titan.eval.pair import paired_rows
from mhar_titan.eval.store import Key
from mhar_titan.eval.tasks import TASK
from mhar_titan.model.args import MHAR

SPEC = {"control": MHAR(enable=False), "mhar": MHAR(enable=True, num_heads=8, num_blocks=2, backend="torch")}
RESOLVED = "[training]\nsteps = {steps}\n\n[checkpoint]\ninterval = 10\nkeep_latest_k = 3\n"
ONCE = ["--once", "--tasks", TASK, "--limit", "4", "--settle", "0"]


def add_step(pair: Path, step: int, arms=("control", "mhar")) -> None:
    """A checkpoint at `step` in each of `arms`, as the trainer adds one (its run records left alone)."""
    for arm in arms:
        write_tiny_run(pair / arm, pair / "base", SPEC[arm], seed=step, step=step, record=False)


def new_pair(root: Path, last_step: int) -> Path:
    write_tiny_pair(root, 10)
    for arm in SPEC:
        (root / arm / "config.resolved.toml").write_text(RESOLVED.format(steps=last_step))
    return root


def records(pair: Path) -> list[str]:
    return sorted(p.name for p in (pair / "eval" / "store").glob("step-*.json"))


def expected(steps_: list[int], weights=("raw", "ema")) -> list[str]:
    keys = [Key("base", 0, "raw", TASK)] + [Key(a, s, w, TASK) for s in steps_ for w in weights for a in SPEC]
    return sorted(k.file_name() for k in keys)


# --- the watcher as users run it: a subprocess, real lm-eval, killed and restarted ----------------------------


def start(pair: Path, log: Path) -> subprocess.Popen:
    cmd = [
        *(sys.executable, "-m", "mhar_titan.eval", str(pair), "--watch"),
        *("--tasks", TASK, "--limit", "4", "--poll", "0.3", "--settle", "0"),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)


def wait_for(condition, proc: subprocess.Popen, log: Path, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if proc.poll() is not None:
            pytest.fail(f"the watcher exited {proc.returncode}:\n{log.read_text()[-4000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"timed out:\n{log.read_text()[-4000:]}")
        time.sleep(0.05)


def test_the_watcher_follows_the_pair_survives_a_kill_and_stops_when_both_runs_are_done(tmp_path):
    pair = new_pair(tmp_path / "pair", last_step=30)
    scratch = pair / "eval" / "scratch"
    first, second = tmp_path / "first.log", tmp_path / "second.log"
    proc = start(pair, first)
    wait_for(lambda: len(records(pair)) >= 3, proc, first)  # the base and step 10 under way
    add_step(pair, 20)  # a checkpoint lands while it runs
    wait_for(lambda: any(n.startswith("step-00000020.") for n in records(pair)), proc, first)
    wait_for(lambda: scratch.is_dir() and any(scratch.iterdir()), proc, first)  # an export in flight
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert scratch.is_dir() and any(scratch.iterdir())  # what the kill left
    done_before = records(pair)
    assert len(done_before) < len(expected([10, 20]))

    proc = start(pair, second)
    add_step(pair, 30, arms=("control",))  # the control is ahead: step 30 is waited for
    wait_for(lambda: "step 30: waiting, mhar has not reached step 30" in second.read_text(), proc, second)
    add_step(pair, 30, arms=("mhar",))
    assert proc.wait(timeout=180) == 0, second.read_text()[-4000:]  # both runs' last step evaluated: it stops
    out = second.read_text()
    assert f"{scratch}: removed, the scratch exports of a watcher that was killed" in out
    assert "both runs finished (step 30) and every kept step is evaluated" in out

    assert records(pair) == expected([10, 20, 30])
    logs = first.read_text() + out
    for name in records(pair):  # each finished exactly once, across the kill: nothing recorded was run again
        record = json.loads((pair / "eval" / "store" / name).read_text())
        key = Key(**record["key"])
        assert logs.count(f"[eval] {key}: acc ") == 1, key
        assert (name in done_before) == (f"[eval] {key}: acc " in first.read_text())
        assert record["settings"]["limit"] == 4 and record["scores"]["results"][TASK]["sample_len"] == 4
    assert not scratch.exists() and not (pair / "eval" / "store" / "run.lock").exists()

    report = (pair / "compare" / "eval.md").read_text()
    assert "| task | metric | base | control | mhar | delta | stderr | 95% CI | n |" in report
    assert "| 0 (base) |" in report and all(f"\n| {s} | " in report for s in (10, 20, 30))
    assert (pair / "compare" / "eval_over_steps.png").stat().st_size > 10_000
    assert (pair / "compare" / "report.md").read_text().count("<!-- eval: start -->") == 1


# --- the rules, with a stand-in for lm-eval (counted) ----------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    root = new_pair(tmp_path_factory.mktemp("watch") / "pair", last_step=40)
    add_step(root, 20)
    return root


@pytest.fixture
def pair(tiny_pair, tmp_path):
    """A copy of the module's pair (steps 10 and 20 in both arms; the base stays where the runs name it)."""
    return Path(shutil.copytree(tiny_pair, tmp_path / "pair", symlinks=True))


@pytest.fixture
def lm_eval_runs(monkeypatch):
    """lm-eval replaced by a stand-in whose per-document scores depend on the model's folder; its calls."""
    calls = []

    def simple_evaluate(**kw):
        folder = Path(kw["model_args"].split(",")[0].removeprefix("pretrained="))
        calls.append(folder.name)
        task = kw["tasks"][0].task_name
        bits = zlib.crc32(folder.name.encode())
        samples = [{"doc_id": i, "filter": "none", "doc_hash": f"h{i}", "acc": float(bits >> i & 1)} for i in range(8)]
        acc = sum(s["acc"] for s in samples) / len(samples)
        return {"results": {task: {"acc,none": acc, "acc_stderr,none": 0.1}}, "samples": {task: samples}}

    monkeypatch.setattr(harness.lm_eval, "simple_evaluate", simple_evaluate)
    for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
        monkeypatch.setenv(name, "1")
    return calls


def refused(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as stopped:
        cli.main(argv)
    code = stopped.value.code
    message = str(code) if code not in (1, 2) else capsys.readouterr().err.strip().splitlines()[-1]
    assert "\n" not in message and "Traceback" not in message
    return message


def test_once_evaluates_each_kept_step_once_with_the_base_as_step_0(pair, lm_eval_runs, capsys):
    cli.main([str(pair), *ONCE])
    assert sorted(lm_eval_runs) == sorted(
        ["base"] + [f"{a}-{w}-step-{s}" for s in (10, 20) for w in ("raw", "ema") for a in SPEC]
    )
    assert records(pair) == expected([10, 20])
    lm_eval_runs.clear()
    cli.main([str(pair), *ONCE])  # nothing new: lm-eval is not run again
    assert lm_eval_runs == []

    report = json.loads((pair / "compare" / "eval.json").read_text())
    base_acc = sum(zlib.crc32(b"base") >> i & 1 for i in range(8)) / 8
    assert report["base"][0]["control"] == base_acc and report["steps"] == [10, 20]
    for weights in ("raw", "ema"):
        for row in report["results"][weights]["20"]:
            assert row["base"] == base_acc and row["n"] == 8 and row["delta_ci"] is not None
    text = (pair / "compare" / "eval.md").read_text()
    assert f"| {TASK} | acc | {base_acc:.4f} |" in text and f"| 0 (base) | {base_acc:.4f} |" in text


def test_a_step_deleted_by_retention_is_skipped_by_name_and_a_new_one_evaluated(pair, lm_eval_runs, capsys):
    cli.main([str(pair), *ONCE])
    shutil.rmtree(pair / "control" / "checkpoint" / "step-10")  # retention, after it was evaluated: records stay
    add_step(pair, 40)  # step 30 was saved and deleted in both arms before the watcher looked
    lm_eval_runs.clear()
    capsys.readouterr()
    cli.main([str(pair), *ONCE])
    out = capsys.readouterr().out
    assert sorted(lm_eval_runs) == sorted(f"{a}-{w}-step-40" for w in ("raw", "ema") for a in SPEC)
    why = "control's checkpoint was deleted (retention, keep_latest_k) before it was evaluated"
    assert f"[eval] step 30 skipped: {why}" in out
    report = json.loads((pair / "compare" / "eval.json").read_text())
    assert report["steps"] == [10, 20, 40] and why in report["skipped"]["30"]
    assert "step 30: " + why in (pair / "compare" / "eval.md").read_text()


def test_other_settings_a_damaged_record_and_a_second_watcher_are_refused(pair, lm_eval_runs, capsys):
    cli.main([str(pair), *ONCE])
    lm_eval_runs.clear()
    store = pair / "eval" / "store"
    message = refused(
        [str(pair), "--once", "--tasks", TASK, "--limit", "3", "--dtype", "bf16", "--settle", "0"], capsys
    )
    assert f"{store / 'settings.json'}: the store holds results evaluated with other settings (" in message
    assert "dtype: fp32 in the store, bf16 now; limit: 4 in the store, 3 now)" in message

    (store / ".step-00000020.mhar.raw.x.json.abc.tmp").write_text('{"key": ')  # a kill inside write_text
    torn = store / Key("control", 30, "raw", TASK).file_name()
    torn.write_text('{"key": {"arm": "control", "step": 30, "weights": "raw", "task": "mhar_')
    message = refused([str(pair), *ONCE], capsys)
    assert message.startswith(f"python -m mhar_titan.eval: {torn}: not a record of this store (JSONDecodeError")
    assert "[eval] " + str(store / ".step-00000020.mhar.raw.x.json.abc.tmp") + ": removed" in capsys.readouterr().out
    torn.unlink()

    other = RunLock(str(store), 300, 0)  # another live watcher on this host
    assert other.try_acquire()[0] == "acquired"
    try:
        message = refused([str(pair), *ONCE], capsys)
    finally:
        other.release()
    assert f"{store / 'run.lock'}: another watcher is evaluating this pair (host " in message

    add_step(pair, 20, arms=("mhar",))  # step 20 saved again (a resume from an earlier checkpoint)
    message = refused([str(pair), *ONCE], capsys)
    assert (
        f"{store / Key('mhar', 20, 'ema', TASK).file_name()}: evaluated from another checkpoint of mhar step 20"
        in message
    )
    assert lm_eval_runs == []


def test_sigterm_aborts_the_evaluation_in_flight_and_removes_its_export(pair, lm_eval_runs, monkeypatch, capsys):
    evaluate = harness.lm_eval.simple_evaluate

    def stopped_in_the_third(**kw):
        if len(lm_eval_runs) == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return evaluate(**kw)

    monkeypatch.setattr(harness.lm_eval, "simple_evaluate", stopped_in_the_third)
    handler = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as stopped:
        cli.main([str(pair), *ONCE])
    assert stopped.value.code == 143 and signal.getsignal(signal.SIGTERM) is handler
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == (
        "python -m mhar_titan.eval: stopped by SIGTERM; the evaluation of mhar arm, raw weights, step 10, task "
        f"{TASK} was aborted, scratch exports removed; 2 records in the store; the same command resumes"
    )
    assert len(records(pair)) == 2 and not (pair / "eval" / "scratch").exists()


def test_the_pair_must_name_one_base_and_one_schedule(pair, tmp_path):
    args = json.loads((pair / "mhar" / "model_args.json").read_text())
    (pair / "mhar" / "model_args.json").write_text(json.dumps(args | {"hf_assets_path": str(tmp_path)}))
    with pytest.raises(ValueError, match="the arms must start from the same base"):
        steps.read_pair(pair)
    (pair / "mhar" / "model_args.json").write_text(json.dumps(args))
    (pair / "mhar" / "config.resolved.toml").write_text(RESOLVED.format(steps=50))
    with pytest.raises(ValueError, match=r"\[training\] steps: 40 in .*, 50 in .*their schedules must match"):
        steps.read_pair(pair)
    (pair / "mhar" / "config.resolved.toml").write_text(RESOLVED.format(steps=40))
    folder, why = steps.base_folder(steps.read_pair(pair))
    assert why == "" and (folder / "config.json").is_file()  # the base both arms name, with its weights
    tokenizer_only = steps.Arm("control", pair / "control", str(REPO / "assets" / "tiny"), 40, 10)
    folder, why = steps.base_folder({"control": tokenizer_only})
    assert folder is None and why.endswith("holds no HF model (config.json and safetensors): random init")


def test_paired_rows_pair_documents_per_filter_and_pool_a_weighted_group():
    def model(values: dict[str, list[float]], group: float) -> dict:
        """gsm8k-like: every document scored under two filters; a group of it, weighted by size."""
        samples = [{"doc_id": i, "filter": f, "exact_match": v} for f, vs in values.items() for i, v in enumerate(vs)]
        results = {
            "gsm": {f"exact_match,{f}": sum(vs) / len(vs) for f, vs in values.items()},
            "grp": {"exact_match,strict": group},
        }
        return {"results": results, "samples": {"gsm": samples}, "group_subtasks": {"grp": ["gsm"], "gsm": []}}

    control = model({"strict": [0, 0, 1, 0], "flex": [1, 1, 1, 0]}, 0.25)
    mhar = model({"strict": [1, 0, 1, 1], "flex": [1, 1, 1, 1]}, 0.75)
    rows = {(r["task"], r["metric"]): r for r in paired_rows(control, mhar)}
    strict = rows[("gsm", "exact_match,strict")]
    assert strict["delta"] == 0.5 and strict["n"] == 4  # each filter's own values, not the other's
    assert strict["delta_stderr"] == pytest.approx(statistics.stdev([1, 0, 0, 1]) / 2)
    assert rows[("gsm", "exact_match,flex")]["delta"] == 0.25 and rows[("gsm", "exact_match,flex")]["n"] == 4
    assert rows[("grp", "exact_match,strict")]["n"] == 4 and rows[("grp", "exact_match,strict")]["delta_ci"]
    mhar["results"]["grp"]["exact_match,strict"] = 0.6  # not the mean of its documents: no paired CI
    assert paired_rows(control, mhar)[0]["delta_ci"] is None
