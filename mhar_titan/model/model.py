"""Llama-3.1 with delta-MHAR grafted on (docs/design.md section 2).

With `[mhar] enable = false` every module and every op is torchtitan's plain
Llama-3 `Transformer`: that is the control arm. With it on, each layer's two
sublayer inputs read, through a routing site, the null source, the embedding
and the deltas of the completed blocks, scaled by a zero-initialised gate;
the residual stream itself is never modified, so at init the model computes
exactly the base model.
"""

from __future__ import annotations

import torch
from torch import nn
from torchtitan.models.llama3.model.model import Transformer, TransformerBlock
from torchtitan.protocols.model import AttentionMasksType

from kernels.routing import mhar_route_with_weights, routing_source
from mhar_titan.model.args import MHARModelArgs

# Columns of the per-site statistics each block returns (see RoutingSite.stats).
STAT_NAMES = ("gate", "entropy", "w_null", "w_embed", "w_deltas")
SITE_NAMES = ("attn", "ffn")


class RoutingSite(nn.Module):
    """One sublayer input's router: query q, norm weight g, null source z, gate."""

    def __init__(self, dim: int, num_heads: int, eps: float, backend: str):
        super().__init__()
        self.num_heads, self.eps, self.backend = num_heads, eps, backend
        self.query = nn.Parameter(torch.empty(dim))
        self.norm_weight = nn.Parameter(torch.empty(dim))
        self.null = nn.Parameter(torch.empty(dim))
        self.gate = nn.Parameter(torch.empty(1))  # 1 element: FSDP2 cannot shard 0-dim parameters

    def reset_parameters(self) -> None:
        """q = 0 (uniform weights), g = 1, z = 0, gate = 0: the site starts as the identity."""
        nn.init.zeros_(self.query)
        nn.init.ones_(self.norm_weight)
        nn.init.zeros_(self.null)
        nn.init.zeros_(self.gate)

    def forward(self, x: torch.Tensor, sources: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        out, weights = mhar_route_with_weights(
            x,
            sources,
            self.null,
            self.query,
            self.norm_weight,
            self.gate,
            num_heads=self.num_heads,
            eps=self.eps,
            backend=self.backend,
        )
        return out, self.stats(weights)

    @torch.no_grad()
    def stats(self, weights: torch.Tensor) -> torch.Tensor:
        """[gate, mean per-head entropy, mean weight on null, on embedding, on all deltas].

        A few reductions over the [N, B, T, H] weights: negligible next to the
        routing itself, so they are computed every step and logged every stats_freq.
        """
        w = weights.detach().float()
        entropy = -(w * torch.log(w.clamp_min(torch.finfo(w.dtype).tiny))).sum(dim=0).mean()
        deltas = w[2:].sum(dim=0).mean() if w.shape[0] > 2 else w.new_zeros(())
        return torch.stack([self.gate.detach().float().reshape(()), entropy, w[0].mean(), w[1].mean(), deltas])


class MHARBlock(TransformerBlock):
    """torchtitan's block; with routing sites when MHAR is on."""

    def __init__(self, layer_id: int, model_args: MHARModelArgs):
        super().__init__(layer_id, model_args)
        cfg = model_args.mhar
        self.attn_routing: RoutingSite | None = None
        self.ffn_routing: RoutingSite | None = None
        if cfg.enable:
            self.attn_routing = RoutingSite(model_args.dim, cfg.num_heads, model_args.norm_eps, cfg.backend)
            self.ffn_routing = RoutingSite(model_args.dim, cfg.num_heads, model_args.norm_eps, cfg.backend)

    def forward(  # type: ignore[override]
        self,
        x: torch.Tensor,
        freqs_cis: torch.Tensor,
        attention_masks: AttentionMasksType | None,
        positions: torch.Tensor | None = None,
        sources: list[torch.Tensor] | None = None,
    ):
        """Plain block without `sources`; else returns (output, a + m, site statistics [2, 5])."""
        if sources is None:
            return super().forward(x, freqs_cis, attention_masks, positions)
        assert self.attn_routing is not None and self.ffn_routing is not None
        u, attn_stats = self.attn_routing(x, sources)
        a = self.attention(self.attention_norm(u), freqs_cis, attention_masks, positions)
        h = x + a
        v, ffn_stats = self.ffn_routing(h, sources)
        m = self.feed_forward(self.ffn_norm(v))
        return h + m, a + m, torch.stack([attn_stats, ffn_stats])

    def init_weights(self):
        super().init_weights()
        for site in (self.attn_routing, self.ffn_routing):
            if site is not None:
                site.reset_parameters()


class BlockDelta(nn.Module):
    """D_k: the sum of a block's sublayer outputs a + m, in fp32, never h_end - h_start,
    which cancels catastrophically in bf16 once the stream is large.

    A module of its own so that per-block compile can fuse the sum into one kernel
    (parallelize.py); it holds no parameters.
    """

    def forward(self, deltas: list[torch.Tensor]) -> torch.Tensor:
        acc = deltas[0].float()
        for delta in deltas[1:]:
            acc = acc + delta
        return acc.to(deltas[0].dtype)


class MHARTransformer(Transformer):
    """Llama-3.1 whose blocks route over depth when `model_args.mhar.enable`.

    `routing_stats` holds, after each MHAR forward, the [n_layers, 2, 5] site
    statistics of that forward (columns: STAT_NAMES; rows: attn, ffn).
    """

    def __init__(self, model_args: MHARModelArgs):
        model_args.validate()
        # Forked from torchtitan 0.2.2 torchtitan/models/llama3/model/model.py, Transformer.__init__, with
        # MHARBlock layers (calling it would build every block twice).
        nn.Module.__init__(self)
        self.model_args = model_args
        self.vocab_size = model_args.vocab_size
        self.n_layers = model_args.n_layers
        self.tok_embeddings = nn.Embedding(model_args.vocab_size, model_args.dim)
        self.register_buffer("freqs_cis", self._precompute_freqs_cis(), persistent=False)
        self.layers = nn.ModuleDict({str(i): MHARBlock(i, model_args) for i in range(model_args.n_layers)})
        self.norm = nn.RMSNorm(model_args.dim, eps=model_args.norm_eps)
        self.output = nn.Linear(model_args.dim, model_args.vocab_size, bias=False)
        self.block_delta = BlockDelta()
        self.routing_stats: torch.Tensor | None = None

    def forward(
        self,
        tokens: torch.Tensor,
        attention_masks: AttentionMasksType | None = None,
        positions: torch.Tensor | None = None,
    ):
        if not self.model_args.mhar.enable:
            return super().forward(tokens, attention_masks, positions)

        h = self.tok_embeddings(tokens)
        backend = self.model_args.mhar.backend
        sources = [routing_source(h, backend)]
        per_block = self.model_args.layers_per_block
        deltas: list[torch.Tensor] = []
        stats = []
        for i, layer in enumerate(self.layers.values()):
            h, delta, site_stats = layer(h, self.freqs_cis, attention_masks, positions, sources=sources)
            stats.append(site_stats)
            if i >= self.n_layers - per_block:
                continue  # the last block's delta is never a source
            deltas.append(delta)
            if len(deltas) == per_block:
                # A new list: activation checkpointing re-runs earlier layers with the list
                # they were given, so it must never grow in place.
                sources = [*sources, routing_source(self.block_delta(deltas), backend)]
                deltas = []
        self.routing_stats = torch.stack(stats).detach()
        h = self.norm(h)
        return self.output(h)


def build_initialised(model_args: MHARModelArgs, device: str | torch.device = "cpu") -> MHARTransformer:
    """The model with torchtitan's initialisation, built on meta and then materialised once on `device`."""
    with torch.device("meta"):
        model = MHARTransformer(model_args)
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights()
    return model
