"""Is torch's attention backward repeatable bit for bit on this GPU, per SDPA backend, by default and under
torch's deterministic algorithms (what torchtitan's `--debug.deterministic` turns on), and what does the latter
cost? At the model's attention shape (the marin8b configs: 32 heads of 128, seq 4096, microbatch 2).

    python -m benchmarks.sdpa_determinism [--shapes 1,32,4096,128 2,32,4096,128] [--repeats 30]

Each (backend, mode) runs the causal forward and backward `--repeats` times on one set of inputs and counts the
repeats whose dq, dk or dv differ from the first; the median time of one forward and backward beside it. The
default backend is torch's own choice, as the model calls it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

BACKENDS = {
    "default": None,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
}


def measure(shape: tuple[int, ...], backend: SDPBackend | None, deterministic: bool, repeats: int) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_() for _ in "qkv")
    grad_out = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen)
    torch.use_deterministic_algorithms(deterministic)
    try:
        first, differing, times, worst = None, 0, [], 0.0
        for _ in range(repeats + 1):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with sdpa_kernel([backend]) if backend is not None else contextlib.nullcontext():
                start.record()
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                grads = torch.autograd.grad(out, (q, k, v), grad_out)
                end.record()
            torch.cuda.synchronize()
            if first is None:
                first = grads
                continue
            times.append(start.elapsed_time(end))
            if any(not torch.equal(a, b) for a, b in zip(first, grads, strict=True)):
                differing += 1
                worst = max(worst, (first[0].float() - grads[0].float()).abs().max().item())
        return {"differing": differing, "repeats": repeats, "max_dq_diff": worst, "median_ms": statistics.median(times)}
    except RuntimeError as e:
        return {"error": str(e).splitlines()[0][:200]}
    finally:
        torch.use_deterministic_algorithms(False)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", default=["1,32,4096,128", "2,32,4096,128"], help="BATCH,HEADS,SEQ,HEAD_DIM")
    p.add_argument("--repeats", type=int, default=30, help="forward and backward passes compared with the first")
    p.add_argument("--json", default=None, help="write every figure here")
    args = p.parse_args()
    rows = []
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}")
    print(f"{'shape':16} {'backend':10} {'mode':14} {'repeats differing':>18} {'max |ddq|':>10} {'ms':>8}")
    for text in args.shapes:
        shape = tuple(int(x) for x in text.split(","))
        for name, backend in BACKENDS.items():
            for deterministic in (False, True):
                r = {
                    "shape": text,
                    "backend": name,
                    "deterministic": deterministic,
                    **measure(shape, backend, deterministic, args.repeats),
                }
                rows.append(r)
                mode = "deterministic" if deterministic else "default"
                if "error" in r:
                    print(f"{text:16} {name:10} {mode:14} refused: {r['error']}")
                else:
                    print(
                        f"{text:16} {name:10} {mode:14} {r['differing']:>9} of {r['repeats']:<6} "
                        f"{r['max_dq_diff']:>10.3g} {r['median_ms']:>8.3f}"
                    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
