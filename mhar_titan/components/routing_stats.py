"""Routing statistics for TensorBoard: per-site gate, entropy and the mean weight on each source.

The model leaves the [n_layers, 2, 2 + num_blocks + 1] statistics of its last forward in
`model.routing_stats` (on the steps the trainer asks for them; columns: gate, entropy, then each
source's mean weight, NaN where a layer's block has no such source); the hook `RoutingStatistics` asks for them,
has them averaged over the data-parallel ranks on the device and read back with the step's other values (a
`mean` Scalar, components/hooks.py), and names them here:
`mhar_<site>_<stat>/layerNN` per site (gate, entropy, w_null, w_embed, w_deltas: all deltas
summed, and w_d00, w_d01, ...: each block delta D_k the layer reads), with `mhar/<stat>/mean` over
all sites (tensorboard_scalars.py holds the names).
"""

from __future__ import annotations

from typing import Any

import torch

from mhar_titan.components.hooks import Hook, Scalar, Step
from mhar_titan.components.tensorboard_scalars import (
    ROUTING_MEAN_STATS,
    routing_mean_tag,
    routing_site_tag,
    routing_sources,
)
from mhar_titan.model.model import SITE_NAMES, STAT_NAMES


def name_routing_stats(values: torch.Tensor) -> dict[str, float]:
    """Each value of a [n_layers, 2, 2 + num_blocks + 1] host tensor under its TensorBoard name, and the
    means over sites. A layer of block b has 2 + b sources: the padding beyond them is not logged."""
    n_layers, n_sites, width = values.shape
    num_blocks = width - len(STAT_NAMES) - 1
    if n_sites != len(SITE_NAMES) or num_blocks < 1 or n_layers % num_blocks:
        raise ValueError(f"routing statistics of shape {tuple(values.shape)}: not [n_layers, 2, 2 + num_blocks + 1]")
    per_block = n_layers // num_blocks
    sources = routing_sources(num_blocks)
    rows = values.tolist()
    out: dict[str, float] = {}
    per_stat: dict[str, list[float]] = {stat: [] for stat in ROUTING_MEAN_STATS}
    for layer in range(n_layers):
        n_sources = 2 + layer // per_block
        for s, site in enumerate(SITE_NAMES):
            row = rows[layer][s]
            named = dict(zip(STAT_NAMES, row, strict=False))
            weights = row[len(STAT_NAMES) : len(STAT_NAMES) + n_sources]
            named.update({f"w_{name}": w for name, w in zip(sources, weights, strict=False)})
            named["w_deltas"] = float(sum(weights[2:]))
            for stat, value in named.items():
                out[routing_site_tag(site, stat, layer)] = value
            for stat in ROUTING_MEAN_STATS:
                per_stat[stat].append(named[stat])
    for stat, vals in per_stat.items():
        out[routing_mean_tag(stat)] = sum(vals) / len(vals)
    return out


def stats_due(mhar: Any, step: int) -> bool:
    """At step 1 (as torchtitan's metrics) and every `[mhar] stats_freq` steps: charts start at the start."""
    return mhar.enable and mhar.stats_freq > 0 and (step == 1 or step % mhar.stats_freq == 0)


class RoutingStatistics(Hook):
    """The MHAR arm's routing statistics, on the steps `stats_due` names (nothing for the control)."""

    name = "routing_stats"

    def __init__(self, mhar: Any):
        self.mhar = mhar

    def set_up(self, trainer: Any) -> None:
        self.model, self.n_layers = trainer.model_parts[0], trainer.model_args.n_layers

    def before_step(self, step: Step) -> None:
        if self.mhar.enable:  # the model keeps its statistics of this step's training forwards
            self.model.collect_routing_stats = stats_due(self.mhar, step.number)

    def after_backward(self, step: Step) -> None:
        if self.mhar.enable:
            self.model.collect_routing_stats = False

    def scalars(self, step: Step) -> dict[str, Scalar]:
        if not stats_due(self.mhar, step.number) or self.model.routing_stats is None:
            return {}
        return {"routing_stats": Scalar(self.model.routing_stats, "mean")}

    def metrics(self, step: Step) -> dict[str, float]:
        if "routing_stats" not in step.values:
            return {}
        return name_routing_stats(torch.tensor(step.values["routing_stats"]).reshape(self.n_layers, 2, -1))
