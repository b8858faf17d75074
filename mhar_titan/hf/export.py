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
from mhar_titan.hf.files import TOKENIZER_FILES, chmod_like_mkdir, copy_modeling_files, export_config, write_shards
from mhar_titan.hf.ledger import join, read_json
from mhar_titan.model.args import FLAVORS, MHAR, MHARModelArgs
from mhar_titan.model.hf_config import DTYPE_NAMES, hf_config_from_model_args
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
    base_path: str | None,
) -> None:
    """An HF folder made in a temporary sibling and renamed into place: an interrupted export leaves
    nothing under `out_dir`. `write_weights(tmp)` writes the shards and their index."""
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".export-", dir=parent)
    try:
        chmod_like_mkdir(tmp)  # mkdtemp makes it 0700
        write_weights(tmp)
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
        if "auto_map" in config:
            copy_modeling_files(tmp)
        if base_path:
            fs, root = fsspec.core.url_to_fs(base_path)
            for name in TOKENIZER_FILES:
                if fs.exists(join(root, name)):
                    fs.get(join(root, name), os.path.join(tmp, name))
        if os.path.exists(out_dir):
            raise FileExistsError(f"{out_dir} already exists; export into a new directory")
        os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def export_hf(
    model: MHARTransformer,
    out_dir: str,
    *,
    base_path: str | None = None,
    dtype: torch.dtype = torch.bfloat16,
    include_routing: bool = True,
    max_shard_bytes: int = 5 * 2**30,
) -> None:
    """Write `model` (one process, full tensors) as an HF checkpoint directory, atomically."""
    args = model.model_args
    state = {plain_name(k): v.detach() for k, v in model.state_dict().items()}
    routing = {k for k in state if OUR_ROUTING.match(k)}
    if routing and not include_routing:
        refuse_open_gates({k: state[k] for k in routing if k.endswith(".gate")})
        state = {k: v for k, v in state.items() if k not in routing}
    hf_state = MHARStateDictAdapter(args, base_path).to_hf(state)
    hf_state = {k: v.to(dtype).contiguous().cpu() for k, v in hf_state.items()}
    config = folder_config(args, base_path, dtype, any(HF_ROUTING.match(k) for k in hf_state))
    write_folder(out_dir, lambda tmp: write_shards(hf_state, tmp, max_shard_bytes), config, base_path)


def init_hf(
    out_dir: str,
    flavor: str,
    tokenizer_dir: str | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> None:
    """A randomly initialised base checkpoint of a train-spec flavor (the demo's base, size-true smoke
    tests). `device="cuda"` initialises an 8B model in seconds instead of minutes."""
    if flavor not in FLAVORS or flavor == "hf":
        raise ValueError(f"flavor {flavor!r}: expected one of {', '.join(f for f in FLAVORS if f != 'hf')}")
    args = copy.deepcopy(FLAVORS[flavor])
    args.mhar = MHAR()
    torch.manual_seed(seed)
    model = build_initialised(args, device)
    export_hf(model, out_dir, base_path=None, dtype=dtype)
    for name in TOKENIZER_FILES if tokenizer_dir else ():
        if os.path.exists(os.path.join(tokenizer_dir, name)):
            shutil.copy(os.path.join(tokenizer_dir, name), os.path.join(out_dir, name))
