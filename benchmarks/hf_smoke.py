"""Size-true smoke of the HF path: a random HF checkpoint of a flavor, written, loaded into the
control and into the MHAR model, and the two models' logits compared bit for bit.

With every gate at 0 the MHAR model computes the base model exactly, so the logits must be
identical. Prints one JSON line: write and load times, peak device memory per load, and the
comparison. On one H200: `python -m benchmarks.hf_smoke --flavor marin8b --device cuda`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time

import torch

from mhar_titan.hf.export import init_hf
from mhar_titan.hf.files import DTYPES
from mhar_titan.hf.load import load_hf_model
from mhar_titan.model.args import MHAR


def _peak_gib(device: torch.device) -> float | None:
    return round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def smoke(flavor: str, device: str, dtype: str, tokens: int, num_blocks: int, workdir: str) -> dict[str, object]:
    dev = torch.device(device)
    out: dict[str, object] = {"flavor": flavor, "device": str(dev), "dtype": dtype}
    path = f"{workdir}/base"
    start = time.perf_counter()
    init_hf(path, flavor, dtype=DTYPES[dtype], device=dev)
    out["write_s"] = round(time.perf_counter() - start, 1)
    logits = {}
    for arm, mhar in (("control", None), ("mhar", MHAR(enable=True, num_blocks=num_blocks))):
        _reset_peak(dev)
        start = time.perf_counter()
        model = load_hf_model(path, mhar=mhar, dtype=DTYPES[dtype], device=dev)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        out[f"{arm}_load_s"] = round(time.perf_counter() - start, 1)
        out[f"{arm}_load_peak_gib"] = _peak_gib(dev)
        out[f"{arm}_parameters"] = sum(p.numel() for p in model.parameters())
        if arm == "control":
            batch = torch.randint(0, model.model_args.vocab_size, (1, tokens), device=dev)
        with torch.no_grad():
            logits[arm] = model(batch).float().cpu()
        out[f"{arm}_forward_peak_gib"] = _peak_gib(dev)
        del model
    out["tokens"] = tokens
    out["logits_identical"] = torch.equal(logits["control"], logits["mhar"])
    out["max_abs_diff"] = (logits["control"] - logits["mhar"]).abs().max().item()
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--flavor", default="tiny", help="a built-in architecture (tiny, marin8b, ...; default tiny)")
    parser.add_argument("--device", default="cpu", help="where the models are loaded: cpu, cuda (default cpu)")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="bf16", help="the checkpoint's and models' dtype")
    parser.add_argument("--tokens", type=int, default=512, help="sequence length of the compared batch")
    parser.add_argument("--num-blocks", type=int, default=8, help="[mhar] num_blocks of the MHAR model")
    parser.add_argument("--workdir", default=None, help="where the checkpoint is written (default: a temp dir)")
    args = parser.parse_args(argv)
    workdir = args.workdir or tempfile.mkdtemp(prefix="hf-smoke-")
    try:
        result = smoke(args.flavor, args.device, args.dtype, args.tokens, args.num_blocks, workdir)
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    print(json.dumps(result))
    if not result["logits_identical"]:
        raise SystemExit("MHAR at init does not reproduce the control's logits")


if __name__ == "__main__":
    main()
