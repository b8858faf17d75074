"""The routing sources' layout: which sources each site reads, in what order, and how many (docs/design.md
section 1.2). The one place that knows it: the model, the `[mhar]` checks, the routing statistics and their
TensorBoard names, the comparison, the memory plan, parallelize, the preflight and the benchmarks take it from
here. Standard library only, so the comparison imports it without torch or the kernels; the HF modeling file,
which must stand alone, is held to it by tests/test_hf_modeling.py.

A layer of block b = layer // layers_per_block has two sites (SITE_NAMES); each reads the null source z, the
embedding h_0 and the deltas D_0 .. D_{b-1} of the blocks before its own: 2 + b sources. The last block's
delta is never a source, so no site reads more than num_blocks + 1. The routing op takes z as a site
parameter and the others as its caller sources (kernels.routing.mhar_route_sites), at most num_blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

SITE_NAMES = ("attn", "ffn")  # a layer's routing sites: the attention's input, then the MLP's
STAT_NAMES = ("gate", "entropy")  # a site's statistics before its per-source mean weights
NULL, EMBED = "null", "embed"
BASE_SOURCES = (NULL, EMBED)  # what every site reads, first: block 0's whole list


def delta_name(k: int) -> str:
    """D_k's name: d00, d01, ... (in TensorBoard tags, `w_d03`)."""
    return f"d{k:02d}"


def delta_index(name: str) -> int | None:
    """k for D_k's name ('d03': 3); None for any other name."""
    return int(name[1:]) if name.startswith("d") and name[1:].isdigit() else None


def with_null(caller_sources: int) -> int:
    """The sources a site reads when the op is given `caller_sources`: the null is the site's parameter, the op's
    source 0, never the caller's."""
    return 1 + caller_sources


def without_null(site_sources: int) -> int:
    """The caller sources of a site that reads `site_sources` (the inverse of `with_null`)."""
    return site_sources - 1


@dataclass(frozen=True)
class SourceLayout:
    """`[mhar] num_blocks` blocks of equal length over `n_layers` layers (refused otherwise: ValueError)."""

    num_blocks: int
    n_layers: int

    def __post_init__(self) -> None:
        if self.num_blocks <= 0 or self.n_layers < self.num_blocks or self.n_layers % self.num_blocks:
            raise ValueError(
                f"num_blocks = {self.num_blocks} must be positive and divide the layer count {self.n_layers}"
            )

    @classmethod
    def of_stats(cls, n_layers: int, width: int) -> SourceLayout:
        """The layout whose routing statistics are [n_layers, 2, width] (`stats_width`)."""
        return cls(without_null(width - len(STAT_NAMES)), n_layers)  # max_sources is num_blocks + 1

    @property
    def layers_per_block(self) -> int:
        return self.n_layers // self.num_blocks

    @property
    def sites_per_block(self) -> int:
        """What the model routes in one call: every site of a block."""
        return len(SITE_NAMES) * self.layers_per_block

    def block(self, layer: int) -> int:
        """The block `layer` lies in: it reads the deltas of the blocks before it."""
        if not 0 <= layer < self.n_layers:
            raise ValueError(f"layer {layer}: the model has layers 0..{self.n_layers - 1}")
        return layer // self.layers_per_block

    def blocks(self) -> tuple[range, ...]:
        """Each block's layers, in order."""
        per = self.layers_per_block
        return tuple(range(start, start + per) for start in range(0, self.n_layers, per))

    def delta_is_source(self, block: int) -> bool:
        """Whether the block's delta is read by later blocks (every block's but the last)."""
        return block < self.deltas

    @property
    def deltas(self) -> int:
        """The block deltas that become sources."""
        return self.num_blocks - 1

    def site_sources(self, layer: int) -> int:
        """The sources each site of `layer` reads, the null included: the first `site_sources` of `names`."""
        return len(BASE_SOURCES) + self.block(layer)

    def caller_sources(self, layer: int) -> int:
        """The sources the routing op is given for `layer`'s sites: the embedding and the earlier blocks' deltas."""
        return without_null(self.site_sources(layer))

    @property
    def max_sources(self) -> int:
        """The most sources a site reads, the null included (the last block's)."""
        return self.site_sources(self.n_layers - 1)

    @property
    def max_caller_sources(self) -> int:
        """The most caller sources a routing call is given: what a fused kernel must take."""
        return self.caller_sources(self.n_layers - 1)

    def fits(self, capacity: int) -> bool:
        """Whether a routing op taking at most `capacity` caller sources routes every site."""
        return self.max_caller_sources <= capacity

    @property
    def names(self) -> tuple[str, ...]:
        """Every source's name in the op's order, `max_sources` of them; a layer reads the first `site_sources`."""
        return (*BASE_SOURCES, *(delta_name(k) for k in range(self.deltas)))

    @property
    def stats_width(self) -> int:
        """Columns of a site's statistics: STAT_NAMES, then one mean weight per name of `names` (NaN past the
        sources the site reads)."""
        return len(STAT_NAMES) + self.max_sources
