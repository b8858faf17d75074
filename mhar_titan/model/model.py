"""Llama-3.1 with delta-MHAR grafted on (docs/design.md section 1).

With `[mhar] enable = false` every module and every op is torchtitan's plain
Llama-3 `Transformer`: that is the control arm. With it on, each layer's two
sublayer inputs read, through a routing site, the null source, the embedding
and the deltas of the completed blocks, scaled by a zero-initialised gate;
the residual stream itself is never modified, so at init the model computes
exactly the base model.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torchtitan.models.llama3.model.model import Transformer, TransformerBlock
from torchtitan.protocols.model import AttentionMasksType

from kernels.routing import mhar_route_sites, mhar_route_with_logits, resolve_backend, routing_source
from mhar_titan.model.args import MHARModelArgs


class RoutingSite(nn.Module):
    """One sublayer input's router: query q, norm weight g, null source z, gate. `max_sources`: the
    most sources any site of the model reads (SourceLayout.max_sources), the width of its statistics'
    weight columns (default: the sources this site reads)."""

    def __init__(self, dim: int, num_heads: int, eps: float, backend: str, max_sources: int | None = None):
        super().__init__()
        self.num_heads, self.eps, self.backend, self.max_sources = num_heads, eps, backend, max_sources
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

    def forward(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(null, query, norm weight, gate), as the routing op takes a site: views, made where FSDP2 has
        gathered them. The model calls every site of a block at the block's start, where it routes
        them together; parallelize.py gives each block's sites one FSDP2 unit, gathered by the first
        call."""
        return tuple(p.view_as(p) for p in self.params())  # type: ignore[return-value]

    def params(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(null, query, norm weight, gate), the parameters themselves."""
        return self.null, self.query, self.norm_weight, self.gate

    @torch.no_grad()
    def stats(self, logits: torch.Tensor) -> torch.Tensor:
        """[gate, mean per-head entropy, mean weight on each source (null, embedding, D_0, ...)], from
        the [N, B, T, H] logits (weights: their softmax over N), NaN-padded to `max_sources` weight
        columns so every layer's row has the same width; computed on the device, only on the steps
        that log them."""
        w = torch.softmax(logits.detach().float(), dim=0)
        entropy = -(w * torch.log(w.clamp_min(torch.finfo(w.dtype).tiny))).sum(dim=0).mean()
        per_source = w.mean(dim=(1, 2, 3))
        pad = (self.max_sources or w.shape[0]) - w.shape[0]
        if pad < 0:
            raise ValueError(f"a site read {w.shape[0]} sources, more than max_sources = {self.max_sources}")
        head = torch.stack([self.gate.detach().float().reshape(()), entropy])
        return torch.cat([head, per_source, w.new_full((pad,), float("nan"))])


class ReferenceRoute(nn.Module):
    """The torch reference's routing of one site, gate * R and its logits, as a module of its own (no
    parameters) that parallelize.py checkpoints and compiles per call: the reference saves its
    stacked fp32 sources and norms for the backward. The fused backends route a block's sites in one
    call instead (`MHARTransformer.route_block`)."""

    def __init__(self, num_heads: int, eps: float):
        super().__init__()
        self.num_heads, self.eps = num_heads, eps

    def forward(self, sources: list[torch.Tensor], *site: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return mhar_route_with_logits(None, sources, *site, num_heads=self.num_heads, eps=self.eps, backend="torch")


class BlockBody(nn.Module):
    """A block's two sublayers, taking the sites' routed terms as inputs:

        u = x + routed_attn,  h = x + Attn(attention_norm(u)),  v = h + routed_ffn,  out = h + MLP(ffn_norm(v))

    and returning (out, the running block delta: a + m, or `block_sum` + a + m summed in fp32 and
    stored in `block_sum`'s dtype). D_k is the sum of its block's sublayer outputs, never
    h_end - h_start, which cancels catastrophically in bf16 once the stream is large; summing it
    here, where a and m are computed, costs no kernel of its own. The routed terms depend on the sources alone,
    so the routing runs before the body, outside what activation checkpointing recomputes and
    torch.compile traces (parallelize.py wraps the body, not the block); the adds fuse into the
    compiled norms. It shares the block's submodules and owns no parameter of its own: the block
    does not register it, so parameter names and state dicts are the block's.
    """

    def __init__(self, block: TransformerBlock):
        super().__init__()
        self.attention = block.attention
        self.attention_norm = block.attention_norm
        self.feed_forward = block.feed_forward
        self.ffn_norm = block.ffn_norm

    def forward(
        self,
        x: torch.Tensor,
        routed_attn: torch.Tensor,
        routed_ffn: torch.Tensor,
        freqs_cis: torch.Tensor,
        attention_masks: AttentionMasksType | None,
        positions: torch.Tensor | None = None,
        block_sum: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        a = self.attention(self.attention_norm(x + routed_attn), freqs_cis, attention_masks, positions)
        h = x + a
        m = self.feed_forward(self.ffn_norm(h + routed_ffn))
        if block_sum is None:
            delta = a + m
        else:  # summed in fp32 (or wider), stored as the sum
            delta = (block_sum.to(torch.promote_types(block_sum.dtype, torch.float32)) + a + m).to(block_sum.dtype)
        return h + m, delta


class MHARBlock(TransformerBlock):
    """torchtitan's block; with routing sites and a `BlockBody` when MHAR is on."""

    def __init__(self, layer_id: int, model_args: MHARModelArgs):
        super().__init__(layer_id, model_args)
        cfg = model_args.mhar
        self.attn_routing: RoutingSite | None = None
        self.ffn_routing: RoutingSite | None = None
        if cfg.enable:
            site = (model_args.dim, cfg.num_heads, model_args.norm_eps, cfg.backend, model_args.layout.max_sources)
            self.attn_routing = RoutingSite(*site)
            self.ffn_routing = RoutingSite(*site)
            self.set_body(BlockBody(self))
            self.set_reference(ReferenceRoute(cfg.num_heads, model_args.norm_eps))

    def set_body(self, body: nn.Module) -> None:
        """The body to call: a `BlockBody` of this block, possibly wrapped (checkpoint, compile).
        Kept out of the module tree (object.__setattr__), so it adds no parameter names."""
        object.__setattr__(self, "body", body)

    def set_reference(self, reference: nn.Module) -> None:
        """The torch reference's per-site routing (`ReferenceRoute`, possibly wrapped), out of the
        module tree as the body is."""
        object.__setattr__(self, "reference", reference)

    def forward(  # type: ignore[override]
        self,
        x: torch.Tensor,
        freqs_cis: torch.Tensor,
        attention_masks: AttentionMasksType | None,
        positions: torch.Tensor | None = None,
        routed: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None,
        want_stats: bool = False,
        block_sum: torch.Tensor | None = None,
    ):
        """Plain block without `routed`; else, given its two sites' (gate * R, routing logits) (the
        model routes a block's sites at the block's start), (output, the running block delta
        (`BlockBody`), site statistics [2, SourceLayout.stats_width] or None)."""
        if routed is None:
            return super().forward(x, freqs_cis, attention_masks, positions)
        assert self.attn_routing is not None and self.ffn_routing is not None
        (routed_attn, attn_logits), (routed_ffn, ffn_logits) = routed
        out, delta = self.body(x, routed_attn, routed_ffn, freqs_cis, attention_masks, positions, block_sum)
        if not want_stats:
            return out, delta, None
        # the gates stay gathered from the block's start (parallelize.py: not resharded after forward)
        stats = torch.stack([self.attn_routing.stats(attn_logits), self.ffn_routing.stats(ffn_logits)])
        return out, delta, stats

    def sites(self) -> tuple[RoutingSite, RoutingSite]:
        assert self.attn_routing is not None and self.ffn_routing is not None
        return self.attn_routing, self.ffn_routing

    def init_weights(self):
        super().init_weights()
        for site in (self.attn_routing, self.ffn_routing):
            if site is not None:
                site.reset_parameters()


class MHARTransformer(Transformer):
    """Llama-3.1 whose blocks route over depth when `model_args.mhar.enable`.

    With `collect_routing_stats` set (the trainer sets it on the steps that log them),
    `routing_stats` holds, after each MHAR forward, the [n_layers, 2, stats_width] site statistics of
    that forward (as sources.py lays them out: columns STAT_NAMES, then each source's mean weight, NaN
    where a layer has no such source; rows SITE_NAMES); otherwise None.
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
        self.collect_routing_stats = False
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
        embedding = h
        if torch.is_autocast_enabled(h.device.type):
            # One GPU, no FSDP: the embedding is fp32 there (autocast leaves it), the block deltas
            # bf16. Routed in the autocast dtype, as under FSDP's bf16 parameters: half the reads.
            embedding = h.to(torch.get_autocast_dtype(h.device.type))
        sources = [routing_source(embedding, backend)]
        layout = self.model_args.layout
        want_stats = self.collect_routing_stats
        layers = list(self.layers.values())
        stats = []
        for b, layer_ids in enumerate(layout.blocks()):
            block = [layers[i] for i in layer_ids]
            feeds = layout.delta_is_source(b)  # the last block's delta is never a source
            block_sum = None
            for layer, routed in zip(block, self.route_block(block, sources), strict=True):
                h, delta, site_stats = layer(
                    h,
                    self.freqs_cis,
                    attention_masks,
                    positions,
                    routed=routed,
                    want_stats=want_stats,
                    block_sum=block_sum,
                )
                block_sum = delta if feeds else None
                stats.append(site_stats)
            if feeds:
                # A new list: the block that read the old one keeps it for its backward.
                sources = [*sources, routing_source(block_sum, backend)]
        self.routing_stats = torch.stack(stats) if want_stats else None
        h = self.norm(h)
        return self.output(h)

    def route_block(
        self, block: list[MHARBlock], sources: list[torch.Tensor]
    ) -> list[tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]]:
        """Every site of a block over the block's sources, at its start: per layer, its attention and
        MLP sites' (gate * R, routing logits). The fused kernels route them in one call, reading each
        source once for several sites (kernels.routing.mhar_route_sites); the torch reference site by
        site, through each layer's `ReferenceRoute`."""
        cfg = self.model_args.mhar
        owners = [layer for layer in block for _ in layer.sites()]
        sites = [site() for layer in block for site in layer.sites()]  # FSDP2 gathers the block's unit here
        if resolve_backend(cfg.backend, sources[0].device) == "torch":
            outs = [layer.reference(sources, *site) for layer, site in zip(owners, sites, strict=True)]
        else:
            outs = mhar_route_sites(
                sources, sites, num_heads=cfg.num_heads, eps=self.model_args.norm_eps, backend=cfg.backend
            )
        return [(outs[at], outs[at + 1]) for at in range(0, len(outs), 2)]


def build_initialised(model_args: MHARModelArgs, device: str | torch.device = "cpu") -> MHARTransformer:
    """The model with torchtitan's initialisation, built on meta and then materialised once on `device`."""
    with torch.device("meta"):
        model = MHARTransformer(model_args)
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights()
    return model
