"""Our model as an HF checkpoint folder, written atomically: the control as plain Llama, the MHAR arm as
`mhar_llama` with its modeling files; and random base checkpoints of a flavor (`init`)."""

from __future__ import annotations

import copy
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

import fsspec
import torch

from mhar_titan.components.ema import plain_name
from mhar_titan.hf.files import (
    TOKENIZER_FILES,
    check_new_output,
    copy_modeling_files,
    export_config,
    remote_folder,
    temp_folder,
    write_shards,
)
from mhar_titan.hf.ledger import join, read_json
from mhar_titan.model.args import FLAVORS, MHAR, MHARModelArgs, model_args_from_hf_config
from mhar_titan.model.hf_config import DTYPE_NAMES, ffn_hidden, hf_config_from_model_args
from mhar_titan.model.model import MHARTransformer, build_initialised
from mhar_titan.model.state_dict_adapter import HF_ROUTING, OUR_ROUTING, MHARStateDictAdapter


def refuse_open_gates(gates: dict[str, torch.Tensor]) -> None:
    """Leaving the routing out is only the same model while every gate is exactly 0."""
    open_gates = [k for k in sorted(gates) if torch.count_nonzero(gates[k])]
    if open_gates:
        raise ValueError(
            f"refusing to export without routing tensors: {len(open_gates)} gates are not 0 "
            f"(first: {open_gates[0]}); the plain model would not compute what was trained"
        )


def _architecture(args: MHARModelArgs) -> dict[str, Any]:
    return {
        "dim": args.dim,
        "n_layers": args.n_layers,
        "n_heads": args.n_heads,
        "n_kv_heads": args.n_kv_heads or args.n_heads,
        "ffn_hidden": ffn_hidden(args),
        "vocab_size": args.vocab_size,
        "norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "rope_scaling": args.rope_scaling_args,
    }


def config_base(args: MHARModelArgs, base_path: str | None) -> tuple[str | None, str]:
    """The base whose config.json an export keeps (its extra fields, token ids), or None and why not: a base
    may hold only the tokenizer (a run from random weights, configs/tiny_cpu.toml) or describe another model."""
    if not base_path:
        return None, "no base"
    fs, root = fsspec.core.url_to_fs(base_path)
    if not fs.exists(join(root, "config.json")):
        return None, f"{base_path} holds no config.json"
    try:
        there = _architecture(model_args_from_hf_config(read_json(join(base_path, "config.json")), allow_mhar=True))
    except ValueError as e:
        return None, f"{base_path}/config.json is not one the exported model can have ({e})"
    ours = _architecture(args)
    differ = [f"{k} {there[k]} there, {ours[k]} in the export" for k in ours if there[k] != ours[k]]
    if differ:
        return None, f"{base_path}/config.json describes another model ({'; '.join(differ)})"
    return base_path, ""


def folder_config(args: MHARModelArgs, base_path: str | None, dtype: torch.dtype, with_routing: bool) -> dict[str, Any]:
    """config.json of an export: the base's own (keeping its extra fields), else one from the arguments."""
    config = read_json(join(base_path, "config.json")) if base_path else hf_config_from_model_args(args, dtype)
    config["torch_dtype"] = DTYPE_NAMES[dtype]
    mhar = {"num_heads": args.mhar.num_heads, "num_blocks": args.mhar.num_blocks, "variant": "delta"}
    return export_config(config, mhar if with_routing else None)


def write_folder(
    out_dir: str,
    write_weights: Callable[[str], None],
    config: dict[str, Any],
    tokenizer_dir: str | None,
    log: Callable[[str], None] = print,
) -> None:
    """An HF folder made in a temporary sibling and renamed into place: an interrupted export leaves
    nothing under `out_dir`, and a killed one a sibling that the next export to `out_dir` removes.
    `write_weights(tmp)` writes the shards and their index; the tokenizer files of `tokenizer_dir`
    that are there are copied in. Every file and folder gets the mode `open`/`mkdir` would give.
    On object storage (`s3://...`) the folder is made in TMPDIR and uploaded: `write_remote`."""
    if "://" in out_dir:
        write_remote(out_dir, lambda tmp: fill_folder(tmp, write_weights, config, tokenizer_dir, log), log)
        return
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = temp_folder(out_dir, log)
    try:
        fill_folder(tmp, write_weights, config, tokenizer_dir, log)
        if os.path.exists(out_dir):
            raise FileExistsError(f"{out_dir} already exists; export into a new directory")
        os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_remote(out_dir: str, fill: Callable[[str], None], log: Callable[[str], None]) -> None:
    """An HF folder on object storage, which has no rename: built in TMPDIR (room for the whole export), then
    uploaded after `_EXPORTING.json` is created there exclusively, config.json last, the marker deleted at the
    end. A reader that waits for config.json and no marker reads a complete folder; a failed export deletes
    what it uploaded."""
    remote = remote_folder(out_dir)
    check_new_output(out_dir)  # again, just before the claim
    tmp = tempfile.mkdtemp(prefix="hf-export-")
    try:
        fill(tmp)
        remote.claim()
        names = sorted(os.listdir(tmp), key=lambda name: (name == "config.json", name))
        for name in names:
            remote.upload(os.path.join(tmp, name))
        remote.finish()
        log(f"uploaded {len(names)} files to {out_dir}")
    except BaseException:
        remote.abandon(log)
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def fill_folder(
    tmp: str,
    write_weights: Callable[[str], None],
    config: dict[str, Any],
    tokenizer_dir: str | None,
    log: Callable[[str], None],
) -> None:
    write_weights(tmp)
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    if "auto_map" in config:
        copy_modeling_files(tmp)
    if tokenizer_dir:
        fs, root = fsspec.core.url_to_fs(tokenizer_dir)
        copied = [name for name in TOKENIZER_FILES if fs.exists(join(root, name))]
        for name in copied:  # fs.get writes through open(): the mode follows the umask
            fs.get(join(root, name), os.path.join(tmp, name))
        log(f"tokenizer files from {tokenizer_dir}: {', '.join(copied) or 'none'}")


def export_hf(
    model: MHARTransformer,
    out_dir: str,
    *,
    base_path: str | None = None,
    dtype: torch.dtype = torch.bfloat16,
    include_routing: bool = True,
    max_shard_bytes: int = 5 * 2**30,
    tokenizer_dir: str | None = None,
    log: Callable[[str], None] = print,
) -> None:
    """Write `model` (one process, full tensors) as an HF checkpoint directory, atomically, with the
    tokenizer files of `tokenizer_dir` (default: `base_path`)."""
    check_new_output(out_dir)
    args = model.model_args
    state = {plain_name(k): v.detach() for k, v in model.state_dict().items()}
    routing = {k for k in state if OUR_ROUTING.match(k)}
    if routing and not include_routing:
        refuse_open_gates({k: state[k] for k in routing if k.endswith(".gate")})
        state = {k: v for k, v in state.items() if k not in routing}
    hf_state = MHARStateDictAdapter(args, base_path).to_hf(state)
    hf_state = {k: v.to(dtype).contiguous().cpu() for k, v in hf_state.items()}
    config_path, why = config_base(args, base_path)
    if base_path and config_path is None:
        log(f"config.json from the model's arguments: {why}")
    config = folder_config(args, config_path, dtype, any(HF_ROUTING.match(k) for k in hf_state))
    tokenizer_dir = tokenizer_dir or base_path
    write_folder(out_dir, lambda tmp: write_shards(hf_state, tmp, max_shard_bytes), config, tokenizer_dir, log)


def init_hf(
    out_dir: str,
    flavor: str,
    tokenizer_dir: str | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    log: Callable[[str], None] = print,
    layers: int | None = None,
) -> None:
    """A randomly initialised base checkpoint of a train-spec flavor, or of the architecture of an HF checkpoint
    folder's config.json (the demo's base, size-true smoke tests, the preflight's base), `layers` deep if given.
    `device="cuda"` initialises an 8B model in seconds instead of minutes. The output folder, the architecture
    and the tokenizer folder are checked before the model is built (minutes at 8B on CPU)."""
    check_new_output(out_dir, "write")
    if os.path.isdir(flavor):
        args = model_args_from_hf_config(read_json(join(flavor, "config.json")), join(flavor, "config.json"))
    elif flavor in FLAVORS and flavor != "hf":
        args = copy.deepcopy(FLAVORS[flavor])
    else:
        names = ", ".join(f for f in FLAVORS if f != "hf")
        raise ValueError(f"flavor {flavor!r}: expected one of {names}, or an HF checkpoint folder with config.json")
    if layers is not None:
        if layers < 1:
            raise ValueError(f"layers {layers}: must be positive")
        args.n_layers = layers
    if tokenizer_dir and not os.path.isfile(os.path.join(tokenizer_dir, "tokenizer.json")):
        raise FileNotFoundError(f"{os.path.join(tokenizer_dir, 'tokenizer.json')}: not found (the tokenizer to copy)")
    args.mhar = MHAR()
    torch.manual_seed(seed)
    model = build_initialised(args, device)
    export_hf(model, out_dir, base_path=None, dtype=dtype, tokenizer_dir=tokenizer_dir, log=log)
