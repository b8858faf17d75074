"""The MHAR arm as an HF model: Llama-3.x whose sublayer inputs read a routed mix over depth.

Copied into every MHAR export and loaded with `trust_remote_code=True`; it needs only torch and
transformers. The routing is written out plainly, as the project's reference op computes it:

    u_l = h_{l-1} + gate_attn * R_attn(S_l)      a_l = Attn(input_layernorm(u_l));  h'_l = h_{l-1} + a_l
    v_l = h'_l    + gate_ffn  * R_ffn(S_l)       m_l = MLP(post_attention_layernorm(v_l));  h_l = h'_l + m_l
    R_[h] = sum_n softmax_n(<q_h, k_{n,[h]}>) * s_{n,[h]},   k_n = s_n / rms(s_n) * g

with sources S_l = [z, h_0, D_0, ..., D_{b-1}] for layer l in block b: the site's null vector z,
the token embedding and the sums D_k of the sublayer outputs (a + m) of each completed block.
The residual stream itself is never changed, so with every gate 0 this is the base Llama.

Every source is a per-token hidden state of the same position, so the routing mixes across depth
only: the model stays causal per position and the KV cache works exactly as in Llama.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import transformers
from packaging.version import Version
from torch import nn

if Version(transformers.__version__) < Version("5.17"):
    raise ImportError(
        f"the MHAR model needs transformers >= 5.17 (5.17 and 5.24 tested); found {transformers.__version__}"
    )

from transformers import initialization as init  # noqa: E402 (after the version check: older releases lack it)
from transformers.cache_utils import DynamicCache  # noqa: E402
from transformers.masking_utils import create_causal_mask  # noqa: E402
from transformers.modeling_outputs import BaseModelOutputWithPast  # noqa: E402
from transformers.models.llama.modeling_llama import (  # noqa: E402
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaModel,
    LlamaPreTrainedModel,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
)

from .configuration_mhar_llama import MHARLlamaConfig  # noqa: E402

# The KV cache's argument name: `past_key_values` until transformers 5.2x renamed it `cache`.
CACHE_ARG = "cache" if "cache" in inspect.signature(LlamaModel.forward).parameters else "past_key_values"


class MHARRoutingSite(nn.Module):
    """One sublayer input's router: query q, norm weight g, null source z, gate (q = z = gate = 0, g = 1 at init)."""

    def __init__(self, hidden_size: int, num_heads: int, eps: float) -> None:
        super().__init__()
        self.num_heads, self.eps = num_heads, eps
        self.query = nn.Parameter(torch.zeros(hidden_size))
        self.norm_weight = nn.Parameter(torch.ones(hidden_size))
        self.null = nn.Parameter(torch.zeros(hidden_size))
        self.gate = nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor, sources: list[torch.Tensor]) -> torch.Tensor:
        """x + gate * R(sources); statistics and the mix in fp32, the result in x's dtype."""
        acc = torch.promote_types(x.dtype, torch.float32)
        heads = self.num_heads
        s = torch.stack([self.null.to(acc).expand_as(x)] + [t.to(acc) for t in sources])  # [N, B, T, d]
        k = s * torch.rsqrt(s.square().mean(dim=-1, keepdim=True) + self.eps) * self.norm_weight.to(acc)
        split = (*s.shape[:-1], heads, s.shape[-1] // heads)
        logits = (k.view(split) * self.query.to(acc).view(heads, -1)).sum(dim=-1)  # [N, B, T, H]
        weights = torch.softmax(logits, dim=0)
        mixed = (weights.unsqueeze(-1) * s.view(split)).sum(dim=0).reshape(x.shape)
        return (x.to(acc) + self.gate.to(acc).reshape(()) * mixed).to(x.dtype)


class MHARLlamaDecoderLayer(LlamaDecoderLayer):
    """Llama's decoder layer whose attention and MLP read the routed inputs; returns (h, the running
    block delta: a + m, or block_sum + a + m summed in fp32, in block_sum's dtype)."""

    def __init__(self, config: MHARLlamaConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        site = (config.hidden_size, config.mhar["num_heads"], config.rms_norm_eps)
        self.mhar = nn.ModuleDict({"attn": MHARRoutingSite(*site), "ffn": MHARRoutingSite(*site)})

    def forward(  # type: ignore[override]
        self,
        hidden_states: torch.Tensor,
        sources: list[torch.Tensor],
        block_sum: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        u = self.mhar["attn"](hidden_states, sources)
        a, _ = self.self_attn(hidden_states=self.input_layernorm(u), **kwargs)
        h = hidden_states + a
        v = self.mhar["ffn"](h, sources)
        m = self.mlp(self.post_attention_layernorm(v))
        # D_k sums its block's sublayer outputs (never h_end - h_start, which cancels in bf16)
        if block_sum is None:
            delta = a + m
        else:  # summed in fp32 (or wider), stored as the sum
            delta = (block_sum.to(torch.promote_types(block_sum.dtype, torch.float32)) + a + m).to(block_sum.dtype)
        return h + m, delta


class MHARLlamaPreTrainedModel(LlamaPreTrainedModel):
    config_class = MHARLlamaConfig
    config: MHARLlamaConfig
    _no_split_modules = ["MHARLlamaDecoderLayer"]
    _can_record_outputs: dict[str, Any] = {}  # the layers return (h, delta): no hidden-state capture

    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if isinstance(module, MHARRoutingSite):
            init.zeros_(module.query)
            init.ones_(module.norm_weight)
            init.zeros_(module.null)
            init.zeros_(module.gate)


class MHARLlamaModel(MHARLlamaPreTrainedModel, LlamaModel):
    def __init__(self, config: MHARLlamaConfig) -> None:
        MHARLlamaPreTrainedModel.__init__(self, config)  # LlamaModel.__init__ would build plain layers
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList(MHARLlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config=config)
        self.gradient_checkpointing = False
        self.post_init()

    def forward(  # type: ignore[override]
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        **kwargs: Any,
    ) -> BaseModelOutputWithPast:
        """LlamaModel.forward, with the sources of the routing carried from layer to layer."""
        cache = kwargs.pop(CACHE_ARG, None)
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if use_cache is None:
            use_cache = self.config.use_cache
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        if position_ids is None:
            past_seen_tokens = cache.get_seq_length() if cache is not None else 0
            position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past_seen_tokens
            position_ids = position_ids.unsqueeze(0)
        causal_mask = create_causal_mask(
            config=self.config,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            position_ids=position_ids,
            **{CACHE_ARG: cache},
        )
        position_embeddings = self.rotary_emb(inputs_embeds, position_ids=position_ids)

        hidden_states = inputs_embeds
        sources = [inputs_embeds]
        per_block = self.config.num_hidden_layers // self.config.mhar["num_blocks"]
        block_sum = None
        for i, layer in enumerate(self.layers):
            hidden_states, block_sum = layer(
                hidden_states,
                sources,
                block_sum,
                attention_mask=causal_mask,
                position_embeddings=position_embeddings,
                position_ids=position_ids,
                use_cache=use_cache,
                **{CACHE_ARG: cache},
                **kwargs,
            )
            if i >= self.config.num_hidden_layers - per_block:
                block_sum = None  # the last block's delta is never a source
            elif (i + 1) % per_block == 0:
                sources = [*sources, block_sum]
                block_sum = None
        return BaseModelOutputWithPast(last_hidden_state=self.norm(hidden_states), **{CACHE_ARG: cache})


class MHARLlamaForCausalLM(MHARLlamaPreTrainedModel, LlamaForCausalLM):
    """LlamaForCausalLM (its forward, loss and generation) over an MHARLlamaModel."""

    def __init__(self, config: MHARLlamaConfig) -> None:
        MHARLlamaPreTrainedModel.__init__(self, config)
        self.model = MHARLlamaModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()


__all__ = ["MHARLlamaForCausalLM", "MHARLlamaModel", "MHARLlamaPreTrainedModel"]
