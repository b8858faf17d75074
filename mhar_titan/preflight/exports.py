"""Stage g of the preflight: both arms' checkpoints at step N (raw and EMA weights) exported as HF folders and
read back by transformers on the device, against the trainer's own model on the same tokens.

    python -m mhar_titan.preflight.exports PAIR OUT --step N --device cuda|cpu [--tokens 256] [--dtype bf16]
                                          [--arms control,mhar] [--json PATH]

Each of the four exports (OUT/<arm>-<weights>, in `--dtype`: fp32, or bf16 as users evaluate them) must load as
what it is (the control as exactly
`LlamaForCausalLM`, the MHAR arm through its own modeling code as `MHARLlamaForCausalLM`, model_type
mhar_llama), give the logits of the trainer's model (the run's checkpoint read by `load_run_checkpoint`) on a
fixed batch, and `generate` with the KV cache the tokens of our greedy decoding without a cache.

The bound: max |HF - ours| / max |ours| <= 1e-5, as tests/test_hf.py and benchmarks/hf_export_check.py. Both
models compute in fp32 with the same weights (an fp32 export is a bit-exact copy of the checkpoint, the RoPE
permutation only reorders rows; of a bf16 export, transformers upcasts the stored values exactly and our model's
parameters are rounded to bf16 the same way), so they differ only in the order the kernels sum in (matmul tiling, the
attention backend, the norms): a few ulps per op, about 1e-7 relative after the layers. A wrong or misplaced
tensor moves the logits by O(1). TF32 would round matmul inputs to 10 bits (1e-3), so on CUDA it is off.

The folders stay in OUT for stage h (evaluate.py); the driver removes them. OUT/exports.json holds the
figures (`export_stage` reads it). Exit 0 when every check ran, whatever they found; on a crash the JSON gets
what was measured and an "error", and the exit is non-zero.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import shutil
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from data.atomic import write_text
from mhar_titan.eval.harness import one_line
from mhar_titan.hf.run import export_run, load_run_checkpoint
from mhar_titan.preflight.stages import Stage, failed, read_result

ARMS = ("control", "mhar")
WEIGHTS = ("raw", "ema")
BOUND = 1e-5  # fp32 logits, relative to the largest logit (see the docstring)
PROMPT, NEW_TOKENS, SEED, TOKENS = 16, 8, 0, 256
MHAR_CLASS, MHAR_TYPE = "MHARLlamaForCausalLM", "mhar_llama"
KEY, NAME = "g", "exports"
PROG = "python -m mhar_titan.preflight.exports"


@contextlib.contextmanager
def fp32_matmuls(device: torch.device) -> Iterator[None]:
    """fp32 means fp32 on CUDA while the checks run (TF32 would round matmul inputs to 10 bits: see the bound)."""
    if device.type != "cuda":
        yield
        return
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free(device: torch.device) -> None:
    """Give a dropped model's memory back before the next one is built (four fp32 models in turn)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def token_batch(folder: Path, model_vocab: int, tokens: int) -> tuple[torch.Tensor, int]:
    """The fixed batch (1, tokens): seeded ids below the tokenizer's vocabulary (the model's when the export has
    no tokenizer.json), so it is the same for all four exports of a pair."""
    vocab = model_vocab
    if (folder / "tokenizer.json").is_file():
        vocab = min(vocab, Tokenizer.from_file(str(folder / "tokenizer.json")).get_vocab_size())
    gen = torch.Generator().manual_seed(SEED)
    return torch.randint(0, vocab, (1, tokens), generator=gen), vocab


def greedy(forward: Callable[[torch.Tensor], torch.Tensor], prompt: torch.Tensor, steps: int) -> list[int]:
    """Greedy decoding by full recomputation (no cache): the reference for generate()."""
    seq = prompt
    for _ in range(steps):
        seq = torch.cat([seq, forward(seq)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return seq[0, prompt.shape[1] :].tolist()


def read_back(folder: Path, arm: str, batch: torch.Tensor, entry: dict[str, Any]) -> torch.Tensor:
    """transformers' model of the folder on the batch's device: its class checked, its logits on the batch and its
    cached greedy generation recorded in `entry`; the model is freed before returning the logits."""
    device = batch.device
    began = time.perf_counter()
    if arm == "control":
        hf = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32)
    else:
        hf = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32)
    hf = hf.to(device).eval()
    _sync(device)
    entry["load_seconds"] = round(time.perf_counter() - began, 2)
    entry["class"], entry["model_type"] = type(hf).__name__, hf.config.model_type
    if arm == "control":
        entry["class_ok"] = type(hf) is LlamaForCausalLM
    else:
        entry["class_ok"] = entry["class"] == MHAR_CLASS and entry["model_type"] == MHAR_TYPE
    with torch.no_grad():
        logits = hf(batch, use_cache=False).logits.float()
        out = hf.generate(
            batch[:, :PROMPT],
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            use_cache=True,
            eos_token_id=None,  # no stop at an end-of-text token: all NEW_TOKENS are compared
            pad_token_id=0,
        )
    entry["generated"] = out[0, PROMPT:].tolist()
    del hf, out
    _free(device)
    return logits


def check_export(
    pair: Path,
    out: Path,
    arm: str,
    weights: str,
    step: int,
    device: torch.device,
    tokens: int,
    entry: dict[str, Any],
    dtype: torch.dtype = torch.float32,
) -> None:
    """One export written, read back and compared; `entry` is filled as it goes (a crash keeps what was measured)."""
    run, folder = pair / arm, out / f"{arm}-{weights}"
    shutil.rmtree(folder, ignore_errors=True)  # an earlier preflight's, into the same OUT
    began = time.perf_counter()
    # The checkpoint's files are verified against their checksums once per arm, by its first export: the EMA's
    # export reads the same files.
    export_run(
        str(run),
        str(folder),
        step=step,
        ema=weights == "ema",
        dtype=dtype,
        verify=weights == WEIGHTS[0],
        log=lambda line: print(f"[exports] {arm}-{weights}: {line}", flush=True),
    )
    entry["export_seconds"] = round(time.perf_counter() - began, 2)
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    batch, entry["token_ids_below"] = token_batch(folder, vocab, tokens)  # the same batch for both models
    batch = batch.to(device)
    theirs = read_back(folder, arm, batch, entry)

    began = time.perf_counter()
    ours = load_run_checkpoint(str(run), step, ema=weights == "ema", device=device).eval()
    with torch.no_grad():  # the export's rounding, then fp32 arithmetic as transformers' upcast model
        for p in ours.parameters():
            p.copy_(p.to(dtype).float())
    _sync(device)
    entry["ours_load_seconds"] = round(time.perf_counter() - began, 2)
    with torch.no_grad():
        want = ours(batch).float()
        entry["greedy"] = greedy(ours, batch[:, :PROMPT], NEW_TOKENS)
    del ours
    _free(device)
    rel = ((theirs - want).abs().max() / want.abs().max()).item()
    entry["logits_rel_diff"] = rel if math.isfinite(rel) else None  # NaN/inf: no figure, a FAIL
    entry["logits_ok"] = math.isfinite(rel) and rel <= BOUND
    entry["generate_equal"] = entry["generated"] == entry["greedy"]
    entry["ok"] = entry["class_ok"] and entry["logits_ok"] and entry["generate_equal"]


def run_checks(
    pair: Path,
    out: Path,
    step: int,
    device: torch.device,
    tokens: int,
    path: Path,
    arms: tuple[str, ...] = ARMS,
    dtype: torch.dtype = torch.float32,
) -> dict[str, Any]:
    """The exports checked in turn; the JSON written at the end, or with an "error" on a crash."""
    result: dict[str, Any] = {
        "pair": str(pair),
        "out": str(out),
        "step": step,
        "device": str(device),
        "tokens": tokens,
        "prompt_tokens": PROMPT,
        "new_tokens": NEW_TOKENS,
        "bound": BOUND,
        "dtype": str(dtype).removeprefix("torch."),
        "tf32": False if device.type == "cuda" else None,
        "exports": {},
    }
    name = "setup"
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        for arm in arms:
            for weights in WEIGHTS:
                name = f"{arm}-{weights}"
                print(f"[exports] {name}: export step {step}, read back on {device}", flush=True)
                entry = result["exports"][name] = {"arm": arm, "weights": weights, "folder": str(out / name)}
                entry |= {"bound": BOUND, "ok": False}
                check_export(pair, out, arm, weights, step, device, tokens, entry, dtype)
        result["ok"] = all(e["ok"] for e in result["exports"].values())
    except BaseException as e:
        result["ok"] = False
        result["error"] = f"{name}: {'interrupted' if isinstance(e, KeyboardInterrupt) else one_line(e)}"
        raise
    finally:
        write_text(path, json.dumps(result, indent=2) + "\n")
    return result


def merge(paths: list[Path], path: Path) -> None:
    """One arm's results after the other (the preflight exports each arm as soon as it is trained, then frees its
    checkpoints) as one result file."""
    parts = [json.loads(p.read_text()) for p in paths]
    result = {**parts[0], "exports": {k: v for part in parts for k, v in part["exports"].items()}}
    result["ok"] = all(part.get("ok") for part in parts)
    errors = [part["error"] for part in parts if part.get("error")]
    if errors:
        result["error"] = "; ".join(errors)
    write_text(path, json.dumps(result, indent=2) + "\n")


def _f(x: float | None, fmt: str = ".1e") -> str:
    return "-" if x is None else format(x, fmt)


def _row(name: str, e: dict[str, Any]) -> str:
    cls = e.get("class", "-") + ("" if e.get("class_ok", True) else " (wrong)")
    rel = "-" if "logits_ok" not in e else "non-finite" if e["logits_rel_diff"] is None else _f(e["logits_rel_diff"])
    generate = {True: "equal", False: "differs", None: "-"}[e.get("generate_equal")]
    return (
        f"| {name} | {cls} | {_f(e.get('export_seconds'), '.1f')} s | {_f(e.get('load_seconds'), '.1f')} s | {rel} "
        f"| {_f(e.get('bound'), '.0e')} | {generate} | {'PASS' if e.get('ok') else 'FAIL'} |"
    )


def _problems(name: str, e: dict[str, Any]) -> list[str]:
    out = []
    if not e.get("class_ok", True):
        want = "LlamaForCausalLM" if e.get("arm") == "control" else f"{MHAR_CLASS} ({MHAR_TYPE})"
        out.append(f"{name}: read as {e.get('class')} ({e.get('model_type')}), not {want}")
    if "logits_ok" in e and not e["logits_ok"]:
        rel = e.get("logits_rel_diff")
        out.append(f"{name}: logits {'non-finite' if rel is None else f'{rel:.1e}'} > bound {e['bound']:.0e}")
    if e.get("generate_equal") is False:
        out.append(f"{name}: cached generate {e.get('generated')} != our greedy {e.get('greedy')}")
    return out


def export_stage(result_json_path: Path, seconds: float) -> Stage:
    """Stage g from OUT/exports.json: PASS iff all four exports loaded as their class, matched the trainer's
    logits within the bound and generated with the KV cache what our greedy decoding gives."""
    result = read_result(Path(result_json_path), KEY, NAME, PROG, "exports", seconds)
    if isinstance(result, Stage):
        return result
    exports = result.get("exports", {})
    bound = result.get("bound", BOUND)
    tf32 = "; TF32 off" if result.get("tf32") is False else ""
    details = [
        f"Both arms at step {result.get('step')}, raw and EMA weights, exported in {result.get('dtype', 'float32')} "
        f"to `{result.get('out')}` "
        f"and read back by transformers on {result.get('device')}, against the trainer's model (the run's "
        f"checkpoint) on one seeded batch of {result.get('tokens')} tokens: max |HF - ours| / max |ours| within "
        f"{bound:.0e} (fp32 arithmetic, the same weights: only the kernels' summation order differs{tf32}), and "
        f"`generate` with the KV cache ({result.get('new_tokens')} tokens, greedy) equal to our greedy decoding "
        "without a cache.",
        "",
        "| export | class | export | load | logits rel diff | bound | cached generate | result |",
        "|---|---|---|---|---|---|---|---|",
        *(_row(name, e) for name, e in exports.items()),
        "",
    ]
    problems = [p for name, e in exports.items() for p in _problems(name, e)]
    expected = [f"{a}-{w}" for a in ARMS for w in WEIGHTS]
    if result.get("error"):
        details += [
            f"The exports stopped: {result['error']}. Its traceback is in the log; rerun `{PROG} PAIR OUT --step "
            f"{result.get('step')} --device {result.get('device')}` alone to see it."
        ]
        return failed(KEY, NAME, result["error"], seconds, details)
    missing = [n for n in expected if n not in exports]
    if problems or missing or not all(exports[n].get("ok") for n in expected):
        details += [
            "What to do: a wrong class means the export's config.json (model_type, auto_map) or transformers "
            "(5.17 or newer) is off; logits beyond the bound or a different cached generation mean the HF "
            "modeling code (`mhar_titan/hf/modeling/`) or the export's tensor mapping "
            "(`mhar_titan/model/state_dict_adapter.py`) disagrees with the trainer's model: reproduce with "
            "`python -m benchmarks.hf_export_check --device cuda` and `pytest tests/test_hf_modeling.py`. Do not "
            "evaluate or publish the pair's exports until this passes."
        ]
        figure = "; ".join(problems + [f"{n}: not checked" for n in missing]) or "an export failed"
        return Stage(KEY, NAME, False, figure, seconds, details)
    worst = max(exports[n]["logits_rel_diff"] for n in expected)
    figure = f"{len(expected)} exports read back: logits within {worst:.1e} (bound {bound:.0e}), cached generate equal"
    return Stage(KEY, NAME, True, figure, seconds, details)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("pair", type=Path, help="the pair's folder, with control/ and mhar/ run folders")
    parser.add_argument("out", type=Path, help="where the exports go (OUT/<arm>-<weights>) and exports.json")
    parser.add_argument("--step", type=int, required=True, help="the checkpoint step both arms have")
    parser.add_argument("--device", default="cpu", help="where both models run: cuda or cpu (default cpu)")
    parser.add_argument("--tokens", type=int, default=TOKENS, help=f"length of the compared batch (default {TOKENS})")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="the exports' dtype (default fp32)")
    parser.add_argument("--arms", default=",".join(ARMS), help="the arms to export (default control,mhar)")
    parser.add_argument("--json", type=Path, default=None, help="the result file (default OUT/exports.json)")
    args = parser.parse_args(argv)
    arms = tuple(a for a in args.arms.split(",") if a)
    if not arms or set(arms) - set(ARMS):
        parser.error(f"--arms {args.arms!r}: control, mhar or control,mhar")
    if args.tokens < PROMPT:
        parser.error(f"--tokens {args.tokens}: at least {PROMPT} (the generation prompt)")
    device = torch.device(args.device)
    path = args.json or args.out / "exports.json"
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    try:
        with fp32_matmuls(device):
            result = run_checks(args.pair, args.out, args.step, device, args.tokens, path, arms, dtype)
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted (partial results in {path})", file=sys.stderr)
        sys.exit(130)
    except Exception:
        traceback.print_exc()
        sys.exit(f"{PROG}: {json.loads(path.read_text())['error']} (partial results in {path})")
    if arms == ARMS:
        print(export_stage(path, 0.0).figure)
    print(f"{PROG}: {'PASS' if result['ok'] else 'FAIL'}; {path}")


if __name__ == "__main__":
    main(sys.argv[1:])
