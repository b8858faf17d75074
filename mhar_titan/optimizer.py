"""AdamW with parameter groups: routing parameters train without weight decay at lr * lr_multiplier.

torchtitan's container puts every parameter of a model part in one group; this
one splits each part by module type, so names changed by activation
checkpointing or compile wrappers do not matter.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.config import Optimizer as OptimizerConfig
from torchtitan.distributed import ParallelDims

from mhar_titan.model import RoutingSite


def param_groups(model: nn.Module, lr: float, lr_multiplier: float) -> list[dict[str, Any]]:
    """[base parameters], then [routing parameters: weight_decay 0, lr * lr_multiplier] if any."""
    routing = {id(p) for m in model.modules() if isinstance(m, RoutingSite) for p in m.parameters()}
    params = [p for p in model.parameters() if p.requires_grad]
    groups: list[dict[str, Any]] = [{"params": [p for p in params if id(p) not in routing], "name": "base"}]
    if routing:
        groups.append(
            {
                "params": [p for p in params if id(p) in routing],
                "name": "routing",
                "weight_decay": 0.0,
                "lr": lr * lr_multiplier,
            }
        )
    return groups


class GroupedOptimizersContainer(OptimizersContainer):
    """One optimizer per model part, each over `param_groups` of that part."""

    def __init__(self, model_parts: list[nn.Module], optimizer_cls: type, optimizer_kwargs: dict[str, Any]) -> None:
        all_params = []
        self.optimizers = []
        self.model_parts = model_parts
        for model in model_parts:
            mhar = getattr(getattr(model, "model_args", None), "mhar", None)
            multiplier = mhar.lr_multiplier if mhar is not None else 1.0
            groups = param_groups(model, optimizer_kwargs["lr"], multiplier)
            self.optimizers.append(optimizer_cls(groups, **optimizer_kwargs))
            all_params.extend(p for g in groups for p in g["params"])
        self._validate_length(len(model_parts))
        self._post_init(all_params, optimizer_kwargs)


_OPTIMIZERS = {"Adam": torch.optim.Adam, "AdamW": torch.optim.AdamW}


def build_optimizers(
    model_parts: list[nn.Module], optimizer_config: OptimizerConfig, parallel_dims: ParallelDims, **_: Any
) -> OptimizersContainer:
    """The `TrainSpec` optimizer builder: torchtitan's `[optimizer]` settings, grouped parameters."""
    cfg = optimizer_config
    if cfg.name not in _OPTIMIZERS:
        raise ValueError(f"[optimizer] name = {cfg.name!r}: expected one of {', '.join(_OPTIMIZERS)}")
    if cfg.early_step_in_backward:
        raise ValueError("[optimizer] early_step_in_backward is not supported with parameter groups")
    kwargs = {
        "lr": cfg.lr,
        "betas": (cfg.beta1, cfg.beta2),
        "eps": cfg.eps,
        "weight_decay": cfg.weight_decay,
        "fused": cfg.implementation == "fused",
        "foreach": cfg.implementation == "foreach",
    }
    return GroupedOptimizersContainer(model_parts, _OPTIMIZERS[cfg.name], kwargs)
