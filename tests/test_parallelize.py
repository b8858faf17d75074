"""MHAR's activation checkpointing and compile wrap the blocks' bodies: the routing runs once per
step in every AC mode, and every number is that of the unwrapped model."""

import copy

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
    forward = rt.fwd_launcher
    monkeypatch.setattr(rt, "fwd_launcher", lambda *a, **k: (launches.append(1), forward(*a, **k)))
    wrapped = run(model, tokens)
    assert len(launches) == base.n_layers  # a layer's two sites in one pass, once: never recomputed
    for a, b in zip(plain, wrapped, strict=True):
        assert torch.equal(a, b)
