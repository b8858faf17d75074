"""HF checkpoints inside the 2-rank FSDP2 trainer: graft-aware load, ledger, first-step loss, export CLI."""

import json
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import REPO, torchrun
from safetensors.torch import load_file
from test_hf import hf_config
from torchtitan.components.tokenizer import HuggingFaceTokenizer
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from data.loader import ParquetDataLoader, data_config, source_shards
from mhar_titan.components.tensorboard_scalars import read_scalars
from mhar_titan.config import parse_config
from mhar_titan.hf import __main__ as hf_cli
from mhar_titan.hf.ledger import read_json
from mhar_titan.hf.load import load_hf_model
from mhar_titan.hf.run import load_run_checkpoint

SEQ, BATCH = 64, 2


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A random tiny Llama-3.1 over the demo tokenizer, sharded safetensors."""
    torch.manual_seed(0)
    config = hf_config(vocab_size=2048, bos_token_id=0)  # the demo tokenizer's vocabulary
    path = tmp_path_factory.mktemp("hf") / "base"
    LlamaForCausalLM(config).save_pretrained(path, max_shard_size="60KB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(REPO / "assets" / "tiny" / name, path / name)
    return path


def first_step_loss(path) -> float:
    """The trainer's first global loss, recomputed on one process from the same batches."""
    from data.loader import Encoder

    model = load_hf_model(str(path))
    encode = Encoder(HuggingFaceTokenizer(str(REPO / "assets" / "tiny")))
    cfg = data_config(parse_config(["--job.config_file", str(REPO / "configs/tiny_cpu.toml")]))
    total, count = 0.0, 0
    for rank in range(2):
        loader = ParquetDataLoader(cfg, source_shards(cfg), encode, SEQ, BATCH, rank, 2)
        batch, labels = next(iter(loader))
        inputs = batch["input"]
        with torch.no_grad():
            logits = model(inputs)
        total += F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum").item()
        count += labels.numel()
    return total / count


def from_base(base) -> list[str]:
    """One step from the HF base; its loss is then the base model's cross-entropy (no z-loss), and its
    update leaves every weight as loaded (the re-warmup's first LR is exactly 0)."""
    overrides = ["--model.flavor", "hf", "--model.hf_assets_path", str(base)]
    overrides += ["--checkpoint.initial_load_in_hf", "--checkpoint.initial_load_path", str(base)]
    overrides += ["--training.steps", "1", "--training.seq_len", str(SEQ), "--validation.seq_len", str(SEQ)]
    overrides += ["--training.local_batch_size", str(BATCH), "--mhar.num_heads", "4", "--mhar.num_blocks", "2"]
    return [*overrides, "--loss.z_loss", "0"]


@pytest.mark.parametrize("arm", ["control", "mhar"])
def test_distributed_hf_load_ledger_loss_and_export(base, tmp_path, arm):
    run = tmp_path / arm
    config = "configs/tiny_cpu.toml" if arm == "control" else "configs/tiny_cpu_mhar.toml"
    proc = torchrun(run, *from_base(base), config=config)
    log = proc.stdout + proc.stderr
    assert f"The run starts from the base {base} (HF safetensors) at step 0" in log

    ledger = json.loads((run / "load_ledger.json").read_text())
    assert not ledger["missing"] and not ledger["unused"] and not ledger["mismatched"]
    assert len(ledger["loaded"]) == 3 + 9 * 4
    assert len(ledger["initialised"]) == (0 if arm == "control" else 4 * 2 * 4)

    loss = read_scalars(run)[1]
    assert loss == pytest.approx(first_step_loss(base), rel=1e-5)

    # LR 0 at step 1: the step leaves every weight as loaded, so the export must give back the base exactly;
    # so must the EMA's, which starts from the weights loaded from HF (not from the random init).
    want = {}
    for shard in base.glob("*.safetensors"):
        want.update(load_file(shard))
    for which in ("raw", "ema"):
        out = tmp_path / f"export-{which}"
        hf_cli.main(["export", str(run), str(out), "--dtype", "fp32", *(["--ema"] if which == "ema" else [])])
        got = {}
        for shard in out.glob("*.safetensors"):
            got.update(load_file(shard))
        routing = {k for k in got if ".mhar." in k}
        assert len(routing) == (0 if arm == "control" else 4 * 2 * 4)
        assert set(got) - routing == set(want)
        for key, value in want.items():
            assert torch.equal(got[key], value), (which, key)
        for key in routing:
            assert torch.equal(
                got[key], torch.ones_like(got[key]) if key.endswith("norm_weight") else torch.zeros_like(got[key])
            )
    assert (out / "tokenizer.json").exists()


def test_the_base_is_loaded_with_periodic_checkpoints_off(base, tmp_path):
    run = tmp_path / "run"
    proc = torchrun(run, *from_base(base), "--checkpoint.no-enable")
    log = proc.stdout + proc.stderr
    assert f"The run starts from the base {base} (HF safetensors) at step 0" in log
    assert read_scalars(run)[1] == pytest.approx(first_step_loss(base), rel=1e-5)
    assert not (run / "checkpoint").exists()


def test_trained_mhar_export_loads_with_remote_code_and_matches(base, tmp_path):
    """A few high-LR steps open the gates; the export (`python -m mhar_titan.hf export`, as a user runs it; the
    tests above call its main), built by transformers from its own modeling files, computes the run's logits, and
    load_hf_model reads it back with its own settings."""
    run = tmp_path / "run"
    steps = ["--training.steps", "4", "--optimizer.lr", "0.05", "--lr_scheduler.warmup_steps", "1"]
    torchrun(run, *from_base(base), *steps, "--validation.no-enable", config="configs/tiny_cpu_mhar.toml")
    ours = load_run_checkpoint(str(run))
    gates = torch.cat([p.detach().flatten() for n, p in ours.named_parameters() if n.endswith("_routing.gate")])
    assert gates.abs().min() > 1e-3, gates

    out = tmp_path / "export"
    cmd = [sys.executable, "-m", "mhar_titan.hf", "export", str(run), str(out), "--dtype", "fp32"]
    subprocess.run(cmd, cwd=REPO, check=True, capture_output=True)
    assert read_json(str(out / "config.json"))["mhar"] == {"num_heads": 4, "num_blocks": 2, "variant": "delta"}
    theirs = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, dtype=torch.float32)
    tokens = torch.randint(0, 2048, (2, SEQ), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got, again = ours(tokens), theirs(tokens).logits, load_hf_model(str(out))(tokens)
    assert (got - want).abs().max() / want.abs().max() < 1e-5
    assert torch.equal(again, want)
