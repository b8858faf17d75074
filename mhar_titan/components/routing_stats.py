"""Routing statistics for TensorBoard: per-site gate, entropy and the mean weight on each source.

The model leaves the [n_layers, 2, stats_width] statistics of its last forward in `model.routing_stats`
(on the steps the trainer asks for them; the columns and rows of mhar_titan/model/sources.py's layout: gate,
entropy, then each source's mean weight, NaN where a layer's block has no such source); the hook
`RoutingStatistics` asks for them, has them averaged over the data-parallel ranks on the device and read back with
the step's other values (a `mean` Scalar, components/hooks.py), and names them here:
`mhar_<site>_<stat>/layerNN` per site (gate, entropy, w_null, w_embed, w_deltas: all deltas
summed, and w_d00, w_d01, ...: each block delta D_k the layer reads), with `mhar/<stat>/mean` over
all sites (tensorboard_scalars.py holds the names).
"""

from __future__ import annotations

from typing import Any

import torch

from mhar_titan.components.hooks import Hook, Scalar, Step
from mhar_titan.components.tensorboard_scalars import (
    DELTAS_STAT,
    ROUTING_MEAN_STATS,
    routing_mean_tag,
    routing_site_tag,
    weight_stat,
)
from mhar_titan.model.sources import BASE_SOURCES, SITE_NAMES, STAT_NAMES, SourceLayout


def name_routing_stats(values: torch.Tensor) -> dict[str, float]:
    """Each value of a [n_layers, 2, stats_width] host tensor under its TensorBoard name, and the means over
    sites. A layer reads its layout's `site_sources`: the padding beyond them is not logged."""
    n_layers, n_sites, width = values.shape
    shape_error = ValueError(
        f"routing statistics of shape {tuple(values.shape)}: not [n_layers, 2, 2 + num_blocks + 1]"
    )
    if n_sites != len(SITE_NAMES):
        raise shape_error
    try:
        layout = SourceLayout.of_stats(n_layers, width)
    except ValueError:
        raise shape_error from None
    stats = [weight_stat(source) for source in layout.names]
    rows = values.tolist()
    out: dict[str, float] = {}
    per_stat: dict[str, list[float]] = {stat: [] for stat in ROUTING_MEAN_STATS}
    for layer in range(n_layers):
        n_sources = layout.site_sources(layer)
        for s, site in enumerate(SITE_NAMES):
            row = rows[layer][s]
            named = dict(zip(STAT_NAMES, row, strict=False))
            weights = row[len(STAT_NAMES) : len(STAT_NAMES) + n_sources]
            named.update(zip(stats, weights, strict=False))
            named[DELTAS_STAT] = float(sum(weights[len(BASE_SOURCES) :]))
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
        values = torch.tensor(step.values["routing_stats"]).reshape(self.n_layers, len(SITE_NAMES), -1)
        return name_routing_stats(values)
