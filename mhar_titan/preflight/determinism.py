"""Whether the attention backward is repeatable bit for bit on this rank: the one kernel of the training step
that torch runs nondeterministically by default on GPUs (cuDNN's and flash attention's backward accumulate with
atomics). A resume that reproduces the first resumed step exactly but drifts in the last bits afterwards is
explained by it. torchtitan's `--debug.deterministic` switches torch to its deterministic algorithms, at a cost."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.nn.functional as F

RUNS = 3  # the first call may pick its algorithm; every pair of runs is compared


def attention_repeatable(batch: int, heads: int, seq: int, head_dim: int, device: torch.device) -> dict[str, Any]:
    """torch's scaled_dot_product_attention (causal, as the model calls it) forward and backward RUNS times on the
    same inputs, in the training dtype (bf16 on GPUs, fp32 on CPU): are the gradients identical?"""
    began = time.perf_counter()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator(device=device).manual_seed(0)
    shape = (batch, heads, seq, head_dim)
    q, k, v = (torch.randn(shape, device=device, dtype=dtype, generator=gen).requires_grad_() for _ in range(3))
    grad_out = torch.randn(shape, device=device, dtype=dtype, generator=gen)
    runs = []
    for _ in range(RUNS):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        runs.append((out.detach(), *torch.autograd.grad(out, (q, k, v), grad_out)))
    names = ("out", "dq", "dk", "dv")
    differ = sorted({names[i] for r in runs[1:] for i in range(4) if not torch.equal(runs[0][i], r[i])})
    diff = max((runs[0][1].float() - r[1].float()).abs().max().item() for r in runs[1:])
    return {
        "shape": list(shape),
        "dtype": str(dtype).removeprefix("torch."),
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "bitwise": not differ,
        "differ": differ,
        "max_dq_diff": diff,
        "dq_scale": runs[0][1].float().abs().max().item(),
        "seconds": time.perf_counter() - began,
    }
