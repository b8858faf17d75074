"""MHAR's activation checkpointing and compile wrap the blocks' bodies: the routing runs once per
step in every AC mode, and every number is that of the unwrapped model."""

import copy
import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import REPO
from tiny_runs import routed_tiny_model

import kernels.triton.launch as rt
from mhar_titan.config import parse_config
from mhar_titan.model.parallelize import wrap_blocks

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
AC = {
    "none": ["--activation_checkpoint.mode", "none"],
    "full": ["--activation_checkpoint.mode", "full"],
    "op": ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"],
    "layer": ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "2"],
}


@pytest.fixture(scope="module")
def tiny_mhar():
    """The model, its tokens, and the unwrapped model's output and gradients (every mode's reference)."""
    model = routed_tiny_model(seq=16, num_blocks=2, backend="triton", device=DEVICE)
    tokens = torch.randint(0, model.vocab_size, (1, 16), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    return model, tokens, run(copy.deepcopy(model), tokens)


def run(model, tokens):
    out = model(tokens)
    out.float().pow(2).mean().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return [out.detach(), *grads]


@pytest.mark.parametrize("mode", list(AC))
def test_routing_runs_once_per_step_under_every_ac_mode_with_the_same_numbers(tiny_mhar, mode, monkeypatch):
    base, tokens, plain = tiny_mhar
    model = copy.deepcopy(base)
    config = parse_config(["--job.config_file", str(REPO / "configs" / "tiny_cpu.toml"), *AC[mode]])
    wrap_blocks(model, config, compile_model=False)
    launches = []
    for name in ("fwd_launcher", "sites_launcher"):
        forward = getattr(rt, name)
        monkeypatch.setattr(rt, name, lambda *a, forward=forward, **k: (launches.append(1), forward(*a, **k)))
    wrapped = run(model, tokens)
    # a block's sites in passes of the table's `sites`, once: never recomputed
    per_pass, per_block = rt.DEFAULT_TABLES.fwd_sites[1]["sites"], base.model_args.layout.layers_per_block
    assert len(launches) == base.model_args.mhar.num_blocks * -(-2 * per_block // per_pass)
    for a, b in zip(plain, wrapped, strict=True):
        assert torch.equal(a, b)


def test_each_blocks_sites_are_one_fsdp_unit_and_train_as_the_unsharded_model(tmp_path):
    """Under FSDP2 (2 CPU ranks) the model routes a block's sites at its start, before its later layers'
    units are gathered: each block's sites form one unit of their own, no layer's unit holds a site, the
    parameter names stay the layers', and one forward and backward equal the unsharded model's."""
    out = tmp_path / "found.json"
    cmd = [
        *(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"),
        *(str(REPO / "tests" / "fsdp_routing.py"), str(out)),
    ]
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    found = json.loads(out.read_text())
    assert found["sites_are_units"] and found["blocks_apart"] and found["units_hold_sites_only"], found
    assert found["layers_hold_no_site"] and found["layers_hold_their_weights"], found
    assert found["unit_sizes"] == [16, 16, 16, 16], found  # 2 layers x 2 sites x (null, query, norm weight, gate)
    assert found["block_units_shared"] == [True, True], found
    assert found["names"][0].startswith("layers.0.attn_routing."), found
    assert found["output_error"] <= 1e-5 and found["site_grads_nonzero"], found
    name, err = found["worst_grad"]
    assert err <= 1e-4, found  # fp32, summed over 2 ranks in another order
