"""An HF checkpoint (plain Llama or an MHAR export) as our model on one process, and `inspect`."""

from __future__ import annotations

from typing import Any

import fsspec
import torch
from safetensors.torch import load as load_safetensors_bytes

from mhar_titan.components.ema import plain_name
from mhar_titan.hf.files import mhar_settings
from mhar_titan.hf.ledger import build_ledger, checkpoint_files, join, read_json
from mhar_titan.model.args import MHAR, model_args_from_hf_config
from mhar_titan.model.hf_config import ffn_hidden
from mhar_titan.model.model import MHARTransformer
from mhar_titan.model.state_dict_adapter import MHARStateDictAdapter


def model_shapes(model: torch.nn.Module) -> dict[str, torch.Size]:
    return {plain_name(k): v.shape for k, v in model.state_dict().items()}


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
    config = read_json(join(path, "config.json"))
    args = model_args_from_hf_config(config, source=join(path, "config.json"), allow_mhar=True)
    args.mhar = mhar_settings(config, mhar, join(path, "config.json"))
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


def inspect(path: str, mhar: MHAR | None = None) -> str:
    """A config summary, the parameter count, and what a load's ledger would say."""
    config = read_json(join(path, "config.json"))
    args = model_args_from_hf_config(config, source=join(path, "config.json"), allow_mhar=True)
    args.mhar = mhar_settings(config, mhar, join(path, "config.json"))
    with torch.device("meta"):
        model = MHARTransformer(args)
    ledger = build_ledger(path, model_shapes(model), MHARStateDictAdapter(args, path))
    n = sum(p.numel() for p in model.parameters())
    r = args.rope_scaling_args
    return "\n".join(
        [
            f"{path}: Llama, d={args.dim}, {args.n_layers} layers, {args.n_heads}/{args.n_kv_heads} heads, "
            f"ffn {ffn_hidden(args)}, vocab {args.vocab_size}, eps {args.norm_eps}, rope theta {args.rope_theta} "
            f"(llama3 scaling factor {r.scaling_factor}), {n:,} parameters"
            + (" with MHAR" if args.mhar.enable else ""),
            ledger.summary(),
        ]
    )
