"""config.json of an HF Llama-3.x checkpoint <-> torchtitan's Llama-3 model arguments, and the names the MHAR
arm's HF export goes by. What the model cannot represent is refused naming the field."""

from __future__ import annotations

from typing import Any

import torch
from torchtitan.models.llama3.model.args import RoPEScalingArgs, TransformerModelArgs

MHAR_MODEL_TYPE = "mhar_llama"
MHAR_ARCHITECTURE = "MHARLlamaForCausalLM"
LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def llama3_rope_scaling(rope: dict[str, Any], source: str, field_name: str = "rope_scaling") -> RoPEScalingArgs:
    """torchtitan's RoPE scaling arguments for an HF llama3 `rope_scaling` block, or a ValueError naming the key."""
    for key in LLAMA3_ROPE_KEYS:
        if key not in rope:
            raise ValueError(
                f"{source}: {field_name}.{key} is missing (rope type llama3 needs {', '.join(LLAMA3_ROPE_KEYS)})"
            )
    try:
        return RoPEScalingArgs(
            scaling_factor=float(rope["factor"]),
            low_freq_factor=float(rope["low_freq_factor"]),
            high_freq_factor=float(rope["high_freq_factor"]),
            original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
        )
    except (TypeError, ValueError):
        values = {k: rope[k] for k in LLAMA3_ROPE_KEYS}
        raise ValueError(f"{source}: {field_name}: {values} are not all numbers") from None


def _refusal(config: dict[str, Any], source: str, field_name: str, why: str) -> ValueError:
    return ValueError(f"{source}: {field_name} = {config.get(field_name)!r}: {why}")


def _check_representable(config: dict[str, Any], source: str, allow_mhar: bool) -> None:
    """Refuses, naming the field, a config whose model type, architecture, biases, tying, activation or
    head size the model cannot represent."""
    mhar_export = config.get("model_type") == MHAR_MODEL_TYPE
    if mhar_export and not allow_mhar:
        raise _refusal(
            config, source, "model_type", "an MHAR export is not a training base; start from a plain Llama checkpoint"
        )
    if config.get("model_type") != "llama" and not mhar_export:
        raise _refusal(config, source, "model_type", "only Llama checkpoints are supported")
    arch = MHAR_ARCHITECTURE if mhar_export else "LlamaForCausalLM"
    if (config.get("architectures") or [arch]) != [arch]:
        raise _refusal(config, source, "architectures", f"expected [{arch!r}]")
    for name in ("attention_bias", "mlp_bias"):
        if config.get(name):
            raise _refusal(config, source, name, "biases are not supported by the model")
    if config.get("tie_word_embeddings"):
        raise _refusal(config, source, "tie_word_embeddings", "the model has an untied output projection")
    if config.get("hidden_act", "silu") != "silu":
        raise _refusal(config, source, "hidden_act", "the model's MLP is SwiGLU (silu)")
    dim, n_heads = config["hidden_size"], config["num_attention_heads"]
    if config.get("head_dim", dim // n_heads) != dim // n_heads or dim % n_heads:
        raise _refusal(config, source, "head_dim", f"must be hidden_size / num_attention_heads = {dim / n_heads}")


def _rope(config: dict[str, Any], source: str) -> tuple[float, RoPEScalingArgs]:
    """RoPE theta and scaling from `rope_scaling` (or the newer `rope_parameters`): llama3 or none."""
    rope_field = "rope_scaling" if config.get("rope_scaling") else "rope_parameters"
    rope = config.get(rope_field) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
    if rope_type == "llama3":
        scaling = llama3_rope_scaling(rope, source, rope_field)
    elif rope_type == "default":
        scaling = RoPEScalingArgs(scaling_factor=1.0)  # llama3 scaling with factor 1 is the identity
    else:
        raise _refusal(config, source, "rope_scaling", f"rope type {rope_type!r} is not supported (llama3 or default)")
    return theta, scaling


def llama_args_from_hf_config(
    config: dict[str, Any], source: str = "config.json", *, allow_mhar: bool = False
) -> TransformerModelArgs:
    """Model arguments for a Llama-3.x config.json, or a ValueError naming the field we cannot represent.

    An MHAR export (`mhar_llama`) only with `allow_mhar` (load_hf_model, inspect: they use its own
    settings); as a training base its routing would load under the run's unchecked `[mhar]` settings.
    """
    _check_representable(config, source, allow_mhar)
    dim, n_heads = config["hidden_size"], config["num_attention_heads"]
    theta, scaling = _rope(config, source)

    # torchtitan sizes the MLP as multiple_of * ceil(int(multiplier * int(8 * dim / 3)) / multiple_of):
    # multiple_of = intermediate_size and a multiplier just reaching it give exactly intermediate_size.
    hidden = config["intermediate_size"]
    eos = config.get("eos_token_id")
    args = TransformerModelArgs(
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
        raise _refusal(config, source, "intermediate_size", "cannot be represented by the model's MLP sizing")
    return args


def ffn_hidden(args: TransformerModelArgs) -> int:
    hidden = int(2 * 4 * args.dim / 3)
    if args.ffn_dim_multiplier is not None:
        hidden = int(args.ffn_dim_multiplier * hidden)
    return args.multiple_of * ((hidden + args.multiple_of - 1) // args.multiple_of)


def hf_config_from_model_args(args: TransformerModelArgs, dtype: torch.dtype) -> dict[str, Any]:
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
