"""Per-rank peak memory of a job in each activation-checkpointing mode, and the fastest mode that fits.

    python -m mhar_titan.plan CONFIG.toml --gpus 8 --gpu-memory 80GiB [--margin 0.1] [--json]
                              [--section.key value ...]   (the job's own command-line overrides)

The estimate counts tensors, per rank, at the two moments that set the peak (measured on one
H200, docs/performance.md): the start of the backward (persistent state without gradients,
every activation the mode keeps, the logits and their gradient) and its end (persistent state
with gradients, the last input gradients). It is printed for the control arm (the job with
`[mhar] enable = false`) and the MHAR arm, so that the pair can run one mode, identically.

- Persistent: fp32 master weights, fp32 gradients, AdamW's two moments, the fp32 EMA, all
  sharded over the FSDP ranks; cuBLAS workspaces; RoPE's table.
- Activations per layer and token: `full` keeps each block's input (and the MHAR sites' routed
  terms); `selective` (torchtitan's op-level policy) also the outputs of wq, wv, w1 and the
  attention (every other matmul; w2's output is not needed); `none` every tensor the compiled
  block saves. On one GPU torchtitan trains without FSDP, under autocast: the residual stream
  and the norm outputs are fp32 there (bf16 casts beside them), bf16 under FSDP's mixed precision.
- FSDP (more than one rank): each block's gathered bf16 parameters (the current and the
  prefetched one), and in the backward its unsharded gradient and fp32 reduce-scatter input;
  the embedding's at the end of the backward.
- float8 (`[model] converters = ["quantize.linear.float8"]`, measured on one H200 at 8 and 16 layers,
  docs/performance.md, 2026-12-04): `full` and `selective` keep what they keep in bf16 (the same peaks and
  the same memory after the forward); `none` keeps 2 (d + 2 kv + 3 hidden) bytes a token and layer fewer, the
  size of the five input matmuls' bf16 outputs (q, k, v, w1, w3) and the MLP's product: 0.75 GiB a layer at
  8,192 tokens, at both depths (the control) and in both arms (8 layers). Which of the compiled block's
  saved tensors torchao's float8 matmul and Inductor's partitioner leave out was not traced, only the size.
Checked on one GPU at 8 and 16 layers of the 8B width: both arms in every mode in bf16, and float8 as above
(tests/test_plan.py holds the measured peaks); the FSDP terms are the same accounting, not yet measured on 8
GPUs.

Host memory a rank for checkpoint saves, by `[checkpoint] async_mode` (`host_checkpoint`): the synchronous saves'
page-locked buffers (one per distinct shape of the rank's shards of at least 1 MiB, kept); `async` adds a
pageable copy of the rank's whole state while each save writes; `async_with_pinned_mem` keeps a page-locked,
shared copy of it from the first save to the job's end, and torch's checkpoint process beside it.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import json
import logging
import math
import os
import re
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torchtitan.config import JobConfig

from mhar_titan.config import parse_config
from mhar_titan.model.args import FLAVORS, HF_FLAVOR, MHARModelArgs
from mhar_titan.model.model import MHARTransformer
from mhar_titan.model.sources import SITE_NAMES, SourceLayout

GIB = 2**30
MODES = ("none", "selective", "full")  # fastest first (make bench-step: docs/performance.md)
CUBLAS_WORKSPACES = 2 * 32 * 2**20  # two streams' cuBLAS workspaces on Hopper
RUNTIME_RESERVE = 1.5 * GIB  # CUDA context, NCCL buffers, allocator slack: outside torch's count
STAGE_MIN_BYTES = 2**20  # the synchronous writer's page-locked staging threshold (components/checkpoint/dcp_io.py)
ASYNC_MODES = ("disabled", "async", "async_with_pinned_mem")  # torchtitan's [checkpoint] async_mode


@dataclasses.dataclass(frozen=True)
class Geometry:
    """What the estimate needs of a job: shapes, parameter counts, ranks."""

    params: int  # all trainable parameters
    layer_params: int  # one block's (routing sites included)
    embed_params: int
    output_params: int
    rope_bytes: int
    dim: int
    kv_dim: int
    hidden: int
    heads: int
    layers: int
    vocab: int
    tokens: int  # per microbatch and rank
    ranks: int  # FSDP shard degree
    mhar: bool
    num_blocks: int
    routing_heads: int
    ema: bool
    float8: bool = False  # float8 linear layers (torchtitan's converter)
    staged_bytes: int = 0  # a rank's fp32 shards of at least STAGE_MIN_BYTES, one of each shape

    @property
    def fsdp(self) -> bool:
        return self.ranks > 1


def geometry(cfg: JobConfig, gpus: int, mhar: bool, layers: int | None = None) -> Geometry:
    """The job's geometry on `gpus` ranks (FSDP over all of them), with MHAR on or off; `layers` cuts the depth."""
    args = model_args(cfg)
    if layers is not None:
        args.n_layers = layers
    args.mhar = dataclasses.replace(cfg.mhar, enable=mhar)
    args.max_seq_len = cfg.training.seq_len
    with torch.device("meta"):
        model = MHARTransformer(args)
    layer = model.layers["0"]
    ranks = max(1, gpus // max(1, cfg.parallelism.data_parallel_replicate_degree))
    return Geometry(
        params=sum(p.numel() for p in model.parameters()),
        layer_params=sum(p.numel() for p in layer.parameters()),
        embed_params=model.tok_embeddings.weight.numel(),
        output_params=model.output.weight.numel() + model.norm.weight.numel(),
        rope_bytes=model.freqs_cis.numel() * model.freqs_cis.element_size(),
        dim=args.dim,
        kv_dim=layer.attention.wk.weight.shape[0],
        hidden=layer.feed_forward.w1.weight.shape[0],
        heads=args.n_heads,
        layers=args.n_layers,
        vocab=args.vocab_size,
        tokens=cfg.training.local_batch_size * cfg.training.seq_len,
        ranks=ranks,
        mhar=mhar,
        num_blocks=cfg.mhar.num_blocks,
        routing_heads=cfg.mhar.num_heads,
        ema=cfg.ema.enable,
        float8=any("float8" in c for c in cfg.model.converters),
        staged_bytes=staged_shapes_bytes([tuple(p.shape) for p in model.parameters()], ranks),
    )


def staged_shapes_bytes(shapes: list[tuple[int, ...]], ranks: int) -> int:
    """The synchronous save's reused page-locked buffers on one rank (components/checkpoint/dcp_io.PinnedStaging): one
    per distinct shape of the rank's fp32 shards (FSDP2 splits dim 0 into ceil(rows / ranks) rows) of at least
    STAGE_MIN_BYTES; weights, AdamW's moments and the EMA share each shape's buffer, written one after another."""
    local = {(-(-shape[0] // ranks), *shape[1:]) for shape in shapes if shape}
    sizes = [4 * math.prod(shape) for shape in local]
    return sum(size for size in sizes if size >= STAGE_MIN_BYTES)


def host_checkpoint(g: Geometry, async_mode: str) -> dict[str, float]:
    """Host bytes a rank's checkpoint saves take in `async_mode`: page-locked memory kept for the job (the
    synchronous saves' buffers, which every mode uses for its last and stop saves; with async_with_pinned_mem
    also torchtitan's pinned, shared staging copy of the whole state), and pageable memory held while a save
    writes (`async`: a copy of the whole state, freed when its write completes)."""
    if async_mode not in ASYNC_MODES:
        raise ValueError(f"[checkpoint] async_mode {async_mode!r}: expected one of {', '.join(ASYNC_MODES)}")
    state = (4 + 8 + (4 if g.ema else 0)) * g.params / g.ranks  # what estimate() counts on the GPU
    pinned = g.staged_bytes + (state if async_mode == "async_with_pinned_mem" else 0)
    return {"page_locked": pinned, "during_save": state if async_mode == "async" else 0.0}


def model_args(cfg: JobConfig) -> MHARModelArgs:
    flavor = cfg.model.flavor
    if flavor not in FLAVORS:
        raise ValueError(f"[model] flavor = {flavor!r}: expected one of {', '.join(FLAVORS)}")
    args = copy.deepcopy(FLAVORS[flavor])
    if flavor == HF_FLAVOR:
        try:
            args.update_from_config(cfg)
        except FileNotFoundError as e:
            raise ValueError(
                f"[model] flavor = 'hf' reads {cfg.model.hf_assets_path}/config.json, which is not there ({e}); "
                "download the base first, or plan with the built-in architecture: --model.flavor marin8b"
            ) from None
    return args


def layer_activations(g: Geometry, mode: str) -> float:
    """Bytes one block keeps per token for its backward in `mode` (the MHAR terms apart)."""
    stream = 2 if g.fsdp else 4  # the residual stream: bf16 under FSDP, fp32 under autocast
    norm_out = 2 if g.fsdp else 6  # a norm's output: bf16; under autocast fp32 and its bf16 cast
    lse = 4 * g.heads  # the attention's log-sum-exp, fp32 per head
    if mode == "full":
        return stream * g.dim  # the block's input, kept by the checkpoint
    if mode == "selective":  # + wq's, wv's and w1's outputs and the attention's, bf16
        return stream * g.dim + 2 * (2 * g.dim + g.kv_dim + g.hidden) + lse
    if mode == "none":
        # x, the two norm outputs, q, k, v, the attention's output, a, h, w1, w3 and their product
        per = 2 * stream * g.dim + 2 * norm_out * g.dim + 2 * (3 * g.dim + 2 * g.kv_dim + 3 * g.hidden)
        if g.float8:  # measured: the size of q, k, v, w1's and w3's outputs and their product, not kept
            per -= 2 * (g.dim + 2 * g.kv_dim + 3 * g.hidden)
        return per + lse
    raise ValueError(f"activation_checkpoint mode {mode!r}: expected one of {', '.join(MODES)}")


def estimate(g: Geometry, mode: str) -> dict[str, Any]:
    """Bytes per rank at the start and the end of the backward, by component, and the peak."""
    n, d, shards = g.tokens, g.dim, g.ranks
    stream = 2 if g.fsdp else 4
    routed = 2  # the routed terms' dtype: the gathered parameters' under FSDP, autocast's on one GPU (bf16)
    state = (4 + 8 + (4 if g.ema else 0)) * g.params / shards  # master weights, AdamW moments, EMA
    fixed = CUBLAS_WORKSPACES + g.rope_bytes
    kept = {
        "blocks": g.layers * n * layer_activations(g, mode),
        # the last block's output, the final norm's (bf16), the logits (bf16), the output weight in bf16
        # (autocast's cast, or FSDP's gathered copy: that unit is not resharded after the forward)
        "head": n * (stream * d + 2 * d + 2 * g.vocab) + 2 * g.output_params,
    }
    if g.mhar:
        layout = SourceLayout(g.num_blocks, g.layers)
        deltas = layout.deltas * n * d * 2  # the completed blocks' deltas, the sources (bf16)
        if not g.fsdp:  # under autocast the embedding source is a bf16 copy of the fp32 embedding
            deltas += n * d * 2
        if mode == "none":  # measured: the compiled body keeps a block delta per layer, and one stream tensor;
            # under autocast (fp32 stream, bf16 routed terms) also a routed term per layer
            extra = 0 if g.fsdp else g.layers * n * d * routed
            kept["routing"] = deltas + g.layers * n * d * 2 + n * d * stream + extra
        else:  # the checkpoint keeps each site's routed term: 2 per layer
            kept["routing"] = deltas + g.layers * 2 * n * d * routed
        # the fused backward reads each site's routing logits, fp32 [sources, tokens, heads], kept
        # from its forward; a site reads its layer's site_sources (the null's included)
        sources = len(SITE_NAMES) * sum(layout.site_sources(layer) for layer in range(g.layers))
        kept["routing"] += sources * n * g.routing_heads * 4
    gathered = 2 * 2 * g.layer_params if g.fsdp else 0  # current and prefetched block, bf16
    start = {"state": state, "fixed": fixed, **kept, "logit grads": 2 * n * g.vocab, "gathered": gathered}
    end = {
        "state": state,
        "fixed": fixed,
        "grads": 4 * g.params / shards,
        "input grads": 2 * n * d * stream,
        # the embedding's unsharded gradient (bf16) and its fp32 reduce-scatter input
        "gathered": (2 + 4) * g.embed_params if g.fsdp else 0,
    }
    moments = {"backward start": start, "backward end": end}
    where = max(moments, key=lambda k: sum(moments[k].values()))
    return {"peak": sum(moments[where].values()), "at": where, "parts": moments[where], "moments": moments}


def _gib(parts: dict[str, float]) -> dict[str, float]:
    return {k: v / GIB for k, v in parts.items()}


def parse_memory(text: str) -> float:
    """'80GiB', '80GB', '141 GB' -> bytes."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*(GiB|GB|MiB|MB)\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"--gpu-memory {text!r}: give a size such as 80GiB or 80GB")
    unit = {"GiB": GIB, "GB": 1e9, "MiB": 2**20, "MB": 1e6}[m[2]]
    return float(m[1]) * unit


def plan(cfg: JobConfig, gpus: int, gpu_memory: float, margin: float) -> dict[str, Any]:
    """Both arms' peaks per mode, and the fastest mode in which both fit with the margin."""
    budget = gpu_memory * (1 - margin) - RUNTIME_RESERVE
    arms = {arm: geometry(cfg, gpus, mhar) for arm, mhar in (("control", False), ("mhar", True))}
    peaks = {mode: {arm: estimate(g, mode) for arm, g in arms.items()} for mode in MODES}
    fits = [m for m in MODES if all(e["peak"] <= budget for e in peaks[m].values())]
    host = {m: _gib(host_checkpoint(arms["mhar"], m)) for m in ASYNC_MODES}  # the larger arm
    return {
        "gpus": gpus,
        "fsdp_ranks": arms["control"].ranks,
        "tokens_per_microbatch": arms["control"].tokens,
        "gpu_memory_gib": gpu_memory / GIB,
        "budget_gib": budget / GIB,
        "peak_gib": {m: {arm: e["peak"] / GIB for arm, e in per.items()} for m, per in peaks.items()},
        "parts_gib": {m: {arm: _gib(e["parts"]) for arm, e in per.items()} for m, per in peaks.items()},
        "recommended": fits[0] if fits else None,
        "host_checkpoint_gib": host,
        "async_mode": cfg.checkpoint.async_mode,
    }


def host_text(host: dict[str, dict[str, float]], mode: str) -> str:
    """One line: each async_mode's host memory a rank for checkpoint saves (GiB), and the config's mode."""
    parts = [
        f"{m} {h['page_locked']:.1f} page-locked"
        + (f" + {h['during_save']:.1f} while a save writes" if h["during_save"] else "")
        for m, h in host.items()
    ]
    return f"host memory a rank for checkpoint saves (GiB; x ranks a node): {'; '.join(parts)} (this config: {mode})"


def full_depth(cfg: JobConfig) -> int:
    return model_args(cfg).n_layers


def deepest_fit(cfg: JobConfig, gpus: int, gpu_memory: float, margin: float, mode: str) -> tuple[int | None, dict]:
    """The largest depth (a multiple of `[mhar] num_blocks`, at most the model's) at which both arms fit in `mode`
    with the margin, or None; and the peaks (GiB, per arm) at that depth, or at the shallowest when none fits.
    What a job too deep for its GPUs runs instead, with every routing source count kept (the preflight)."""
    budget = gpu_memory * (1 - margin) - RUNTIME_RESERVE
    step = max(1, cfg.mhar.num_blocks)
    for layers in range(full_depth(cfg) // step * step, 0, -step):
        peaks = {
            arm: estimate(geometry(cfg, gpus, on, layers), mode)["peak"]
            for arm, on in (("control", False), ("mhar", True))
        }
        if max(peaks.values()) <= budget:
            return layers, {"layers": layers, "budget_gib": budget / GIB, **{a: v / GIB for a, v in peaks.items()}}
    return None, {"layers": step, "budget_gib": budget / GIB, **{a: v / GIB for a, v in peaks.items()}}


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Warnings and info of the loggers off (torchtitan's config parser warns of a base folder not read)."""
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)
    try:
        yield
    finally:
        root.setLevel(level)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m mhar_titan.plan",
        description="Per-rank peak memory of a job's control and MHAR arms in each activation-checkpointing "
        "mode, and the fastest mode both fit in. Any other --section.key value is passed to the job's config.",
    )
    parser.add_argument("config", help="the job's TOML (either arm's: both arms are planned)")
    parser.add_argument("--gpus", type=int, required=True, help="ranks of the job (FSDP shards over all of them)")
    parser.add_argument("--gpu-memory", type=parse_memory, required=True, help="memory per GPU, e.g. 80GiB or 141GB")
    parser.add_argument("--margin", type=float, default=0.1, help="fraction of the GPU kept free (default 0.1)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    args, overrides = parser.parse_known_args(argv)
    if args.gpus < 1 or not 0 <= args.margin < 1:
        parser.error("--gpus must be >= 1 and --margin in [0, 1)")
    if not os.path.isfile(args.config):
        parser.error(f"config {args.config}: no such file")
    try:
        with quiet():  # torchtitan warns of a missing base folder, which a plan with a flavor does not read
            cfg = parse_config(["--job.config_file", args.config, *overrides])
        result = plan(cfg, args.gpus, args.gpu_memory, args.margin)
    except (ValueError, FileNotFoundError) as e:
        sys.exit(f"python -m mhar_titan.plan: {e}")
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(
        f"{args.config}: {args.gpus} GPUs ({result['fsdp_ranks']} FSDP shards), {result['tokens_per_microbatch']:,} "
        f"tokens a microbatch, {result['gpu_memory_gib']:.1f} GiB a GPU; budget {result['budget_gib']:.1f} GiB "
        f"(margin {args.margin:.0%}, {RUNTIME_RESERVE / GIB:.1f} GiB for the CUDA runtime)"
    )
    print(f"{'AC mode':<12}{'control GiB':>14}{'MHAR GiB':>12}  fits")
    for mode in MODES:
        peak = result["peak_gib"][mode]
        fits = "yes" if max(peak.values()) <= result["budget_gib"] else "no"
        print(f"{mode:<12}{peak['control']:>14.1f}{peak['mhar']:>12.1f}  {fits}")
    print(host_text(result["host_checkpoint_gib"], result["async_mode"]))
    best = result["recommended"]
    if best is None:
        print("no mode fits: use more GPUs, a smaller local_batch_size, or a larger --margin budget")
        return
    flags = "--activation_checkpoint.mode " + best
    if best == "selective":
        flags += " --activation_checkpoint.selective_ac_option op"
    print(f"fastest mode that fits both arms: {best} ({flags})")


if __name__ == "__main__":
    main()
