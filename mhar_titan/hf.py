"""Hugging Face checkpoints in and out: Llama-3.x safetensors, graft-aware.

Reading: config.json becomes model arguments (or a refusal naming the field),
and every checkpoint tensor is accounted for in a load ledger: loaded, newly
initialised (the MHAR routing parameters), unused. A missing base tensor, a
shape or dtype mismatch or an unused tensor fails the load with the ledger.

Writing: sharded safetensors with an index, config.json and the base's
tokenizer files. The control writes a plain `LlamaForCausalLM`; the MHAR arm
adds its routing tensors (`model.layers.N.mhar.{attn,ffn}.*`) and exports as its
own architecture (`mhar_llama`: an `mhar` block, `auto_map` and the modeling files
of mhar_titan/hf_modeling/, loaded with trust_remote_code), which a plain Llama
loader refuses; it may leave the routing out only while every gate is 0.

    python -m mhar_titan.hf inspect PATH
    python -m mhar_titan.hf export RUN_DIR OUT_DIR [--step N] [--ema] [--dtype bf16]
    python -m mhar_titan.hf init OUT_DIR [--flavor tiny] [--tokenizer DIR] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from typing import Any

import fsspec
import torch
from safetensors.torch import load as load_safetensors_bytes
from torchtitan.models.llama3.model.args import RoPEScalingArgs
from torchtitan.models.llama3.model.state_dict_adapter import Llama3StateDictAdapter

from mhar_titan.config import MHAR
from mhar_titan.hf_files import (
    MHAR_ARCHITECTURE,
    MHAR_MODEL_TYPE,
    chmod_like_mkdir,
    copy_modeling_files,
    export_config,
    llama3_rope_scaling,
    mhar_settings,
    safetensors_header,
    write_shards,
)
from mhar_titan.model import MHARModelArgs, MHARTransformer, build_initialised

ROUTING_PARAMS = ("query", "norm_weight", "null", "gate")
ROUTING_INIT = {"query": "zeros", "norm_weight": "ones", "null": "zeros", "gate": "zeros"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")
_SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}  # CLI names
_OUR_ROUTING = re.compile(r"^layers\.(\d+)\.(attn|ffn)_routing\.(\w+)$")
_HF_ROUTING = re.compile(r"^model\.layers\.(\d+)\.mhar\.(attn|ffn)\.(\w+)$")


class MHARStateDictAdapter(Llama3StateDictAdapter):
    """torchtitan's Llama-3 key map and RoPE permutation, plus the routing tensors."""

    def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        base = {k: v for k, v in state_dict.items() if not _OUR_ROUTING.match(k)}
        out = super().to_hf(base)
        for key, value in state_dict.items():
            if m := _OUR_ROUTING.match(key):
                out[f"model.layers.{m[1]}.mhar.{m[2]}.{m[3]}"] = value
        return out

    def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
        base = {k: v for k, v in hf_state_dict.items() if not _HF_ROUTING.match(k)}
        out = super().from_hf(base)
        for key, value in hf_state_dict.items():
            if m := _HF_ROUTING.match(key):
                out[f"layers.{m[1]}.{m[2]}_routing.{m[3]}"] = value
        return out

    def our_key(self, hf_key: str) -> str | None:
        """The model key an HF key loads into; None for buffers HF stores and we recompute."""
        if m := _HF_ROUTING.match(hf_key):
            return f"layers.{m[1]}.{m[2]}_routing.{m[3]}"
        abstract = re.sub(r"(\d+)", "{}", hf_key, count=1)
        if abstract not in self.from_hf_map:
            raise KeyError(hf_key)
        target = self.from_hf_map[abstract]
        if target is None:
            return None
        layer = re.search(r"\d+", hf_key)
        return target.format(layer[0]) if layer and "{}" in target else target


# ---------------------------------------------------------------------------------------------
# config.json <-> model arguments


def model_args_from_hf_config(
    config: dict[str, Any], source: str = "config.json", *, allow_mhar: bool = False
) -> MHARModelArgs:
    """Model arguments for a Llama-3.x config.json, or a ValueError naming the field we cannot represent.

    An MHAR export (`mhar_llama`) only with `allow_mhar` (load_hf_model, inspect: they use its own
    settings); as a training base its routing would load under the run's unchecked `[mhar]` settings.
    """

    def refuse(field_name: str, why: str) -> ValueError:
        return ValueError(f"{source}: {field_name} = {config.get(field_name)!r}: {why}")

    mhar_export = config.get("model_type") == MHAR_MODEL_TYPE
    if mhar_export and not allow_mhar:
        raise refuse("model_type", "an MHAR export is not a training base; start from a plain Llama checkpoint")
    if config.get("model_type") != "llama" and not mhar_export:
        raise refuse("model_type", "only Llama checkpoints are supported")
    arch = MHAR_ARCHITECTURE if mhar_export else "LlamaForCausalLM"
    if (config.get("architectures") or [arch]) != [arch]:
        raise refuse("architectures", f"expected [{arch!r}]")
    for name in ("attention_bias", "mlp_bias"):
        if config.get(name):
            raise refuse(name, "biases are not supported by the model")
    if config.get("tie_word_embeddings"):
        raise refuse("tie_word_embeddings", "the model has an untied output projection")
    if config.get("hidden_act", "silu") != "silu":
        raise refuse("hidden_act", "the model's MLP is SwiGLU (silu)")
    dim, n_heads = config["hidden_size"], config["num_attention_heads"]
    if config.get("head_dim", dim // n_heads) != dim // n_heads or dim % n_heads:
        raise refuse("head_dim", f"must be hidden_size / num_attention_heads = {dim / n_heads}")

    rope_field = "rope_scaling" if config.get("rope_scaling") else "rope_parameters"
    rope = config.get(rope_field) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
    if rope_type == "llama3":
        scaling = llama3_rope_scaling(rope, source, rope_field)
    elif rope_type == "default":
        scaling = RoPEScalingArgs(scaling_factor=1.0)  # llama3 scaling with factor 1 is the identity
    else:
        raise refuse("rope_scaling", f"rope type {rope_type!r} is not supported (llama3 or default)")

    # torchtitan sizes the MLP as multiple_of * ceil(int(multiplier * int(8 * dim / 3)) / multiple_of):
    # multiple_of = intermediate_size and a multiplier just reaching it give exactly intermediate_size.
    hidden = config["intermediate_size"]
    eos = config.get("eos_token_id")
    args = MHARModelArgs(
        dim=dim,
        n_layers=config["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=config.get("num_key_value_heads", n_heads),
        vocab_size=config["vocab_size"],
        multiple_of=hidden,
        ffn_dim_multiplier=hidden / int(2 * 4 * dim / 3),
        norm_eps=config.get("rms_norm_eps", 1e-6),
        rope_theta=float(theta),
        rope_scaling_args=scaling,
        max_seq_len=config.get("max_position_embeddings", 131072),
        eos_id=(eos[0] if isinstance(eos, list) else eos) or 0,
    )
    if _ffn_hidden(args) != hidden:
        raise refuse("intermediate_size", "cannot be represented by the model's MLP sizing")
    return args


def _ffn_hidden(args: MHARModelArgs) -> int:
    hidden = int(2 * 4 * args.dim / 3)
    if args.ffn_dim_multiplier is not None:
        hidden = int(args.ffn_dim_multiplier * hidden)
    return args.multiple_of * ((hidden + args.multiple_of - 1) // args.multiple_of)


def hf_config_from_model_args(args: MHARModelArgs, dtype: torch.dtype) -> dict[str, Any]:
    r = args.rope_scaling_args
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": args.dim,
        "intermediate_size": _ffn_hidden(args),
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads or args.n_heads,
        "head_dim": args.dim // args.n_heads,
        "hidden_act": "silu",
        "rms_norm_eps": args.norm_eps,
        "vocab_size": args.vocab_size,
        "max_position_embeddings": args.max_seq_len,
        "rope_theta": args.rope_theta,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": r.scaling_factor,
            "low_freq_factor": r.low_freq_factor,
            "high_freq_factor": r.high_freq_factor,
            "original_max_position_embeddings": r.original_max_position_embeddings,
        },
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "eos_token_id": args.eos_id,
        "torch_dtype": _DTYPE_NAMES[dtype],
    }


# ---------------------------------------------------------------------------------------------
# reading checkpoints


def _join(path: str, name: str) -> str:
    return path.rstrip("/") + "/" + name


def read_json(path: str) -> dict[str, Any]:
    with fsspec.open(path, "r") as f:
        return json.load(f)


def checkpoint_files(path: str) -> dict[str, str]:
    """{HF key: shard file} of a checkpoint directory (sharded with an index, or one file)."""
    fs, root = fsspec.core.url_to_fs(path)
    index = _join(path, "model.safetensors.index.json")
    if fs.exists(_join(root, "model.safetensors.index.json")):
        weight_map = read_json(index)["weight_map"]
        return {k: _join(path, v) for k, v in weight_map.items()}
    single = _join(path, "model.safetensors")
    if fs.exists(_join(root, "model.safetensors")):
        return {k: single for k in safetensors_header(single)}
    raise FileNotFoundError(f"{path}: no model.safetensors.index.json or model.safetensors")


@dataclass
class LoadLedger:
    """What a load did with every tensor; printed on rank 0 and written as JSON into the run."""

    source: str
    loaded: list[str] = field(default_factory=list)
    initialised: dict[str, str] = field(default_factory=dict)
    unused: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.unused or self.missing or self.mismatched)

    def summary(self) -> str:
        lines = [
            f"load ledger for {self.source}: {len(self.loaded)} tensors loaded, "
            f"{len(self.initialised)} newly initialised, {len(self.unused)} unused, "
            f"{len(self.missing)} missing, {len(self.mismatched)} mismatched"
        ]
        for title, items in (("missing", self.missing), ("mismatched", self.mismatched), ("unused", self.unused)):
            lines += [f"  {title}: {item}" for item in items]
        by_init: dict[str, int] = {}
        for init in self.initialised.values():
            by_init[init] = by_init.get(init, 0) + 1
        lines += [f"  initialised {n} tensors as {init}" for init, n in sorted(by_init.items())]
        return "\n".join(lines)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


def build_ledger(path: str, expected: dict[str, torch.Size], adapter: MHARStateDictAdapter) -> LoadLedger:
    """Compare the checkpoint's tensors (headers only) with the model's {key: global shape}."""
    ledger = LoadLedger(source=path)
    config_dtype = read_json(_join(path, "config.json")).get("torch_dtype")
    headers: dict[str, dict[str, Any]] = {}
    for shard in sorted(set(checkpoint_files(path).values())):
        headers.update(safetensors_header(shard))
    seen: set[str] = set()
    for hf_key, info in sorted(headers.items()):
        try:
            ours = adapter.our_key(hf_key)
        except KeyError:
            ledger.unused.append(hf_key)
            continue
        if ours is None:
            ledger.ignored.append(hf_key)
            continue
        if ours not in expected:
            ledger.unused.append(hf_key)
            continue
        seen.add(ours)
        want = tuple(expected[ours])
        dtype = _SAFETENSORS_DTYPES.get(info["dtype"])
        if tuple(info["shape"]) != want:
            ledger.mismatched.append(f"{hf_key}: shape {tuple(info['shape'])} in the checkpoint, {want} in the model")
        elif dtype is None or (config_dtype and _DTYPE_NAMES.get(dtype) != config_dtype):
            ledger.mismatched.append(f"{hf_key}: dtype {info['dtype']} in the checkpoint, config says {config_dtype}")
        else:
            ledger.loaded.append(ours)
    for key in sorted(set(expected) - seen):
        if m := _OUR_ROUTING.match(key):
            ledger.initialised[key] = ROUTING_INIT[m[3]]
        else:
            ledger.missing.append(key)
    return ledger


def model_shapes(model: torch.nn.Module) -> dict[str, torch.Size]:
    return {_clean_key(k): v.shape for k, v in model.state_dict().items()}


def load_hf_model(
    path: str,
    *,
    mhar: MHAR | dict[str, Any] | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> MHARTransformer:
    """Our model with an HF checkpoint's weights, on one process: `model(tokens) -> logits`.

    `mhar` takes the `[mhar]` settings (an MHAR or a dict of them), None for the control.
    An MHAR export (`mhar_llama`) brings its own settings: None reads them, and `mhar` settings
    that contradict them are refused naming the setting.
    The load ledger is on `model.load_ledger`; a bad checkpoint raises with it.
    """
    config = read_json(_join(path, "config.json"))
    args = model_args_from_hf_config(config, source=_join(path, "config.json"), allow_mhar=True)
    args.mhar = mhar_settings(config, mhar, _join(path, "config.json"))
    args.validate()
    with torch.device("meta"):
        model = MHARTransformer(args)
    adapter = MHARStateDictAdapter(args, path)
    ledger = build_ledger(path, model_shapes(model), adapter)
    if not ledger.ok:
        raise ValueError(ledger.summary())

    # Materialised in `dtype` at once (the complex RoPE table stays complex): an 8B model in
    # bf16 never holds an fp32 copy.
    model._apply(lambda t: t.to(dtype) if t.is_floating_point() else t)
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights()  # routing parameters and the RoPE table; base weights are overwritten
        for shard, keys in _by_shard(checkpoint_files(path)).items():
            tensors = _read_shard(shard, keys)
            ours = adapter.from_hf(tensors)
            state = model.state_dict()
            for key, value in ours.items():
                state[key].copy_(value)
    model.load_ledger = ledger
    return model


def _by_shard(files: dict[str, str]) -> dict[str, list[str]]:
    shards: dict[str, list[str]] = {}
    for key, shard in files.items():
        shards.setdefault(shard, []).append(key)
    return shards


def _read_shard(shard: str, keys: list[str]) -> dict[str, torch.Tensor]:
    with fsspec.open(shard, "rb") as f:
        tensors = load_safetensors_bytes(f.read())
    return {k: tensors[k] for k in keys if k in tensors}


# ---------------------------------------------------------------------------------------------
# writing checkpoints


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
    state = {_clean_key(k): v.detach() for k, v in model.state_dict().items()}
    routing = {k for k in state if _OUR_ROUTING.match(k)}
    if routing and not include_routing:
        open_gates = [k for k in sorted(routing) if k.endswith(".gate") and torch.count_nonzero(state[k])]
        if open_gates:
            raise ValueError(
                f"refusing to export without routing tensors: {len(open_gates)} gates are not 0 "
                f"(first: {open_gates[0]}); the plain model would not compute what was trained"
            )
        state = {k: v for k, v in state.items() if k not in routing}
    hf_state = MHARStateDictAdapter(args, base_path).to_hf(state)
    hf_state = {k: v.to(dtype).contiguous().cpu() for k, v in hf_state.items()}

    config = read_json(_join(base_path, "config.json")) if base_path else hf_config_from_model_args(args, dtype)
    config["torch_dtype"] = _DTYPE_NAMES[dtype]
    with_routing = any(_HF_ROUTING.match(k) for k in hf_state)
    mhar = {"num_heads": args.mhar.num_heads, "num_blocks": args.mhar.num_blocks, "variant": "delta"}
    config = export_config(config, mhar if with_routing else None)

    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".export-", dir=parent)
    try:
        chmod_like_mkdir(tmp)  # mkdtemp makes it 0700
        write_shards(hf_state, tmp, max_shard_bytes)
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
        if with_routing:
            copy_modeling_files(tmp)
        if base_path:
            fs, root = fsspec.core.url_to_fs(base_path)
            for name in TOKENIZER_FILES:
                if fs.exists(_join(root, name)):
                    fs.get(_join(root, name), os.path.join(tmp, name))
        if os.path.exists(out_dir):
            raise FileExistsError(f"{out_dir} already exists; export into a new directory")
        os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _clean_key(key: str) -> str:
    return key.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")


# ---------------------------------------------------------------------------------------------
# run checkpoints (torchtitan DCP) -> model


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
    folder = os.path.join(run_dir, "checkpoint")
    steps = sorted(
        int(m[1])
        for name in (os.listdir(folder) if os.path.isdir(folder) else [])
        if (m := re.fullmatch(r"step-(\d+)", name)) and os.path.isfile(os.path.join(folder, name, ".metadata"))
    )
    if not steps:
        raise FileNotFoundError(f"{folder}: no complete checkpoint (step-N with .metadata)")
    if step is None:
        step = steps[-1]
    if step not in steps:
        raise FileNotFoundError(f"{folder}: no complete checkpoint for step {step}; have {steps}")
    return os.path.join(folder, f"step-{step}")


def load_run_checkpoint(run_dir: str, step: int | None = None, *, ema: bool = False) -> MHARTransformer:
    """A run's weights at `step` (fp32, CPU, one process), read from its distributed checkpoint.

    With `ema`, the trainable parameters are the checkpoint's weight EMA instead.
    """
    import torch.distributed.checkpoint as dcp

    args, _ = run_model_args(run_dir)
    step_dir = checkpoint_step_dir(run_dir, step)
    model = build_initialised(args)
    state = model.state_dict()
    if ema:
        keys = dcp.FileSystemReader(step_dir).read_metadata().state_dict_metadata
        if not any(k.startswith("ema.") for k in keys):
            raise ValueError(f"{step_dir}: this checkpoint holds no weight EMA ([ema] enable was off, or model only)")
        trainable = {n: state[n] for n, p in model.named_parameters() if p.requires_grad}
        dcp.load({"ema": trainable}, checkpoint_id=step_dir, no_dist=True)
        state.update(trainable)
    else:
        dcp.load(state, checkpoint_id=step_dir, no_dist=True)
    model.load_state_dict(state)
    return model


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
    import copy

    from mhar_titan.train_spec import FLAVORS

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


# ---------------------------------------------------------------------------------------------
# CLI


def inspect(path: str, mhar: MHAR | None = None) -> str:
    """A config summary, the parameter count, and what a load's ledger would say."""
    config = read_json(_join(path, "config.json"))
    args = model_args_from_hf_config(config, source=_join(path, "config.json"), allow_mhar=True)
    args.mhar = mhar_settings(config, mhar, _join(path, "config.json"))
    with torch.device("meta"):
        model = MHARTransformer(args)
    ledger = build_ledger(path, model_shapes(model), MHARStateDictAdapter(args, path))
    n = sum(p.numel() for p in model.parameters())
    r = args.rope_scaling_args
    return "\n".join(
        [
            f"{path}: Llama, d={args.dim}, {args.n_layers} layers, {args.n_heads}/{args.n_kv_heads} heads, "
            f"ffn {_ffn_hidden(args)}, vocab {args.vocab_size}, eps {args.norm_eps}, rope theta {args.rope_theta} "
            f"(llama3 scaling factor {r.scaling_factor}), {n:,} parameters"
            + (" with MHAR" if args.mhar.enable else ""),
            ledger.summary(),
        ]
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="HF checkpoints for mhar-titan")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_inspect = sub.add_parser("inspect", help="config summary, parameter count, load ledger")
    p_inspect.add_argument("path")
    p_inspect.add_argument("--mhar", action="store_true", help="as the MHAR arm would load it")
    p_export = sub.add_parser("export", help="a run's checkpoint as an HF directory")
    p_export.add_argument("run_dir")
    p_export.add_argument("out_dir")
    p_export.add_argument("--step", type=int, default=None, help="default: the latest complete checkpoint")
    p_export.add_argument("--ema", action="store_true", help="the EMA weights instead of the raw ones")
    p_export.add_argument("--dtype", choices=tuple(DTYPES), default="bf16")
    p_export.add_argument("--no-routing", action="store_true", help="plain Llama (only while every gate is 0)")
    p_init = sub.add_parser("init", help="a randomly initialised base checkpoint of a flavor")
    p_init.add_argument("out_dir")
    p_init.add_argument("--flavor", default="tiny")
    p_init.add_argument("--tokenizer", default=None, help="folder whose tokenizer files are copied in")
    p_init.add_argument("--seed", type=int, default=0)
    p_init.add_argument("--dtype", choices=tuple(DTYPES), default="fp32")
    p_init.add_argument("--device", default="cpu", help="where to initialise (cuda: an 8B model in seconds)")
    args = parser.parse_args(argv)
    if args.cmd == "init":
        init_hf(args.out_dir, args.flavor, args.tokenizer, args.seed, DTYPES[args.dtype], args.device)
        print(f"wrote a random {args.flavor} base checkpoint (seed {args.seed}, {args.dtype}) to {args.out_dir}")
    elif args.cmd == "inspect":
        print(inspect(args.path, MHAR(enable=True) if args.mhar else None))
    elif args.cmd == "export":
        try:
            _export(args)
        except (FileNotFoundError, FileExistsError, ValueError) as e:  # bad input: one line, no traceback
            sys.exit(f"python -m mhar_titan.hf export: {e}")


def _export(args: argparse.Namespace) -> None:
    """The export command: every input checked before the (long) reading of the checkpoint."""
    if os.path.exists(args.out_dir):
        raise FileExistsError(f"{args.out_dir} already exists; export into a new directory")
    step_dir = checkpoint_step_dir(args.run_dir, args.step)
    _, base = run_model_args(args.run_dir)
    if base and not fsspec.core.url_to_fs(base)[0].exists(_join(base, "config.json")):
        print(f"warning: the run's base {base} is not there: the export gets no tokenizer files", file=sys.stderr)
        base = None
    print(f"reading {step_dir} ({'EMA' if args.ema else 'raw'} weights)", flush=True)
    model = load_run_checkpoint(args.run_dir, args.step, ema=args.ema)
    print(f"writing {args.out_dir} ({args.dtype})", flush=True)
    export_hf(model, args.out_dir, base_path=base, dtype=DTYPES[args.dtype], include_routing=not args.no_routing)
    print(f"exported {step_dir} to {args.out_dir} ({args.dtype})")


if __name__ == "__main__":
    main(sys.argv[1:])
