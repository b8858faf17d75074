"""`make bench-step`: the real training step of four arms at one geometry, side by side in one run.

- stock: torchtitan 0.2.2's own llama3 Trainer, loss and optimizer (mhar_titan/stock_titan.py);
- control: train_cpt.py with MHAR off (z-loss, EMA, grouped AdamW, our metrics);
- mhar_triton: MHAR with the fused Triton routing kernels;
- mhar_compile: MHAR with the plain routing (torch backend) compiled and checkpointed per site.

Each arm is its own torchrun job (FSDP2 on `--nproc` ranks) on the same data, reading back
tokens/s per device, MFU (torchtitan's formula: 6 x parameters + attention flops per token over
the device's peak bf16 flops) and peak active memory from its TensorBoard log, over the steps
after `--warmup`: throughput as tokens over time (a harmonic mean, so periodic work such as an
EMA update every 10 steps counts at its real share), memory as the peak. Default geometry: the
8B width cut to 16 layers (8 where the memory plan says the arms do not fit 16 on this GPU, as on an
80 GB H100; it prints which), seq 4096, microbatch 2, bf16 compute, per-block compile, EMA every 10
steps as in configs/marin8b_*.toml, and 8 MHAR blocks: over 16 layers that gives each site 2 to 9
sources, the same distribution as the marin8b configs' 8 blocks over 32 layers (one layer a block at 8). `--ac` runs the
arms under each activation-checkpointing mode asked for (full, selective: torchtitan's op-level
selective AC, none) and prints MHAR/control and control/stock for each mode. 30 timed steps by
default, three of them EMA and routing-statistics steps (their real share): with ten, two runs of
the same code differed by about the margin the ratios are held to (docs/performance.md).
`--smoke` runs the tiny flavor on CPU for a few steps (plumbing only, no speed figure).
`--float8` runs every arm with torchtitan's float8 converter (torchao's rowwise recipe, the output layer in bf16).
`--attention-mask causal,block_causal` runs every arm under each mask (block_causal: flex attention within
documents) on a corpus of documents of about `--doc-tokens` tokens, and prints block_causal/causal per arm.
`--profile` also traces each arm's last step with torchtitan's profiler (the two steps it
takes are left out of the throughput) and prints GPU time by kernel kind, arm beside arm.

    python -m benchmarks.bench_step [--arms stock,control,...] [--ac full,selective,none] [--num-blocks 8]
                                    [--steps 34] [--warmup 4] [--float8] [--profile]
                                    [--attention-mask causal,block_causal] [--doc-tokens 1024]
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from tokenizers import Tokenizer

from benchmarks.step_floor import print_floors
from benchmarks.trace_summary import gap_report, print_gaps, print_name_diff, print_side_by_side, summarise
from mhar_titan import plan
from mhar_titan.components.tensorboard_scalars import read_scalars
from mhar_titan.config import parse_config

REPO = Path(__file__).resolve().parents[1]
ARMS = {
    "stock": ["-m", "benchmarks.stock_titan", "--model.name", "llama3_stock"],
    "control": [str(REPO / "train_cpt.py")],
    "mhar_triton": [str(REPO / "train_cpt.py"), "--mhar.enable", "--mhar.backend", "triton"],
    "mhar_compile": [str(REPO / "train_cpt.py"), "--mhar.enable", "--mhar.backend", "torch"],
}
# (ours, stock) TensorBoard tags; None: not logged by that arm
TAGS = {
    "tokens_per_s": ("tokens_per_s", "throughput(tps)", "rate"),
    "mfu": ("mfu", "mfu(%)", "rate"),
    "peak_active_gib": ("memory/peak_active_gib", "memory/max_active(GiB)", "peak"),
    "after_forward_gib": ("memory/after_forward_gib", None, "peak"),
    "after_backward_gib": ("memory/after_backward_gib", None, "peak"),
    "after_optimizer_gib": ("memory/after_optimizer_gib", None, "peak"),
}
FLAVOR = "marin8b_16l"
DEPTHS = {16: "marin8b_16l", 8: "marin8b_8l"}  # the cuts of the 8B the bench runs, deepest first
MARGIN = 0.1  # the memory plan's default margin
GPU = [
    *("--training.seq_len", "4096", "--training.local_batch_size", "2"),
    *("--training.mixed_precision_param", "bfloat16", "--optimizer.implementation", "fused"),
    *("--compile.enable", "--compile.components", "model,loss"),
    *("--ema.beta", "0.999", "--ema.every", "10"),  # as in configs/marin8b_*.toml
]
TOKENS = 4096 * 2  # a device's tokens a step at GPU's seq_len and local_batch_size
SMOKE_TAGS = ("tokens_per_s", "mfu", "peak_active_gib")  # on a CPU there are no phase memory figures
SMOKE = ["--model.flavor", "tiny", "--training.seq_len", "128", "--training.local_batch_size", "2"]
NUM_BLOCKS = {False: 8, True: 2}  # keyed by smoke: the tiny flavor has 4 layers
# torchtitan's float8 converter (torchao), every linear layer but the output: --float8 adds it to every arm
FLOAT8 = [
    *("--model.converters", "quantize.linear.float8", "--quantize.linear.float8.recipe_name", "rowwise"),
    *("--quantize.linear.float8.filter_fqns", "output"),
]
MASKS = ("causal", "block_causal")
AC_MODES = {
    "full": ["--activation_checkpoint.mode", "full"],
    "selective": ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"],
    "none": ["--activation_checkpoint.mode", "none"],
}


def arm_command(
    arm: str,
    run: Path,
    nproc: int,
    steps: int,
    smoke: bool,
    profile: bool = False,
    ac: str = "full",
    num_blocks: int | None = None,
    flavor: str = FLAVOR,
    extra: tuple[str, ...] = (),
) -> list[str]:
    common = [
        *("--job.config_file", str(REPO / "configs" / "tiny_cpu.toml"), "--job.dump_folder", str(run)),
        *("--job.custom_config_module", "mhar_titan.config", "--training.steps", str(steps)),
        *("--lr_scheduler.warmup_steps", "2", "--lr_scheduler.total_steps", str(steps), "--metrics.log_freq", "1"),
        *("--checkpoint.no-enable", "--validation.no-enable"),
        *AC_MODES[ac],
    ]
    geometry = SMOKE if smoke else ["--model.flavor", flavor, *GPU]
    if arm != "stock":  # torchtitan's own model knows no [mhar]
        blocks = NUM_BLOCKS[smoke] if num_blocks is None else num_blocks
        geometry = [*geometry, "--mhar.num_blocks", str(blocks)]
    if profile:  # trace the last step, after one profiler warm-up step
        geometry = [
            *geometry,
            *("--profiling.enable_profiling", "--profiling.profile_freq", str(steps)),
            *("--profiling.profiler_warmup", "1", "--profiling.profiler_active", "1"),
        ]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    return [*launcher, *ARMS[arm], *common, *geometry, *extra]


def document_corpus(out: Path, mean_tokens: int, tokens: int, seed: int = 0) -> tuple[list[str], float]:
    """Shards of documents of `mean_tokens` tokens on average (uniform in [mean/2, 3 mean/2]), the demo's texts
    joined: how sparse a block-causal mask is depends on the documents per window, and the demo's are ~190
    tokens. The --data overrides that train on them (the demo configs' two sources) and the mean measured."""
    tokenizer = Tokenizer.from_file(str(REPO / "assets" / "tiny" / "tokenizer.json"))
    shards = sorted((REPO / "assets" / "tiny").glob("*/*.parquet"))  # the demo's corpus and code
    texts = [t for path in shards for t in pq.read_table(path, columns=["text"]).column("text").to_pylist() if t]
    sizes = [len(ids) for ids in (e.ids for e in tokenizer.encode_batch(texts))]
    rng, docs, total, k = random.Random(seed), [], 0, 0
    while total < tokens:
        want, parts, have = rng.randint(mean_tokens // 2, 3 * mean_tokens // 2), [], 0
        while have < want:
            parts.append(texts[k % len(texts)])
            have, k = have + sizes[k % len(texts)], k + 1
        docs.append(tokenizer.decode(tokenizer.encode("\n\n".join(parts)).ids[:want]))  # cut to its length
        total += want
    mixture = []
    for name in ("docstrings", "code"):
        folder = out / "documents" / name
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(4):  # a shard for each of the configs' 4 streams
            pq.write_table(pa.table({"text": docs[i::4], "source": [name] * len(docs[i::4])}), folder / f"{i}.parquet")
        mixture.append(f"{name}={0.7 if name == 'docstrings' else 0.3}:{folder}")
    measured = statistics.mean(len(e.ids) + 1 for e in tokenizer.encode_batch(docs))  # + its eos
    return ["--data.mixture", ",".join(mixture)], measured


def gpu_memory() -> float | None:
    """The first GPU's total memory (bytes) from nvidia-smi, or None without one: this process makes no CUDA
    context, which would take memory from the arms."""
    try:
        done = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        )
        return float(done.stdout.split()[0]) * 2**20
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def fitting_flavor(
    modes: list[str], nproc: int, memory: float, num_blocks: int | None, float8: bool
) -> tuple[str, str]:
    """The deepest cut of DEPTHS at which the control and MHAR arms both fit every AC mode asked for, by the
    memory plan (mhar_titan.plan, its default margin), so that every arm and mode runs at one depth; and a line
    saying which and why. An error where not even the shallowest fits."""
    args = [
        *("--job.config_file", str(REPO / "configs" / "tiny_cpu.toml"), "--model.flavor", FLAVOR),
        *GPU,
        *("--mhar.num_blocks", str(num_blocks or NUM_BLOCKS[False])),
        *(FLOAT8 if float8 else []),
    ]
    with plan.quiet():
        cfg = parse_config(args)
    fits = {mode: plan.deepest_fit(cfg, nproc, memory, MARGIN, mode) for mode in modes}
    depth = min((layers or 0) for layers, _ in fits.values())
    usable = [d for d in DEPTHS if d <= depth]
    if not usable:
        worst = max(fits, key=lambda m: max(fits[m][1]["control"], fits[m][1]["mhar"]))
        peaks = fits[worst][1]
        raise ValueError(
            f"a GPU of {memory / plan.GIB:.1f} GiB holds no cut of the 8B in AC mode {worst}: at {peaks['layers']} "
            f"layers the control and MHAR arms need {peaks['control']:.1f} and {peaks['mhar']:.1f} GiB, over the "
            f"{peaks['budget_gib']:.1f} GiB budget"
        )
    layers = usable[0]
    peaks = ", ".join(f"{m} {max(fits[m][1]['control'], fits[m][1]['mhar']):.1f}" for m in modes)
    return DEPTHS[layers], (
        f"{DEPTHS[layers]} ({layers} layers): the deepest cut at which both arms fit AC {','.join(modes)} on this "
        f"GPU's {memory / plan.GIB:.1f} GiB by the memory plan (the larger arm's peak at the deepest fit: {peaks} "
        f"GiB; budget {fits[modes[0]][1]['budget_gib']:.1f} GiB)"
    )


def aggregate(series: dict[int, float], warmup: int, how: str, last: int | None = None) -> float:
    """Over the steps after `warmup` (up to `last`): "rate" -> harmonic mean (every step has the
    same tokens, so this is total tokens over total time), "peak" -> max."""
    timed = [v for step, v in series.items() if step > warmup and (last is None or step <= last)]
    if not timed:
        raise ValueError(f"no steps after the {warmup} warm-up steps")
    return statistics.harmonic_mean(timed) if how == "rate" else max(timed)


def run_arm(
    arm: str,
    out: Path,
    nproc: int,
    steps: int,
    warmup: int,
    smoke: bool,
    profile: bool = False,
    ac: str = "full",
    num_blocks: int | None = None,
    flavor: str = FLAVOR,
    extra: tuple[str, ...] = (),
) -> dict[str, float]:
    run = out / arm
    shutil.rmtree(run, ignore_errors=True)
    cmd = arm_command(arm, run, nproc, steps, smoke, profile, ac, num_blocks, flavor, extra)
    print(f"[{ac}/{arm}] {' '.join(cmd)}", flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    if smoke:  # the Triton kernels run in Triton's interpreter on a CPU
        env.setdefault("TRITON_INTERPRET", "1")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    (out / f"{arm}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"[{arm}] exited {proc.returncode}; log in {out / f'{arm}.log'}:\n{proc.stderr[-3000:]}")
    which = 1 if arm == "stock" else 0
    last = steps - 2 if profile else None
    rates = read_scalars(run, TAGS["tokens_per_s"][which])  # by step: steps that do more (EMA, statistics) show
    by_step = ", ".join(f"{k} {v:,.0f}" for k, v in sorted(rates.items()) if k > warmup)
    print(f"[{ac}/{arm}] tokens/s by step: {by_step}")
    return {
        name: aggregate(read_scalars(run, tags[which]), warmup, tags[2], last)
        for name, tags in TAGS.items()
        if tags[which] is not None and (not smoke or name in SMOKE_TAGS)
    }


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated arms to run, of {', '.join(ARMS)}")
    parser.add_argument("--ac", default="full", help=f"activation-checkpointing modes to run: {', '.join(AC_MODES)}")
    parser.add_argument("--num-blocks", type=int, default=None, help="[mhar] num_blocks (default 8; 2 with --smoke)")
    parser.add_argument(
        "--flavor",
        default=None,
        help=f"model flavor on a GPU: {', '.join(DEPTHS.values())} (default: the deepest at which both arms fit every "
        "--ac mode on this GPU, by the memory plan; it says which)",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help="default 34 (with --warmup 4: 30 timed steps, 3 of them EMA and statistics steps); 14 with --smoke",
    )
    parser.add_argument("--warmup", type=int, default=4, help="steps left out of the figures (compile, caches)")
    parser.add_argument("--nproc", type=int, default=1, help="GPUs (torchrun processes, FSDP ranks) per arm")
    parser.add_argument("--out", default="runs/bench-step", help="folder for the arms' runs and logs")
    parser.add_argument("--smoke", action="store_true", help="tiny flavor on CPU: the plumbing, not a speed")
    parser.add_argument("--profile", action="store_true", help="trace each arm's last step; GPU time by kernel kind")
    parser.add_argument("--float8", action="store_true", help="every arm with torchtitan's float8 converter (rowwise)")
    parser.add_argument(
        "--attention-mask",
        default="causal",
        help=f"attention masks to run every arm under: {', '.join(MASKS)} (more than one, or block_causal: on a corpus "
        "of documents of about --doc-tokens tokens)",
    )
    parser.add_argument("--doc-tokens", type=int, default=1024, help="mean document length for --attention-mask")
    return parser


def _parse(argv: list[str] | None) -> tuple[argparse.Namespace, list[str], list[str]]:
    """The arguments, the arms and the AC modes, refused (exit 2) before any arm runs; --steps defaulted."""
    parser = _parser()
    args = parser.parse_args(argv)
    arms = args.arms.split(",")
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        parser.error(f"unknown arms {unknown}; choose from {', '.join(ARMS)}")
    modes = args.ac.split(",")
    if [m for m in modes if m not in AC_MODES]:
        parser.error(f"--ac {args.ac}: choose from {', '.join(AC_MODES)}")
    args.masks = args.attention_mask.split(",")
    if [m for m in args.masks if m not in MASKS]:
        parser.error(f"--attention-mask {args.attention_mask}: choose from {', '.join(MASKS)}")
    if "stock" in arms and "block_causal" in args.masks:
        parser.error("--attention-mask block_causal: the stock arm is torchtitan's llama3, which has no such setting")
    if args.doc_tokens < 2:
        parser.error(f"--doc-tokens {args.doc_tokens} must be at least 2")
    if args.profile and args.smoke:
        parser.error("--profile needs a GPU (torchtitan 0.2.2's profiler asks for CUDA activity)")
    if args.steps is None:
        args.steps = 14 if args.smoke else 34
    if args.warmup >= args.steps - (2 if args.profile else 0):
        parser.error(f"--warmup {args.warmup} leaves no timed step of --steps {args.steps}")
    return args, arms, modes


def _print_profiles(where: Path, arms: list[str], steps: int) -> None:
    """GPU time by kernel kind of each arm's traced last step, side by side, and each arm's idle gaps."""
    traces = {arm: sorted((where / arm).glob("profile_traces/*/rank0_trace.json")) for arm in arms}
    missing = [arm for arm, found in traces.items() if not found]
    if missing:
        raise RuntimeError(f"no profiler trace written for {missing} under {where}")
    print(f"\nprofiled step {steps} (GPU kernel time; the step span includes idle gaps)")
    summaries = {arm: summarise(found[-1]) for arm, found in traces.items()}
    print_side_by_side(summaries)
    if len(summaries) == 2:
        print_name_diff(summaries)
    for arm, found in traces.items():
        print_gaps(arm, gap_report(found[-1], top=12))


def main(argv: list[str] | None = None) -> None:
    args, arms, modes = _parse(argv)
    memory = None if args.smoke or args.flavor else gpu_memory()
    if memory is not None:
        try:
            args.flavor, why = fitting_flavor(modes, args.nproc, memory, args.num_blocks, args.float8)
        except ValueError as e:
            sys.exit(f"python -m benchmarks.bench_step: {e}")
        print(f"bench_step: {why}", flush=True)
    args.flavor = args.flavor or FLAVOR
    out = Path(args.out).resolve()
    extra = tuple(FLOAT8) if args.float8 else ()
    if args.masks != ["causal"]:
        tokens = args.steps * args.nproc * (128 * 2 if args.smoke else 4096 * 2) * 3 // 2
        data, measured = document_corpus(out, args.doc_tokens, tokens)
        extra = (*extra, *data)
        print(f"bench_step: documents of {measured:,.0f} tokens on average (--doc-tokens {args.doc_tokens})")
    results = {}
    for mode in modes:
        for mask in args.masks:
            key = mode if len(args.masks) == 1 else f"{mode}/{mask}"
            where = out / key.replace("/", "-") if len(modes) * len(args.masks) > 1 else out
            where.mkdir(parents=True, exist_ok=True)
            results[key] = {
                arm: run_arm(
                    arm,
                    where,
                    args.nproc,
                    args.steps,
                    args.warmup,
                    args.smoke,
                    args.profile,
                    mode,
                    args.num_blocks,
                    args.flavor,
                    (*extra, "--model.attention_mask", mask),
                )
                for arm in arms
            }
            title = f"{mode} AC" + ("" if args.masks == ["causal"] else f", {mask} attention")
            print_table(results[key], arms, f"{title}, steps {args.warmup + 1}..{args.steps - 2 * args.profile}")
            if args.profile:
                _print_profiles(where, arms, args.steps)
    if len(results) > 1:
        print_modes(results)
    if len(args.masks) > 1:
        print_masks(results, modes, args.masks)
    if not args.smoke:  # the least bytes the MHAR arm moves, and the best ratio they allow on this GPU
        print_floors(results, args.flavor, args.num_blocks or NUM_BLOCKS[False], TOKENS)


def print_table(results: dict[str, dict[str, float]], arms: list[str], title: str) -> None:
    base = "control" if "control" in results else arms[0]
    print(f"\n{title} (tokens over time, peak memory); ratios to {base} (and to stock)")
    head = ("arm", "tokens/s/dev", "MFU %", "peak GiB", "tps ratio", "mem ratio", "vs stock")
    print(f"{head[0]:<14}" + "".join(f"{h:>12}" for h in head[1:]))
    for arm, r in results.items():
        vs_stock = f"{r['tokens_per_s'] / results['stock']['tokens_per_s']:.3f}" if "stock" in results else "-"
        print(
            f"{arm:<14}{r['tokens_per_s']:>12,.0f}{r['mfu']:>12.2f}{r['peak_active_gib']:>12.2f}"
            f"{r['tokens_per_s'] / results[base]['tokens_per_s']:>12.3f}"
            f"{r['peak_active_gib'] / results[base]['peak_active_gib']:>12.3f}{vs_stock:>12}"
        )
    phases = [arm for arm, r in results.items() if "after_forward_gib" in r]
    if phases:
        print("memory allocated (GiB, largest over the timed steps): after forward, backward, optimizer")
        for arm in phases:
            r = results[arm]
            print(
                f"{arm:<14}{r['after_forward_gib']:>12.2f}{r['after_backward_gib']:>12.2f}"
                f"{r['after_optimizer_gib']:>12.2f}"
            )


def print_modes(results: dict[str, dict[str, dict[str, float]]]) -> None:
    """One line per AC mode: every arm's tokens/s against the control and the control's against stock."""
    print("\nby AC mode: tokens/s ratios (peak memory ratios) to the control; the control to stock")
    for mode, arms in results.items():
        control = arms.get("control")
        cells = []
        for arm, r in arms.items():
            if control and arm != "control":
                tps, mem = (
                    r["tokens_per_s"] / control["tokens_per_s"],
                    r["peak_active_gib"] / control["peak_active_gib"],
                )
                cells.append(f"{arm} {tps:.3f} ({mem:.3f})")
        if control and "stock" in arms:
            cells.append(f"control/stock {control['tokens_per_s'] / arms['stock']['tokens_per_s']:.3f}")
        print(f"{mode:<10} " + ", ".join(cells))


def print_masks(results: dict[str, dict[str, dict[str, float]]], modes: list[str], masks: list[str]) -> None:
    """Per AC mode, every arm's tokens/s (peak memory) under each mask against causal."""
    print("\nby attention mask: tokens/s ratios (peak memory ratios) to causal, arm by arm")
    for mode in modes:
        base = results[f"{mode}/causal"]
        for mask in masks[1:] if masks[0] == "causal" else masks:
            r = results[f"{mode}/{mask}"]
            cells = [
                f"{arm} {r[arm]['tokens_per_s'] / base[arm]['tokens_per_s']:.3f} "
                f"({r[arm]['peak_active_gib'] / base[arm]['peak_active_gib']:.3f})"
                for arm in r
            ]
            print(f"{mode}/{mask}: " + ", ".join(cells))


if __name__ == "__main__":
    main()
