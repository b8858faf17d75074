"""Size-true check of the MHAR export: a run checkpoint of a flavor with open gates, exported by the CLI
(wall time and the exporting process's peak host memory), then read back by transformers with remote code
and compared with our model on the same tokens.

Two comparisons. In fp32, transformers and our model load the same exported weights: their logits must
agree to `--fp32-tol` relative to the largest logit (kernel order only). In bf16, transformers' model is
measured against our fp32 model with the unrounded weights, beside our own bf16 model measured the same
way: both are bf16 evaluations of one function with the same bf16 weights, so the HF model must be no
farther from the reference than `--bf16-factor` times ours. Greedy generation with the KV cache must
give the tokens of our model's greedy decoding without cache. Prints one JSON line.

    python -m benchmarks.hf_export_check --flavor marin8b --device cuda --workdir /tmp/hf-check
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed.checkpoint as dcp
import xxhash
from transformers import AutoModelForCausalLM

from mhar_titan.components.checkpoint import layout
from mhar_titan.components.checkpoint.checksums import write_manifest
from mhar_titan.hf.load import load_hf_model
from mhar_titan.model.args import FLAVORS, MHAR
from mhar_titan.model.model import build_initialised

# The exporting process reports its own peak resident memory: VmHWM of the exec'd process (ru_maxrss would
# include the parent's memory at fork time, and the parent holds the model's staging buffers).
_EXPORT = (
    "import re, runpy, sys; sys.argv = ['mhar_titan.hf', *sys.argv[1:]]\n"
    "try:\n    runpy.run_module('mhar_titan.hf', run_name='__main__')\n"
    "finally:\n    print('peak_rss_kib', re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read())[1])"
)


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def _greedy(forward, prompt: torch.Tensor, steps: int) -> list[int]:
    """Greedy decoding by full recomputation (no cache): the reference for generate()."""
    tokens = prompt
    for _ in range(steps):
        nxt = forward(tokens)[:, -1].argmax(-1, keepdim=True)
        tokens = torch.cat([tokens, nxt], dim=1)
    return tokens[0, prompt.shape[1] :].tolist()


def _folder_digest(path: str) -> dict[str, str]:
    out = {}
    for name in sorted(os.listdir(path)):
        h = xxhash.xxh3_128()
        with open(os.path.join(path, name), "rb") as f:
            while chunk := f.read(2**24):
                h.update(chunk)
        out[name] = h.hexdigest()
    return out


def write_run(run: str, flavor: str, num_blocks: int, device: torch.device, seed: int) -> dict[str, object]:
    """A run folder as train_cpt.py leaves it (model_args.json, one checksummed DCP step) with open gates."""
    args = dataclasses.replace(FLAVORS[flavor], mhar=MHAR(enable=True, num_blocks=num_blocks))
    torch.manual_seed(seed)
    model = build_initialised(args, device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "_routing." in name:
                p.copy_((1.0 if name.endswith("norm_weight") else 0.0) + 0.3 * torch.randn_like(p))
    began = time.perf_counter()
    step_dir = layout.step_dir(os.path.join(run, layout.FOLDER), 1)
    dcp.save(model.state_dict(), checkpoint_id=step_dir, no_dist=True)
    write_manifest(step_dir, 0)
    with open(os.path.join(run, "model_args.json"), "w") as f:
        json.dump({"hf_assets_path": None, "args": dataclasses.asdict(args)}, f)
    return {"model": model, "save_s": round(time.perf_counter() - began, 1)}


def export(run: str, out: str, device: str) -> dict[str, object]:
    began = time.perf_counter()
    cmd = [sys.executable, "-c", _EXPORT, "export", run, out, "--dtype", "bf16", "--device", device]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"export failed:\n{done.stdout}\n{done.stderr}")
    peak = int(done.stdout.split("peak_rss_kib")[-1])
    return {"s": round(time.perf_counter() - began, 1), "peak_host_gib": round(peak / 2**20, 2)}


def check(flavor: str, device: str, tokens: int, num_blocks: int, workdir: str, export_devices: list[str]) -> dict:
    dev = torch.device(device)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    result: dict[str, object] = {"flavor": flavor, "device": str(dev), "tokens": tokens, "num_blocks": num_blocks}
    run, out = os.path.join(workdir, "run"), os.path.join(workdir, "export")
    written = write_run(run, flavor, num_blocks, dev, seed=0)
    model, result["dcp_save_s"] = written["model"], written["save_s"]
    _progress(f"run checkpoint written in {result['dcp_save_s']} s")
    result["parameters"] = sum(p.numel() for p in model.parameters())
    gen = torch.Generator().manual_seed(1)
    batch = torch.randint(0, model.model_args.vocab_size, (1, tokens), generator=gen).to(dev)
    with torch.no_grad():
        reference = model(batch).float().cpu()
        model._apply(lambda t: t.to(torch.bfloat16) if t.is_floating_point() else t)
        ours_bf16 = model(batch).float().cpu()
    del model
    torch.cuda.empty_cache() if dev.type == "cuda" else None

    digests = {}
    for i, export_device in enumerate(export_devices):
        target = out if i == len(export_devices) - 1 else f"{out}-{export_device}"
        result[f"export_{export_device}"] = export(run, target, export_device)
        _progress(f"export on {export_device}: {result[f'export_{export_device}']}")
        digests[export_device] = _folder_digest(target)
        if target != out:
            shutil.rmtree(target)
    result["exports_identical"] = all(d == digests[export_devices[0]] for d in digests.values())

    began = time.perf_counter()
    hf = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, dtype=torch.bfloat16).to(dev).eval()
    _sync(dev)
    result["hf_load_bf16_s"] = round(time.perf_counter() - began, 1)
    result["hf_class"] = type(hf).__name__
    _progress(f"transformers loaded {result['hf_class']} in bf16 in {result['hf_load_bf16_s']} s")
    with torch.no_grad():
        hf_bf16 = hf(batch).logits.float().cpu()
    del hf
    hf = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, dtype=torch.float32).to(dev).eval()
    ours = load_hf_model(out, dtype=torch.float32, device=dev).eval()
    with torch.no_grad():
        hf_fp32, ours_fp32 = hf(batch).logits.float().cpu(), ours(batch).float().cpu()
        prompt = batch[:, :16]
        cached = hf.generate(prompt, max_new_tokens=8, do_sample=False, use_cache=True, pad_token_id=0)
        result["generate_cached"] = cached[0, 16:].tolist()
        result["greedy_ours"] = _greedy(ours, prompt, 8)
    result["fp32_rel_err"] = _rel(hf_fp32, ours_fp32)
    result["bf16_rel_err_hf"] = _rel(hf_bf16, reference)
    result["bf16_rel_err_ours"] = _rel(ours_bf16, reference)
    result["bf16_argmax_agree_hf"] = (hf_bf16.argmax(-1) == reference.argmax(-1)).float().mean().item()
    result["bf16_argmax_agree_ours"] = (ours_bf16.argmax(-1) == reference.argmax(-1)).float().mean().item()
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--flavor", default="tiny", help="a built-in architecture (tiny, marin8b, ...; default tiny)")
    parser.add_argument("--device", default="cpu", help="where the models run")
    parser.add_argument("--export-devices", default="cpu", help="comma-separated --device values for the export")
    parser.add_argument("--tokens", type=int, default=256, help="sequence length of the compared batch")
    parser.add_argument("--num-blocks", type=int, default=2, help="[mhar] num_blocks of the run (default 2)")
    parser.add_argument(
        "--fp32-tol", type=float, default=1e-5, help="fp32 logits: largest difference / largest logit (default 1e-5)"
    )
    parser.add_argument(
        "--bf16-factor", type=float, default=2.0, help="bf16: HF's error may be this many times ours (default 2)"
    )
    parser.add_argument("--workdir", default=None, help="where the run and the export go (default: a temp dir)")
    args = parser.parse_args(argv)
    workdir = args.workdir or tempfile.mkdtemp(prefix="hf-export-check-")
    os.makedirs(workdir, exist_ok=True)
    try:
        devices = args.export_devices.split(",")
        result = check(args.flavor, args.device, args.tokens, args.num_blocks, workdir, devices)
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    failures = []
    if result["fp32_rel_err"] > args.fp32_tol:
        failures.append(f"fp32: {result['fp32_rel_err']:.2e} > {args.fp32_tol:.0e}")
    if result["bf16_rel_err_hf"] > args.bf16_factor * result["bf16_rel_err_ours"]:
        failures.append(
            f"bf16: HF {result['bf16_rel_err_hf']:.2e} > {args.bf16_factor} x ours {result['bf16_rel_err_ours']:.2e}"
        )
    if result["generate_cached"] != result["greedy_ours"]:
        failures.append("generate with the KV cache differs from our greedy decoding")
    if not result["exports_identical"]:
        failures.append("exports on different devices differ")
    result["ok"] = not failures
    print(json.dumps(result))
    if failures:
        raise SystemExit("; ".join(failures))


if __name__ == "__main__":
    main(sys.argv[1:])
