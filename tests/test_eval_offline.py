"""The pair's evaluation offline, cheaply (no lm-eval model run): a task whose dataset is not cached is refused in
one line before anything is exported, and whatever stops an evaluation, its scratch exports are removed."""

import argparse
import os
import subprocess
import sys
import time

import datasets
import pytest
from conftest import REPO
from tiny_runs import write_tiny_pair

from mhar_titan.eval import cli, harness
from mhar_titan.eval import pair as pair_eval
from mhar_titan.eval.tasks import TASK

STEP = 4


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("pair")
    write_tiny_pair(root, STEP)
    return root


def tree(folder) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*")}


def options(**kw) -> argparse.Namespace:
    defaults = dict(tasks=TASK, step=None, weights="raw", limit=2, num_fewshot=None, batch_size="8")
    defaults |= dict(device="cpu", dtype="fp32", out=None, keep_exports=False)
    return argparse.Namespace(**(defaults | kw))


def test_a_task_whose_dataset_is_not_cached_is_refused_in_one_line_before_any_export(pair, tmp_path):
    hf, scratch = tmp_path / "hf", tmp_path / "tmp"  # an empty HF cache: arc_easy is not in it on any machine
    scratch.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")}
    env |= {"HF_HOME": str(hf), "HF_DATASETS_CACHE": str(hf / "datasets"), "TMPDIR": str(scratch)}
    before = tree(pair)
    began = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "mhar_titan.eval", str(pair), "--tasks", "arc_easy"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    took = time.monotonic() - began
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.strip().splitlines() == [
        "python -m mhar_titan.eval: task arc_easy needs the dataset allenai/ai2_arc (ARC-Easy), which is not in the "
        "local HF datasets cache (offline); run lm-eval once with network, or copy the cache (HF_DATASETS_CACHE), "
        "then retry"
    ]
    assert "[eval]" not in done.stdout  # no arm was started
    assert tree(pair) == before  # no export, no eval/ folder, nothing
    # The temp dir holds nothing of ours (torch makes its compile cache's folder there when imported).
    assert [p.name for p in scratch.iterdir() if not p.name.startswith("torchinductor_")] == []
    # Before the fix: an export, then a minute of retries to reach the Hub. Now: the imports and lm-eval's index.
    assert took < 90


def test_an_error_during_an_evaluation_leaves_no_scratch_export_and_says_where(pair, monkeypatch, capsys):
    calls = []

    def fails(**kw):
        calls.append(kw)
        assert os.path.isfile(os.path.join(kw["model_args"].split(",")[0].removeprefix("pretrained="), "config.json"))
        raise RuntimeError("out of memory\nin the second batch")

    monkeypatch.setattr(harness.lm_eval, "simple_evaluate", fails)
    for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):  # as main() sets them, undone after the test
        monkeypatch.setenv(name, "1")
    before = tree(pair)
    with pytest.raises(pair_eval.EvalFailed) as failed:
        pair_eval.evaluate_pair(pair, options())
    assert len(calls) == 1  # the control arm was exported, then lm-eval failed on it
    assert str(failed.value).startswith(
        f"control arm, raw weights, step {STEP}, tasks {TASK}: RuntimeError: out of memory in the second batch"
    )
    assert tree(pair) == before

    # The command line: one line, exit 1; Ctrl-C too removes the export, exit 130.
    with pytest.raises(SystemExit) as stopped:
        cli.main([str(pair), "--tasks", TASK, "--weights", "ema", "--limit", "2"])
    assert "control arm, ema weights, step 4, tasks mhar_tiny_cloze: RuntimeError" in str(stopped.value.code)
    assert "\n" not in str(stopped.value.code)

    def interrupted(**kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(harness.lm_eval, "simple_evaluate", interrupted)
    with pytest.raises(SystemExit) as stopped:
        cli.main([str(pair), "--tasks", TASK, "--weights", "raw", "--keep-exports"])
    assert stopped.value.code == 130
    err = capsys.readouterr().err  # after datasets' progress bars (our task's file, read again: a new temp path)
    assert "Traceback" not in err and err.strip().splitlines()[-1] == (
        f"python -m mhar_titan.eval: control arm, raw weights, step {STEP}, tasks {TASK}: interrupted"
    )
    assert tree(pair) == before


def test_each_dataset_is_loaded_once_and_every_arm_gets_the_same_tasks(pair, monkeypatch, tmp_path):
    loads, seen = [], []
    load_dataset = datasets.load_dataset
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **kw: loads.append(kw) or load_dataset(*a, **kw))

    def scores(**kw):
        seen.append(kw["tasks"])
        samples = [{"doc_id": i, "acc": float(i % 2)} for i in range(4)]
        return {"results": {TASK: {"acc,none": 0.5, "acc_stderr,none": 0.25}}, "samples": {TASK: samples}}

    monkeypatch.setattr(harness.lm_eval, "simple_evaluate", scores)
    results = pair_eval.evaluate_pair(pair, options(weights="raw,ema", out=str(tmp_path)))
    assert [r["delta"] for rows in results.values() for r in rows] == [0.0, 0.0]
    assert len(loads) == 1 and len(seen) == 4
    assert all(tasks is seen[0] for tasks in seen) and [t.task_name for t in seen[0]] == [TASK]
    assert not [p for p in (pair / "eval").iterdir() if p.is_dir()]  # exports removed after a finished evaluation
