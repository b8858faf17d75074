"""Routing statistics for TensorBoard: per-site gate, entropy and source weights.

The model leaves the [n_layers, 2, 5] statistics of its last forward in
`model.routing_stats` (on the steps the trainer asks for them); these are averaged over
data-parallel ranks on the device and named `mhar/<stat>/layerNN_<site>`, with
`mhar/<stat>/mean` over all sites.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from mhar_titan.model.model import SITE_NAMES, STAT_NAMES


def average_routing_stats(stats: torch.Tensor, mesh: DeviceMesh | None) -> torch.Tensor:
    """The mean of `stats` over `mesh` (every rank must call), on the device, fp32."""
    stats = stats.detach().float().clone()
    if mesh is not None and mesh.size() > 1:
        dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=mesh.get_group())
        stats /= mesh.size()
    return stats


def name_routing_stats(values: torch.Tensor) -> dict[str, float]:
    """Each value of a [n_layers, 2, 5] host tensor under its TensorBoard name, and the means."""
    out: dict[str, float] = {}
    for j, stat in enumerate(STAT_NAMES):
        for layer in range(values.shape[0]):
            for s, site in enumerate(SITE_NAMES):
                out[f"mhar/{stat}/layer{layer:02d}_{site}"] = values[layer, s, j].item()
        out[f"mhar/{stat}/mean"] = values[:, :, j].mean().item()
    return out
