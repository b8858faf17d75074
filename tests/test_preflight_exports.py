"""The preflight's stages g (exports read back by transformers against the trainer's model) and h (lm-eval on
those exports, paired) on a tiny pair on CPU: the commands as the driver runs them, their JSON and stage rows,
and the FAILs: a damaged export, a crash, a refused task, non-finite metrics."""

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO
from safetensors.torch import load_file, save_file
from tiny_runs import write_tiny_pair

from mhar_titan.eval import pair as pair_eval
from mhar_titan.eval.tasks import TASK
from mhar_titan.preflight import evaluate, exports

STEP, LIMIT = 4, 8
MODELS = ["control-raw", "control-ema", "mhar-raw", "mhar-ema"]


def run(module: str, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", f"mhar_titan.preflight.{module}", *args]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """The pair and stage g's exports of it, by the command."""
    root = tmp_path_factory.mktemp("preflight")
    write_tiny_pair(root / "pair", STEP)
    done = run("exports", str(root / "pair"), str(root / "exports"), "--step", str(STEP), "--device", "cpu")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return root / "pair", root / "exports"


def test_the_exports_read_back_as_their_classes_and_match_the_trainer(exported):
    _, out = exported
    result = json.loads((out / "exports.json").read_text())
    assert result["ok"] and "error" not in result and result["step"] == STEP and result["tokens"] == 256
    assert list(result["exports"]) == MODELS
    for name, e in result["exports"].items():
        arm = name.split("-")[0]
        assert e["class"] == ("LlamaForCausalLM" if arm == "control" else "MHARLlamaForCausalLM"), name
        assert e["model_type"] == ("llama" if arm == "control" else "mhar_llama")
        assert e["ok"] and e["class_ok"] and e["generate_equal"] and len(e["generated"]) == 8
        assert 0 <= e["logits_rel_diff"] <= e["bound"] == 1e-5
        assert e["token_ids_below"] == 2048 and e["export_seconds"] > 0 and e["load_seconds"] > 0
        assert json.loads((out / name / "config.json").read_text())["torch_dtype"] == "float32"
        assert (out / name / "tokenizer.json").is_file()  # kept for stage h
    stage = exports.export_stage(out / "exports.json", 12.5)
    assert (stage.key, stage.name, stage.result, stage.seconds) == ("g", "exports", "PASS", 12.5)
    assert re.fullmatch(
        r"4 exports read back: logits within \d\.\de-\d\d \(bound 1e-05\), cached generate equal", stage.figure
    ), stage.figure
    rows = [line for line in stage.details if line.startswith("| ") and "PASS" in line]
    assert [r.split(" | ")[0].removeprefix("| ") for r in rows] == MODELS
    assert "| mhar-ema | MHARLlamaForCausalLM |" in "\n".join(stage.details)


def test_the_evaluation_pairs_all_four_exports_into_the_pairs_report(exported):
    pair, out = exported
    args = ["--step", str(STEP), "--tasks", TASK, "--device", "cpu", "--dtype", "fp32", "--limit", str(LIMIT)]
    done = run("evaluate", str(pair), str(out), *args)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    result = json.loads((out / "eval.json").read_text())
    assert result["ok"] and result["expected_tasks"] == [TASK] and sorted(result["models"]) == sorted(MODELS)
    for name, model in result["models"].items():
        assert model["folder"] == str(out / name) and set(model["metrics"][TASK]) == {"acc,none", "acc_norm,none"}
    assert sorted(result["results"]) == ["ema", "raw"]
    assert all(r["n"] == LIMIT for rows in result["results"].values() for r in rows)
    # Where `python -m mhar_titan.eval` writes it, as it writes it.
    saved = json.loads((pair / "compare" / "eval.json").read_text())
    assert saved == {"step": STEP, "tasks": [TASK], "results": result["results"]}
    table = (pair / "compare" / "eval.md").read_text()
    assert table == pair_eval.table(result["results"], STEP, [TASK])
    assert "**raw weights**" in table and "**ema weights**" in table and "| mhar_tiny_cloze | acc |" in table
    assert (pair / "compare" / "report.md").read_text().count(pair_eval.REPORT_START) == 1

    stage = evaluate.eval_stage(out / "eval.json", 3.0)
    assert (stage.key, stage.name, stage.result) == ("h", "evaluation", "PASS")
    assert re.fullmatch(
        r"mhar_tiny_cloze: control \d\.\d{3}, MHAR \d\.\d{3} \(raw\), delta [+-]\d\.\d{3} ± \d\.\d{3}", stage.figure
    ), stage.figure
    assert "| task | metric | control | mhar | delta | stderr | 95% CI | n |" in stage.details
    assert sum(line.startswith("| mhar_tiny_cloze | acc |") for line in stage.details) == 2  # raw and EMA


def test_a_damaged_export_fails_the_logits_check(exported, tmp_path, monkeypatch):
    """The MHAR arm's EMA export with one routing gate shifted by 1 on disk (as a wrong mapping would write it): the
    command still exits 0, the JSON and the stage say FAIL and name it; the other three pass."""
    pair, _ = exported
    real = exports.export_run

    def damaging(run_dir, out_dir, **kw):
        step_dir = real(run_dir, out_dir, **kw)
        if out_dir.endswith("mhar-ema"):
            shard = next(Path(out_dir).glob("*.safetensors"))
            tensors = load_file(shard)
            tensors["model.layers.1.mhar.attn.gate"] += 1.0
            save_file(tensors, shard, metadata={"format": "pt"})
        return step_dir

    monkeypatch.setattr(exports, "export_run", damaging)
    exports.main([str(pair), str(tmp_path / "out"), "--step", str(STEP), "--device", "cpu", "--tokens", "32"])
    result = json.loads((tmp_path / "out" / "exports.json").read_text())
    assert not result["ok"] and "error" not in result
    assert [n for n, e in result["exports"].items() if not e["ok"]] == ["mhar-ema"]
    bad = result["exports"]["mhar-ema"]
    assert bad["class_ok"] and not bad["logits_ok"] and bad["logits_rel_diff"] > 10 * bad["bound"], bad
    stage = exports.export_stage(tmp_path / "out" / "exports.json", 1.0)
    assert stage.result == "FAIL" and stage.figure.startswith("mhar-ema: logits ")
    assert "> bound 1e-05" in stage.figure and "\n" not in stage.figure
    assert any("What to do" in line for line in stage.details)
    assert "| mhar-ema | MHARLlamaForCausalLM |" in "\n".join(stage.details)


def test_a_crashed_export_writes_its_error_and_exits_non_zero(exported, tmp_path):
    pair, _ = exported
    with pytest.raises(SystemExit) as stopped:
        exports.main([str(pair), str(tmp_path / "out"), "--step", "8", "--device", "cpu"])
    assert "control-raw: FileNotFoundError" in str(stopped.value.code)
    result = json.loads((tmp_path / "out" / "exports.json").read_text())
    assert not result["ok"] and result["error"].startswith("control-raw: FileNotFoundError")
    assert "no complete checkpoint for step 8" in result["error"]
    stage = exports.export_stage(tmp_path / "out" / "exports.json", 1.0)
    assert stage.result == "FAIL" and stage.figure == result["error"]
    assert exports.export_stage(tmp_path / "missing.json", 0.0).result == "FAIL"


def test_an_unknown_task_is_a_fail_naming_it(exported, tmp_path, monkeypatch, capsys):
    pair, out = exported
    for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):  # as main() sets them, undone after the test
        monkeypatch.setenv(name, "1")
    before = (pair / "compare" / "eval.md").read_text() if (pair / "compare" / "eval.md").exists() else None
    path = tmp_path / "eval.json"
    args = ["--step", str(STEP), "--tasks", f"{TASK},no_such_task", "--limit", "2", "--json", str(path)]
    with pytest.raises(SystemExit) as stopped:
        evaluate.main([str(pair), str(out), *args])
    assert stopped.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "python -m mhar_titan.preflight.evaluate: --tasks: no_such_task not known to lm-eval "
        f"(nor among this project's: {TASK})"
    )
    stage = evaluate.eval_stage(path, 2.0)
    assert (stage.key, stage.result) == ("h", "FAIL")
    assert "no_such_task" in stage.figure and "\n" not in stage.figure and "Traceback" not in stage.figure
    assert any("What to do" in line for line in stage.details)
    after = (pair / "compare" / "eval.md").read_text() if (pair / "compare" / "eval.md").exists() else None
    assert after == before  # nothing ran, nothing written but the result


def test_exports_of_another_step_are_refused(exported, tmp_path, monkeypatch):
    pair, out = exported
    for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
        monkeypatch.setenv(name, "1")
    path = tmp_path / "eval.json"
    with pytest.raises(SystemExit) as stopped:
        evaluate.main([str(pair), str(out), "--step", "9", "--tasks", TASK, "--json", str(path)])
    assert "the exports are of step 4, not 9" in str(stopped.value.code)
    stage = evaluate.eval_stage(path, 0.0)
    assert stage.result == "FAIL" and "the exports are of step 4, not 9" in stage.figure


def test_non_finite_metrics_or_a_missing_model_fail_the_stage(tmp_path):
    def model(acc):
        return {"folder": "f", "seconds": 1.0, "metrics": {TASK: {"acc,none": acc}}}

    rows = {
        w: [
            {
                "task": TASK,
                "metric": "acc,none",
                "control": 0.5,
                "mhar": 0.25,
                "delta": -0.25,
                "delta_stderr": 0.1,
                "delta_ci": [-0.45, -0.05],
                "n": 8,
                "control_stderr": 0.1,
                "mhar_stderr": 0.1,
            }
        ]
        for w in ("raw", "ema")
    }
    result = {"step": STEP, "tasks": [TASK], "expected_tasks": [TASK], "results": rows}
    result["models"] = {name: model(0.5) for name in MODELS}
    path = tmp_path / "eval.json"
    path.write_text(json.dumps(result))
    stage = evaluate.eval_stage(path, 0.0)
    assert stage.ok and stage.figure == "mhar_tiny_cloze: control 0.500, MHAR 0.250 (raw), delta -0.250 ± 0.100"

    result["models"]["mhar-ema"] = model(math.nan)
    del result["models"]["control-raw"]
    path.write_text(json.dumps(result))
    stage = evaluate.eval_stage(path, 0.0)
    assert stage.result == "FAIL"
    assert stage.figure == "control-raw: not evaluated; mhar-ema: mhar_tiny_cloze acc not finite"
