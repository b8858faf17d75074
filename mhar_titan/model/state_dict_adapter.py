"""torchtitan's Llama-3 state-dict adapter (key map and RoPE permutation) plus the routing tensors of the MHAR arm
(`layers.N.{attn,ffn}_routing.*` <-> `model.layers.N.mhar.{attn,ffn}.*`), as torchtitan keeps one beside each
model (torchtitan/models/llama3/model/state_dict_adapter.py)."""

from __future__ import annotations

import re
from typing import Any

from torchtitan.models.llama3.model.state_dict_adapter import Llama3StateDictAdapter

ROUTING_PARAMS = ("query", "norm_weight", "null", "gate")
ROUTING_INIT = {"query": "zeros", "norm_weight": "ones", "null": "zeros", "gate": "zeros"}
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
