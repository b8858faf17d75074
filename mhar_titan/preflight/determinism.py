"""Whether the attention backward is repeatable bit for bit on this rank, by default and under torch's deterministic
algorithms (torchtitan's `--debug.deterministic`), and what the latter costs: the one kernel of the training step
that torch runs nondeterministically by default on GPUs (cuDNN's and flash attention's backward accumulate with
atomics). Reported by stage b for the user; stage d does not read it: a few repeats agree by chance on an H100, so
stage d measures the spread of its own job instead (verdicts.resume_verdict)."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.nn.functional as F

RUNS = 6  # the first call may pick its algorithm; every later run is compared with it


def _repeats(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad_out: torch.Tensor) -> dict[str, Any]:
    """RUNS forward and backward passes on the same inputs: which outputs differ from the first run's, in how many
    runs, by how much in dq, and the median time of one pass."""
    runs, times = [], []
    for _ in range(RUNS):
        if q.is_cuda:
            torch.cuda.synchronize()
        began = time.perf_counter()
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        grads = torch.autograd.grad(out, (q, k, v), grad_out)
        if q.is_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - began)
        runs.append((out.detach(), *grads))
    names = ("out", "dq", "dk", "dv")
    differing = [r for r in runs[1:] if any(not torch.equal(runs[0][i], r[i]) for i in range(4))]
    return {
        "bitwise": not differing,
        "differ": sorted({names[i] for r in runs[1:] for i in range(4) if not torch.equal(runs[0][i], r[i])}),
        "runs_differing": len(differing),
        "runs": RUNS - 1,
        "max_dq_diff": max((runs[0][1].float() - r[1].float()).abs().max().item() for r in runs[1:]),
        "dq_scale": runs[0][1].float().abs().max().item(),
        "median_ms": 1e3 * sorted(times[1:])[len(times[1:]) // 2],
    }


def attention_repeatable(batch: int, heads: int, seq: int, head_dim: int, device: torch.device) -> dict[str, Any]:
    """torch's scaled_dot_product_attention (causal, as the model calls it) in the training dtype (bf16 on GPUs,
    fp32 on CPU), RUNS times by default and RUNS times under deterministic algorithms: the default mode's figures at
    the top level, the deterministic mode's under "deterministic" (or its error, where torch refuses)."""
    began = time.perf_counter()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator(device=device).manual_seed(0)
    shape = (batch, heads, seq, head_dim)
    q, k, v = (torch.randn(shape, device=device, dtype=dtype, generator=gen).requires_grad_() for _ in range(3))
    grad_out = torch.randn(shape, device=device, dtype=dtype, generator=gen)
    was, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    record: dict[str, Any] = {
        "shape": list(shape),
        "dtype": str(dtype).removeprefix("torch."),
        "deterministic_algorithms": was,
        **_repeats(q, k, v, grad_out),
    }
    try:
        torch.use_deterministic_algorithms(True)
        record["deterministic"] = _repeats(q, k, v, grad_out)
    except RuntimeError as e:  # torch refuses a kernel it has no deterministic version of
        record["deterministic"] = {"error": str(e).splitlines()[0][:300]}
    finally:
        torch.use_deterministic_algorithms(was, warn_only=warn_only)
    record["seconds"] = time.perf_counter() - began
    return record
