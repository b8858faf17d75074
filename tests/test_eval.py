"""The pair's evaluation through lm-evaluation-harness, offline: a synthetic pair of tiny runs (checkpoints
written in-process, the MHAR arm with open gates), both arms exported and evaluated on the demo task."""

import argparse
import json
import os

import pytest
from tiny_runs import write_tiny_pair

from mhar_titan.eval import pair as pair_eval
from mhar_titan.eval.tasks import TASK, cloze_items

STEP, LIMIT = 4, 16


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("pair")
    write_tiny_pair(root, STEP)
    return root


def options(**kw) -> argparse.Namespace:
    defaults = dict(tasks=TASK, step=None, weights="raw,ema", limit=LIMIT, num_fewshot=None, batch_size="8")
    defaults |= dict(device="cpu", dtype="fp32", out=None, keep_exports=False)
    return argparse.Namespace(**(defaults | kw))


def test_the_demo_task_is_deterministic_and_held_out():
    items = cloze_items()
    assert items == cloze_items() and len(items) >= 100
    assert all(len(i["choices"]) == 4 and i["choices"][i["label"]].startswith(" ") for i in items)


def test_both_arms_are_evaluated_alike_and_the_report_gains_a_paired_table(pair):
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    results = pair_eval.evaluate_pair(pair, options(keep_exports=True))
    assert sorted(results) == ["ema", "raw"]
    for rows in results.values():
        assert [r["metric"] for r in rows] == ["acc,none", "acc_norm,none"]
        for r in rows:
            assert r["task"] == TASK and r["n"] == LIMIT
            assert r["delta"] == pytest.approx(r["mhar"] - r["control"], abs=1e-12)
            assert 0 <= r["control"] <= 1 and 0 <= r["mhar"] <= 1
    report = (pair / "compare" / "report.md").read_text()
    assert report.count(pair_eval.REPORT_START) == 1 and "| mhar_tiny_cloze | acc |" in report
    saved = json.loads((pair / "compare" / "eval.json").read_text())
    assert saved["step"] == STEP and saved["results"] == json.loads(json.dumps(results))
    # The MHAR arm is read by lm-eval through its own modeling code, not as a Llama without routing.
    for arm, model_type in (("control", "llama"), ("mhar", "mhar_llama")):
        for weights in ("raw", "ema"):
            config = json.loads((pair / "eval" / f"{arm}-{weights}-step-{STEP}" / "config.json").read_text())
            assert config["model_type"] == model_type

    # Written again (a second evaluation), the report's section is replaced, not appended.
    pair_eval.write_outputs(pair, pair / "compare", STEP, [TASK], results)
    assert (pair / "compare" / "report.md").read_text().count(pair_eval.REPORT_START) == 1


def test_paired_rows_pair_documents_and_refuse_different_ones():
    def arm(values):
        samples = [{"doc_id": i, "acc": v} for i, v in enumerate(values)]
        return {
            "results": {"t": {"acc,none": sum(values) / len(values), "acc_stderr,none": 0.1}},
            "samples": {"t": samples},
        }

    rows = pair_eval.paired_rows(arm([1, 0, 1, 1]), arm([1, 1, 1, 0]))
    assert rows[0]["delta"] == 0 and rows[0]["delta_stderr"] == pytest.approx((2 / 3) ** 0.5 / 2)
    with pytest.raises(ValueError, match="different documents"):
        pair_eval.paired_rows(arm([1, 0]), arm([1, 0, 1]))


def test_unknown_tasks_and_weights_are_refused_before_any_export(pair, tmp_path):
    before = sorted(p.name for p in (pair / "eval").iterdir()) if (pair / "eval").exists() else []
    for kw, message in [
        (dict(tasks="no_such_task"), "--tasks: no_such_task not known to lm-eval"),
        (dict(weights="rawx"), "--weights 'rawx': expected raw, ema or raw,ema"),
    ]:
        with pytest.raises(ValueError, match=message):
            pair_eval.evaluate_pair(pair, options(out=str(tmp_path), **kw))
    assert sorted(p.name for p in (pair / "eval").iterdir() if p.name != "tasks") == [b for b in before if b != "tasks"]


def test_a_step_missing_in_one_arm_is_refused(pair):
    with pytest.raises(ValueError, match="step 8 is not a complete checkpoint of both arms"):
        pair_eval.common_step(pair, 8)
