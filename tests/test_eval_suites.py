"""The `paper` suite (mhar_titan/eval/suites.py) against lm-evaluation-harness 0.4.13's own task registry: every
task, dataset, shot count, metric, filter and code flag as documented; its code tasks refused without
--confirm-run-unsafe-code before anything is loaded; offline without the datasets, one line naming each
missing dataset (or module) before any export; a suite's shots set on the built tasks."""

import json
import os
import subprocess
import sys

import pytest
from conftest import REPO

from mhar_titan.eval import cli, harness
from mhar_titan.eval.harness import load_tasks
from mhar_titan.eval.suites import SUITES
from mhar_titan.eval.tasks import TASK, write_task

PAPER = SUITES["paper"]
# What lm-eval's YAMLs say (a group: its first member's); the suite's shots differ only for MMLU (no count in the
# YAML: lm-eval runs it 0-shot; the suite runs it 5-shot).
YAML_SHOTS = {"mmlu": None, "gpqa_main_zeroshot": 0, "gsm8k": 5, "minerva_math": 4, "humaneval": 0, "mbpp": 3}


@pytest.fixture(scope="module")
def manager():
    return harness.TaskManager()  # lm-eval's whole index (seconds), once for the module


def config(manager, name: str) -> dict:
    return manager.task_index[name].cfg or {}


def leaf(manager, name: str) -> dict:
    """The YAML of a task, or of a group's (or tag's) first member, recursively."""
    while True:
        entry = manager.task_index[name]
        if entry.kind.name == "GROUP":
            name = config(manager, name)["task"][0]
        elif entry.kind.name == "TAG":
            name = sorted(n for n, e in manager.task_index.items() if name in e.tags)[0]
        else:
            return config(manager, name)


def test_the_paper_suite_is_lm_evals_own_tasks_with_the_documented_settings(manager):
    assert [t.label for t in PAPER] == ["MMLU", "GPQA", "GSM8K", "MATH", "HumanEval", "MBPP"]
    for t in PAPER:
        assert t.task in manager.task_index, t.task
        group, member = config(manager, t.task), leaf(manager, t.task)
        assert member["dataset_path"] == t.dataset, t.task
        assert member.get("num_fewshot") == YAML_SHOTS[t.task] and (
            t.num_fewshot == YAML_SHOTS[t.task] or t.task == "mmlu"
        )
        assert bool(member.get("unsafe_code")) == t.code, t.task
        metric, kept = t.metric.split(",")
        names = [str(m["metric"]).rsplit(".", 1)[-1] for m in member["metric_list"]]
        names += [m["metric"] for m in group.get("aggregate_metric_list", [])]
        assert metric in names or (metric == "pass@1" and "pass_at_k" in names and member["metric_list"][0]["k"] == [1])
        assert kept == "none" or kept in [f["name"] for f in member["filter_list"]], t.task
        if member.get("output_type") == "generate_until":
            assert member["generation_kwargs"]["do_sample"] is False, t.task  # greedy
    assert [m["weight_by_size"] for m in config(manager, "mmlu")["aggregate_metric_list"]] == [True]
    assert (
        len(
            [
                n
                for n in manager.task_index
                if n.startswith("mmlu_")
                and config(manager, n).get("dataset_path") == "cais/mmlu"
                and "/default/" in str(manager.task_index[n].yaml_path)
            ]
        )
        == 57
    )


def refusal(argv, capsys) -> str:
    with pytest.raises(SystemExit) as stopped:
        cli.main(argv)
    assert stopped.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    return lines[-1]


@pytest.fixture
def bare_pair(tmp_path):
    """A pair folder as far as the refusals read it: the two arms' model_args.json, no checkpoint."""
    pair = tmp_path / "pair"
    for arm in ("control", "mhar"):
        (pair / arm).mkdir(parents=True)
        (pair / arm / "model_args.json").write_text(json.dumps({"hf_assets_path": str(tmp_path / "base")}))
    return pair


def test_code_tasks_are_refused_without_the_confirmation(bare_pair, manager, monkeypatch, capsys):
    before = sorted(bare_pair.rglob("*"))
    for argv in (["--once"], []):  # the watcher and the one-step form
        assert refusal([str(bare_pair), *argv, "--suite", "paper"], capsys) == (
            "python -m mhar_titan.eval: --suite paper: humaneval, mbpp run the code the model generates (lm-eval's "
            "unsafe_code); pass --confirm-run-unsafe-code to allow it (best in a sandbox: a container without network "
            "or credentials)"
        )
    monkeypatch.setattr(harness, "TaskManager", lambda **kw: manager)  # the index once, not per command
    assert refusal([str(bare_pair), "--once", "--tasks", "gsm8k,humaneval,mbpp"], capsys).startswith(
        "python -m mhar_titan.eval: --tasks: humaneval, mbpp run the code the model generates"
    )
    assert sorted(bare_pair.rglob("*")) == before  # nothing written: no store, no export


def test_offline_without_the_datasets_the_suite_names_each_missing_one_before_any_export(bare_pair, tmp_path):
    hf = tmp_path / "hf"  # an empty HF cache: none of the six datasets is in it on any machine
    env = {k: v for k, v in os.environ.items() if k not in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")}
    env |= {"HF_HOME": str(hf), "HF_DATASETS_CACHE": str(hf / "datasets")}
    before = sorted(bare_pair.rglob("*"))
    cmd = [
        *(sys.executable, "-m", "mhar_titan.eval", str(bare_pair)),
        *("--watch", "--suite", "paper", "--confirm-run-unsafe-code"),
    ]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith("python -m mhar_titan.eval: task mmlu_") and "[eval]" not in done.stdout.replace(
        "[eval] no base column", ""
    )
    parts = line.split("; ")
    for t in PAPER:
        said = [p for p in parts if f"task {t.task} " in p or f"(of {t.task})" in p]
        assert len(said) == 1, (t.task, line)
        dataset = f"needs the dataset {t.dataset}" in said[0] and "not in the local HF datasets cache" in said[0]
        module = "needs the HF evaluate module code_eval" in said[0]  # humaneval, mbpp: their metric, loaded first
        extra = "pip install lm-eval[math]" in said[0]  # MATH: lm-eval's math extra, checked before its dataset
        assert dataset or (t.code and module) or (t.task == "minerva_math" and extra), said[0]
    assert sorted(bare_pair.rglob("*")) == before


def test_a_suites_shots_are_set_on_the_built_tasks(tmp_path):
    tasks = load_tasks([TASK], write_task(tmp_path), {TASK: 2})
    assert [t.get_config("num_fewshot") for t in harness.leaves(tasks.built)] == [2]
    assert tasks.only(TASK).built == tasks.built and tasks.unsafe() == []
