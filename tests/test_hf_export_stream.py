"""The streamed export of a run's checkpoint (one output shard at a time, never the model) writes what the
in-memory export writes, tensor for tensor, and checks its inputs before the first tensor is read."""

import json
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from tiny_runs import write_tiny_run

from benchmarks import hf_export_check
from mhar_titan.components.checkpoint.checksums import write_manifest
from mhar_titan.hf.export import export_hf, init_hf
from mhar_titan.hf.run import export_run, load_run_checkpoint
from mhar_titan.model.args import MHAR


def _read_folder(path):
    index = json.loads((path / "model.safetensors.index.json").read_text())
    tensors = {}
    for shard in sorted(set(index["weight_map"].values())):
        tensors.update(load_file(path / shard))
    return index, json.loads((path / "config.json").read_text()), tensors


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("stream")
    init_hf(str(root / "base"), "tiny")
    out = {}
    for name, mhar in (("control", MHAR(enable=False)), ("mhar", MHAR(enable=True, num_blocks=2))):
        write_tiny_run(root / name, root / "base", mhar, seed=3, step=6)
        out[name] = root / name
    return root, out


@pytest.mark.parametrize("arm", ["control", "mhar"])
@pytest.mark.parametrize("ema", [False, True])
def test_streamed_export_writes_what_the_in_memory_export_writes(runs, arm, ema, tmp_path):
    root, run = runs[0], runs[1][arm]
    lines = []
    export_run(
        str(run), str(tmp_path / "stream"), ema=ema, dtype=torch.bfloat16, max_shard_bytes=60_000, log=lines.append
    )
    model = load_run_checkpoint(str(run), ema=ema)
    export_hf(
        model, str(tmp_path / "memory"), base_path=str(root / "base"), dtype=torch.bfloat16, max_shard_bytes=60_000
    )
    got, want = _read_folder(tmp_path / "stream"), _read_folder(tmp_path / "memory")
    assert got[0] == want[0] and got[1] == want[1]  # the index (shard cut, total size) and config.json
    assert len(set(got[0]["weight_map"].values())) > 2
    assert got[2].keys() == want[2].keys()
    for key in want[2]:
        assert got[2][key].dtype == torch.bfloat16 and torch.equal(got[2][key], want[2][key]), key
    assert sorted(os.listdir(tmp_path / "stream")) == sorted(os.listdir(tmp_path / "memory"))
    assert any(line.startswith("shard 3/") for line in lines)  # progress, one line a shard


def test_streamed_export_refuses_bad_input_before_writing(runs, tmp_path):
    root, run = runs[0], runs[1]["mhar"]
    with pytest.raises(ValueError, match="gates are not 0"):
        export_run(str(run), str(tmp_path / "plain"), include_routing=False, log=lambda _: None)
    with pytest.raises(FileNotFoundError, match=r"no complete checkpoint for step 5; have \[6\]"):
        export_run(str(run), str(tmp_path / "o"), step=5, log=lambda _: None)
    model_only = tmp_path / "model-only"
    write_tiny_run(model_only, root / "base", MHAR(enable=False), seed=0, step=2)
    step_dir = model_only / "checkpoint" / "step-2"
    state = {k: v for k, v in load_run_checkpoint(str(model_only)).state_dict().items()}
    dcp.save(state, checkpoint_id=str(model_only / "checkpoint" / "step-3"), no_dist=True)
    with pytest.raises(ValueError, match="step-3: this checkpoint holds no weight EMA"):
        export_run(str(model_only), str(tmp_path / "o"), ema=True, log=lambda _: None)
    del state["norm.weight"]
    dcp.save(state, checkpoint_id=str(model_only / "checkpoint" / "step-4"), no_dist=True)
    with pytest.raises(ValueError, match=r"step-4: norm.weight: absent in the checkpoint, \(256,\) in the run's model"):
        export_run(str(model_only), str(tmp_path / "o"), log=lambda _: None)
    write_manifest(str(step_dir), 0)
    shard = next(p for p in step_dir.iterdir() if p.suffix == ".distcp")
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"damaged checkpoint: .*__0_0\.distcp: xxh3_128"):
        export_run(str(model_only), str(tmp_path / "damaged"), step=2, log=lambda _: None)
    assert sorted(os.listdir(tmp_path)) == ["model-only"]  # nothing written, no temporary folder left


def test_export_check_reads_the_export_back_through_transformers(tmp_path, capsys):
    """The size-true check's own logic on the tiny flavor: it fails unless transformers' fp32 logits are
    within 1e-5 of ours, its bf16 error is within twice ours, and cached generation matches ours."""
    hf_export_check.main(["--workdir", str(tmp_path), "--tokens", "64"])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["ok"] and result["hf_class"] == "MHARLlamaForCausalLM"
    assert 0 < result["export_cpu"]["peak_host_gib"] < 4
