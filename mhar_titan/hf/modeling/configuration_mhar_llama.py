"""Configuration of the MHAR arm's HF export: Llama-3.x plus the delta-MHAR routing settings.

Copied into every MHAR export beside modeling_mhar_llama.py and loaded through `auto_map` with
`trust_remote_code=True`; it imports only transformers, never mhar_titan.

How a plain Llama loader refuses the folder: config.json carries `layer_types`, one
`MHAR_LAYER_TYPE` entry per layer. transformers' `LlamaConfig` validates every `layer_types`
entry against its known attention kinds, so `LlamaForCausalLM.from_pretrained(folder)` raises
("The `layer_types` entries must be in (...) but got ['mhar_delta', ...]") instead of
loading the base weights and dropping the routing tensors as unexpected keys.
`MHARLlamaConfig` takes the entries off as it is built (the layers are full causal attention
for the mask and the KV cache) and writes them back whenever it is serialised.
"""

from __future__ import annotations

from typing import Any

from transformers import LlamaConfig

MHAR_LAYER_TYPE = "mhar_delta"


class MHARLlamaConfig(LlamaConfig):
    """LlamaConfig with `mhar = {"num_heads": H, "num_blocks": B, "variant": "delta"}`."""

    model_type = "mhar_llama"

    def __init__(self, mhar: dict[str, Any] | None = None, **kwargs: Any) -> None:
        layer_types = kwargs.pop("layer_types", None)
        super().__init__(**kwargs)
        self.mhar = {"num_heads": 8, "num_blocks": 8, "variant": "delta", **(mhar or {})}
        if layer_types is not None and list(layer_types) != [MHAR_LAYER_TYPE] * self.num_hidden_layers:
            raise ValueError(
                f"layer_types = {layer_types!r}: an MHAR Llama has {self.num_hidden_layers} {MHAR_LAYER_TYPE!r} layers"
            )
        if self.mhar["variant"] != "delta":
            raise ValueError(f"mhar.variant = {self.mhar['variant']!r}: only 'delta' is implemented")
        heads, blocks = self.mhar["num_heads"], self.mhar["num_blocks"]
        if heads <= 0 or self.hidden_size % heads:
            raise ValueError(f"mhar.num_heads = {heads} must be positive and divide hidden_size {self.hidden_size}")
        if blocks <= 0 or self.num_hidden_layers % blocks:
            raise ValueError(
                f"mhar.num_blocks = {blocks} must be positive and divide num_hidden_layers {self.num_hidden_layers}"
            )

    def to_dict(self) -> dict[str, Any]:
        """With the `layer_types` marker, so that a re-saved folder still refuses a plain Llama loader."""
        out = super().to_dict()
        out["layer_types"] = [MHAR_LAYER_TYPE] * self.num_hidden_layers
        return out

    def to_diff_dict(self) -> dict[str, Any]:
        out = super().to_diff_dict()
        out["layer_types"] = [MHAR_LAYER_TYPE] * self.num_hidden_layers
        out["mhar"] = dict(self.mhar)
        return out


__all__ = ["MHARLlamaConfig", "MHAR_LAYER_TYPE"]
