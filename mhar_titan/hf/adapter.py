"""torchtitan's Llama-3 state-dict adapter with the routing tensors, and config.json <-> model arguments.

The control maps to a plain `LlamaForCausalLM`; the MHAR arm adds `model.layers.N.mhar.{attn,ffn}.*`.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torchtitan.models.llama3.model.args import RoPEScalingArgs
from torchtitan.models.llama3.model.state_dict_adapter import Llama3StateDictAdapter

from mhar_titan.hf.files import MHAR_ARCHITECTURE, MHAR_MODEL_TYPE, llama3_rope_scaling
from mhar_titan.model import MHARModelArgs

ROUTING_PARAMS = ("query", "norm_weight", "null", "gate")
ROUTING_INIT = {"query": "zeros", "norm_weight": "ones", "null": "zeros", "gate": "zeros"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")
SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}  # CLI names
OUR_ROUTING = re.compile(r"^layers\.(\d+)\.(attn|ffn)_routing\.(\w+)$")
HF_ROUTING = re.compile(r"^model\.layers\.(\d+)\.mhar\.(attn|ffn)\.(\w+)$")


class MHARStateDictAdapter(Llama3StateDictAdapter):
    """torchtitan's Llama-3 key map and RoPE permutation, plus the routing tensors."""

    def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        base = {k: v for k, v in state_dict.items() if not OUR_ROUTING.match(k)}
        out = super().to_hf(base)
        for key, value in state_dict.items():
            if m := OUR_ROUTING.match(key):
                out[f"model.layers.{m[1]}.mhar.{m[2]}.{m[3]}"] = value
        return out

    def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
        base = {k: v for k, v in hf_state_dict.items() if not HF_ROUTING.match(k)}
        out = super().from_hf(base)
        for key, value in hf_state_dict.items():
            if m := HF_ROUTING.match(key):
                out[f"layers.{m[1]}.{m[2]}_routing.{m[3]}"] = value
        return out

    def our_key(self, hf_key: str) -> str | None:
        """The model key an HF key loads into; None for buffers HF stores and we recompute."""
        if m := HF_ROUTING.match(hf_key):
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
    if ffn_hidden(args) != hidden:
        raise refuse("intermediate_size", "cannot be represented by the model's MLP sizing")
    return args


def ffn_hidden(args: MHARModelArgs) -> int:
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
        "intermediate_size": ffn_hidden(args),
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
        "torch_dtype": DTYPE_NAMES[dtype],
    }
