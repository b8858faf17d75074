"""A training run's checkpoints (torchtitan DCP) read back: the architecture it recorded, a step's weights
as our model, and the streamed export to an HF folder, which never builds the model: it reads the tensors
of one output shard at a time, already in the target dtype, so an 8B export holds about one 5 GB shard."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import fsspec
import torch
import torch.distributed.checkpoint as dcp
from torchtitan.models.llama3.model.args import RoPEScalingArgs

from mhar_titan.components.checkpoint import layout
from mhar_titan.components.checkpoint.checksums import verify_share
from mhar_titan.components.checkpoint.dcp_io import ParallelFileSystemReader
from mhar_titan.components.ema import plain_name
from mhar_titan.hf.export import config_base, folder_config, refuse_open_gates, write_folder
from mhar_titan.hf.files import check_new_output, plan_shards, shard_name, write_index, write_safetensors
from mhar_titan.hf.ledger import join, read_json
from mhar_titan.model.args import MHAR, MHARModelArgs
from mhar_titan.model.model import MHARTransformer, build_initialised
from mhar_titan.model.state_dict_adapter import HF_ROUTING, OUR_ROUTING, MHARStateDictAdapter


def run_model_args(run_dir: str) -> tuple[MHARModelArgs, str | None]:
    """The architecture and [mhar] settings a run recorded (model_args.json), and its hf_assets_path."""
    path = os.path.join(run_dir, "model_args.json")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: not found; is {run_dir} the dump_folder of a train_cpt.py run?")
    info = read_json(path)
    raw = dict(info["args"])
    raw["rope_scaling_args"] = RoPEScalingArgs(**raw["rope_scaling_args"])
    raw["mhar"] = MHAR(**raw["mhar"])
    return MHARModelArgs(**raw), info.get("hf_assets_path")


def checkpoint_step_dir(run_dir: str, step: int | None = None) -> str:
    """The run's checkpoint folder for `step` (default: the latest complete one)."""
    folder = os.path.join(run_dir, layout.FOLDER)
    steps = layout.complete_steps(folder)
    if not steps:
        raise FileNotFoundError(f"{folder}: no complete checkpoint ({layout.STEP_PREFIX}N with {layout.COMPLETE})")
    if step is None:
        step = steps[-1]
    if step not in steps:
        raise FileNotFoundError(f"{folder}: no complete checkpoint for step {step}; have {steps}")
    return layout.step_dir(folder, step)


def load_run_checkpoint(
    run_dir: str, step: int | None = None, *, ema: bool = False, device: str | torch.device = "cpu"
) -> MHARTransformer:
    """A run's weights at `step` (fp32, one process, on `device`), read from its distributed checkpoint.

    With `ema`, the trainable parameters are the checkpoint's weight EMA instead. The model is built on
    `device` before the read: its initialisation, which the read overwrites, costs seconds on a CPU at 8B width.
    """
    args, _ = run_model_args(run_dir)
    step_dir = checkpoint_step_dir(run_dir, step)
    model = build_initialised(args, device)
    state = model.state_dict()
    if ema:
        keys = dcp.FileSystemReader(step_dir).read_metadata().state_dict_metadata
        if not any(k.startswith("ema.") for k in keys):
            raise ValueError(f"{step_dir}: this checkpoint holds no weight EMA ([ema] enable was off, or model only)")
        trainable = {n: state[n] for n, p in model.named_parameters() if p.requires_grad}
        dcp.load({"ema": trainable}, storage_reader=ParallelFileSystemReader(step_dir), no_dist=True)
        state.update(trainable)
    else:
        dcp.load(state, storage_reader=ParallelFileSystemReader(step_dir), no_dist=True)
    model.load_state_dict(state)
    return model


def verify_checkpoint(step_dir: str, log: Callable[[str], None] = print) -> None:
    """Every file of the step against the checksums recorded when it was saved; a difference raises."""
    began = time.perf_counter()
    problems, unverified = verify_share(step_dir, 0, 1)
    if problems:
        raise ValueError(f"{step_dir}: damaged checkpoint: " + "; ".join(problems))
    if unverified:
        log(f"warning: {step_dir}: {len(unverified)} files have no recorded checksum; reading them unverified")
    else:
        log(f"{step_dir}: checksums verified in {time.perf_counter() - began:.1f} s")


def base_sources(base: str | None, args: MHARModelArgs, log: Callable[[str], None]) -> tuple[str | None, str | None]:
    """Where an export's config.json and tokenizer files come from, each looked for on its own in the run's
    recorded base (hf_assets_path): a run from random weights (configs/tiny_cpu.toml) has a base folder
    that holds the tokenizer and no config.json or weights. Only what is really missing is warned about."""
    if not base:
        return None, None
    fs, root = fsspec.core.url_to_fs(base)
    if not fs.isdir(root):
        log(f"warning: the run's base {base} is not there: the export gets no tokenizer files")
        return None, None
    if not fs.exists(join(root, "tokenizer.json")):
        log(f"warning: the run's base {base} has no tokenizer.json: the export gets no tokenizer")
    config_path, why = config_base(args, base)
    if config_path is None:
        log(f"config.json from the run's model arguments: {why}")
    return config_path, base


def _checked_sources(step_dir: str, args: MHARModelArgs, ema: bool) -> tuple[dict[str, torch.Size], dict[str, str]]:
    """The run's model's shapes and, per tensor, the checkpoint key it is read from (its EMA with `ema`),
    each checked against the checkpoint's metadata before any tensor is read."""
    with torch.device("meta"):
        model = MHARTransformer(args)
    shapes = {plain_name(k): v.shape for k, v in model.state_dict().items()}
    trainable = {plain_name(n) for n, p in model.named_parameters() if p.requires_grad}
    stored = dcp.FileSystemReader(step_dir).read_metadata().state_dict_metadata
    if ema and not any(k.startswith("ema.") for k in stored):
        raise ValueError(f"{step_dir}: this checkpoint holds no weight EMA ([ema] enable was off, or model only)")
    source = {k: f"ema.{k}" if ema and k in trainable else k for k in shapes}
    for ours, key in source.items():
        if key not in stored or tuple(getattr(stored[key], "size", ())) != tuple(shapes[ours]):
            have = tuple(stored[key].size) if key in stored and hasattr(stored[key], "size") else "absent"
            raise ValueError(f"{step_dir}: {key}: {have} in the checkpoint, {tuple(shapes[ours])} in the run's model")
    return shapes, source


def _without_routing(step_dir: str, source: dict[str, str], shapes: dict[str, torch.Size]) -> dict[str, str]:
    """The sources less the routing tensors, refused while any gate is open (plain Llama would differ)."""
    gates = [k for k in source if OUR_ROUTING.match(k) and k.endswith(".gate")]
    refuse_open_gates(_read(step_dir, {source[k]: shapes[k] for k in gates}, torch.float32, "cpu"))
    return {k: v for k, v in source.items() if not OUR_ROUTING.match(k)}


@dataclass
class _ShardWriter:
    """Writes the planned shards into a folder, one at a time: each shard's tensors are read in `dtype` on
    `device`, converted to HF names and layout, written and dropped, so memory holds about one shard."""

    step_dir: str
    shards: list[list[str]]
    source: dict[str, str]
    ours_of: dict[str, str]
    shapes: dict[str, torch.Size]
    sizes: dict[str, int]
    total: int
    adapter: MHARStateDictAdapter
    dtype: torch.dtype
    device: str | torch.device
    log: Callable[[str], None]

    def __call__(self, tmp: str) -> None:
        shards, source, ours_of, shapes = self.shards, self.source, self.ours_of, self.shapes
        for i, keys in enumerate(shards):
            began = time.perf_counter()
            read = _read(self.step_dir, {source[ours_of[h]]: shapes[ours_of[h]] for h in keys}, self.dtype, self.device)
            tensors = {
                h: self.adapter.to_hf({ours_of[h]: read.pop(source[ours_of[h]])})[h].contiguous().cpu() for h in keys
            }
            write_safetensors(tensors, os.path.join(tmp, shard_name(i, len(shards))))
            gb, seconds = sum(self.sizes[h] for h in keys) / 1e9, time.perf_counter() - began
            self.log(f"shard {i + 1}/{len(shards)}: {len(keys)} tensors, {gb:.2f} GB in {seconds:.1f} s")
            del read, tensors
        write_index(tmp, shards, self.total)


def export_run(
    run_dir: str,
    out_dir: str,
    *,
    step: int | None = None,
    ema: bool = False,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    include_routing: bool = True,
    verify: bool = True,
    max_shard_bytes: int = 5 * 2**30,
    log: Callable[[str], None] = print,
) -> str:
    """A run's checkpoint at `step` (raw or EMA weights) as an HF folder; returns the step folder read.

    The same files as `export_hf(load_run_checkpoint(...))`, tensor for tensor. Each output shard's
    tensors are read from the checkpoint into `dtype` on `device` (where the cast and the RoPE
    permutation run), written, and dropped. Every input is checked before the first tensor is read.
    """
    check_new_output(out_dir)
    step_dir = checkpoint_step_dir(run_dir, step)
    args, recorded_base = run_model_args(run_dir)
    base, tokenizer_dir = base_sources(recorded_base, args, log)
    shapes, source = _checked_sources(step_dir, args, ema)
    if verify:
        verify_checkpoint(step_dir, log)
    if not include_routing:
        source = _without_routing(step_dir, source, shapes)

    adapter = MHARStateDictAdapter(args, base)
    ours_of = {next(iter(adapter.to_hf({k: torch.empty(shapes[k], device="meta")}))): k for k in source}
    itemsize = torch.empty((), dtype=dtype).element_size()
    sizes = {h: math.prod(shapes[k]) * itemsize for h, k in ours_of.items()}
    shards = plan_shards(sizes, max_shard_bytes)
    config = folder_config(args, base, dtype, any(HF_ROUTING.match(h) for h in ours_of))
    total = sum(sizes.values())
    weights = "EMA" if ema else "raw"
    log(
        f"reading {step_dir} ({weights} weights): {len(sizes)} tensors, {total / 1e9:.2f} GB as {config['torch_dtype']}"
    )
    writer = _ShardWriter(step_dir, shards, source, ours_of, shapes, sizes, total, adapter, dtype, device, log)
    write_folder(out_dir, writer, config, tokenizer_dir, log)
    return step_dir


def _read(
    step_dir: str, wanted: dict[str, torch.Size], dtype: torch.dtype, device: str | torch.device
) -> dict[str, torch.Tensor]:
    """Tensors of a DCP checkpoint by key, cast to `dtype` on `device` as DCP copies them in."""
    out = {key: torch.empty(shape, dtype=dtype, device=device) for key, shape in wanted.items()}
    dcp.load(out, storage_reader=ParallelFileSystemReader(step_dir), no_dist=True)
    return out
