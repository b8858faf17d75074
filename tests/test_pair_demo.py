"""The demo's path in short: a random HF base, the pair through launch/pair.sh, then the comparison; the pair
runs with document masking (block-causal attention, no loss on a document's first token), which the graft's
identity must survive."""

import json
import os
import subprocess
import sys

from conftest import REPO
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from mhar_titan.compare import routing
from mhar_titan.compare.pair import compare
from mhar_titan.components.tensorboard_scalars import event_files, load_scalars
from mhar_titan.config import parse_config
from mhar_titan.hf.export import init_hf


def test_pair_from_an_hf_base_starts_identical_and_the_report_says_so(tmp_path):
    base = tmp_path / "base"
    init_hf(str(base), "tiny", tokenizer_dir=str(REPO / "assets" / "tiny"), seed=7)
    cmd = [
        str(REPO / "launch" / "pair.sh"),
        "--nproc",
        "2",
        "demo",
        "configs/tiny_cpu.toml",
        "configs/tiny_cpu_mhar.toml",
    ]
    cmd += ["--model.flavor", "hf", "--model.hf_assets_path", str(base), "--checkpoint.initial_load_in_hf"]
    cmd += ["--training.steps", "4", "--lr_scheduler.total_steps", "4", "--validation.freq", "2"]
    cmd += ["--validation.steps", "2", "--mhar.num_blocks", "2", "--mhar.stats_freq", "2"]
    cmd += ["--model.attention_mask", "block_causal", "--data.no-loss_on_document_start"]
    env = {**os.environ, "PYTHON": sys.executable, "RUNS_DIR": str(tmp_path), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]

    pair = tmp_path / "demo"
    result = compare(str(pair))
    assert result["first_step_abs_delta"] == 0.0  # gate 0: the MHAR arm computes the base model exactly
    assert result["lr_identical"] and result["tokens_identical"]
    assert [v["step"] for v in result["val"]] == [2, 4]
    report = (pair / "compare" / "report.md").read_text()
    assert "Step 1: |Δ| = **0.000e+00**" in report and "identical" in report
    assert (pair / "delta").is_dir() and list((pair / "control" / "validation").glob("step-*.json"))
    # the tiny configs' two-source mixture and two validation sets: identical data in both arms, each set reported
    assert result["data_identical"] and result["checks"]["data"]["tags"] >= 4
    assert result["checks"]["recipe"] == {"identical": True, "differences": []}  # their fingerprint.json files
    assert [s["name"] for s in result["validation_sets"]] == ["docstrings", "code"]
    for vset in result["validation_sets"]:
        assert [row["step"] for row in vset["rows"]] == [0, 2, 4]
        assert vset["rows"][0]["raw"]["delta"]["delta"] == 0.0  # step 0: the same base on the same batches
    assert "## Validation sets" in report and "### `code` (`val/code/ce`, `val/code/ce_ema`)" in report
    # where MHAR helps: every set's batches by band, from the same passes; each valid token in one band of each kind
    assert result["bands"]["step"] == 4 and sorted(result["bands"]["sets"]) == ["code", "docstrings"]
    record = json.loads((pair / "mhar" / "validation" / "step-00000004.json").read_text())
    for entry in (e[kind] for e in record["sets"].values() for kind in ("raw", "ema")):
        for kind in ("position", "doc_length"):
            per_band = entry["bands"][kind].values()
            assert [sum(b["tokens"][i] for b in per_band) for i in range(len(entry["tokens"]))] == entry["tokens"]
            ce = [sum(b["ce_sum"][i] for b in per_band) for i in range(len(entry["tokens"]))]
            assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(ce, entry["ce_sum"], strict=True))
    assert "## Where MHAR helps" in report and "## At equal compute" in report and "## Per-layer norms" in report
    assert "- control: " in report.split("## Throughput")[1]  # whether a rank straggled, per arm
    # the MHAR arm's routing, from the statistics it logged at steps 1, 2 and 4: a section with its PNGs, and the
    # same pictures as images in the delta run; the control logged none
    assert result["routing"]["steps"] == [1, 2, 4] and result["routing"]["layers"] == 4
    assert result["routing"]["sources"] == ["w_null", "w_embed", "w_d00"] and not result["routing"]["older_layout"]
    section = report.split("## Routing (`mhar`)")[1].split("## Throughput")[0]
    for name in (routing.WEIGHTS_PNG, routing.GATE_ENTROPY_PNG):
        assert (pair / "compare" / name).read_bytes()[:4] == b"\x89PNG" and f"]({name})" in section
    acc = EventAccumulator(str(event_files(pair / "delta")[0]), size_guidance={"images": 0})
    acc.Reload()
    assert [e.step for e in acc.Images(routing.WEIGHTS_IMAGE)] == [1, 2, 4]
    assert [e.step for e in acc.Images(routing.GATE_ENTROPY_IMAGE)] == [4]
    assert not [t for t in load_scalars(pair / "control") if t.startswith("mhar")]
    # each arm's folder records its resolved settings, which parse back to the arm's job
    for arm, enabled in (("control", False), ("mhar", True)):
        folder = pair / arm
        resolved = parse_config(["--job.config_file", str(folder / "config.resolved.toml")])
        assert resolved.mhar.enable is enabled and resolved.training.steps == 4 and resolved.mhar.num_blocks == 2
        assert resolved.model.attention_mask == "block_causal" and not resolved.data.loss_on_document_start
        recorded = json.loads((folder / "fingerprint.json").read_text())
        assert recorded["model"]["attn_mask_type"] == "block_causal"
        assert recorded["data"]["loss_on_document_start"] is False
        assert resolved.job.dump_folder == str(folder) and resolved.model.hf_assets_path == str(base)
        assert json.loads((folder / "environment.json").read_text())["world_size"] == 2
        assert [json.loads(line)["step"] for line in (folder / "starts.jsonl").read_text().splitlines()] == [0]
