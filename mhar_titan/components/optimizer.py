"""AdamW with parameter groups: weight decay on matrices only; routing at lr * lr_multiplier.

torchtitan's container puts every parameter of a model part in one group; this
one splits each part by module type, so names changed by activation
checkpointing or compile wrappers do not matter.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn as nn
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.config import Optimizer as OptimizerConfig
from torchtitan.distributed import ParallelDims
from torchtitan.tools.logging import logger

from mhar_titan.model.model import RoutingSite

NORMS = (nn.RMSNorm, nn.LayerNorm)


def decay_split(model: nn.Module, decay_output: bool = True) -> dict[str, list[tuple[str, nn.Parameter]]]:
    """{"decay", "no_decay", "routing"}: (name, parameter) by module type, not by name.

    No decay: embeddings, norms, biases, and the output projection unless `decay_output`;
    routing: every parameter of a routing site (no decay, its own LR).
    """
    kind: dict[int, str] = {}
    output = getattr(model, "output", None)
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if isinstance(module, RoutingSite):
                kind[id(p)] = "routing"
            elif isinstance(module, (nn.Embedding, *NORMS)) or name == "bias":
                kind[id(p)] = "no_decay"
            elif module is output and not decay_output:
                kind[id(p)] = "no_decay"
    split: dict[str, list[tuple[str, nn.Parameter]]] = {"decay": [], "no_decay": [], "routing": []}
    for name, p in model.named_parameters():
        if p.requires_grad:
            split[kind.get(id(p), "decay")].append((name, p))
    return split


def group_settings(optimizer_kwargs: dict[str, Any], lr_multiplier: float) -> dict[str, dict[str, Any]]:
    """Each group's peak LR, weight decay, betas and eps, from the optimizer's settings: what a group is
    built with, and what a resume applies again (the config decides the values, the checkpoint the step)."""
    shared = {"betas": tuple(optimizer_kwargs["betas"]), "eps": optimizer_kwargs["eps"]}
    lr = optimizer_kwargs["lr"]
    return {
        "decay": {"lr": lr, "weight_decay": optimizer_kwargs["weight_decay"], **shared},
        "no_decay": {"lr": lr, "weight_decay": 0.0, **shared},
        "routing": {"lr": lr * lr_multiplier, "weight_decay": 0.0, **shared},
    }


def param_groups(
    model: nn.Module, settings: dict[str, dict[str, Any]], decay_output: bool = True
) -> list[dict[str, Any]]:
    """AdamW groups decay, no_decay (when not empty) and routing (when not empty), each with its settings."""
    split = decay_split(model, decay_output)
    groups = [
        {"params": [p for _, p in split[name]], "name": name, **settings[name]}
        for name in ("decay", "no_decay", "routing")
        if name == "decay" or split[name]
    ]
    for group in groups:
        n = sum(p.numel() for p in group["params"])
        logger.info(f"optimizer group {group['name']}: {len(group['params'])} tensors, {n:,} parameters")
    return groups


def lr_multiplier(model: nn.Module) -> float:
    """The routing group's LR multiplier of a model part ([mhar] lr_multiplier; 1 for the control)."""
    mhar = getattr(getattr(model, "model_args", None), "mhar", None)
    return mhar.lr_multiplier if mhar is not None else 1.0


class GroupedOptimizersContainer(OptimizersContainer):
    """One optimizer per model part, each over `param_groups` of that part."""

    def __init__(
        self, model_parts: list[nn.Module], optimizer_cls: type, optimizer_kwargs: dict[str, Any], decay_output: bool
    ) -> None:
        all_params = []
        self.optimizers = []
        self.model_parts = model_parts
        for model in model_parts:
            groups = param_groups(model, group_settings(optimizer_kwargs, lr_multiplier(model)), decay_output)
            self.optimizers.append(optimizer_cls(groups, **optimizer_kwargs))
            all_params.extend(p for g in groups for p in g["params"])
        self._validate_length(len(model_parts))
        self._post_init(all_params, optimizer_kwargs)


_OPTIMIZERS = {"Adam": torch.optim.Adam, "AdamW": torch.optim.AdamW}


def config_kwargs(cfg: OptimizerConfig) -> dict[str, Any]:
    """The `[optimizer]` values a group's settings come from."""
    return {"lr": cfg.lr, "betas": (cfg.beta1, cfg.beta2), "eps": cfg.eps, "weight_decay": cfg.weight_decay}


def build_optimizers(
    model_parts: list[nn.Module], optimizer_config: OptimizerConfig, parallel_dims: ParallelDims, **_: Any
) -> OptimizersContainer:
    """The `TrainSpec` optimizer builder: torchtitan's `[optimizer]` settings, grouped parameters."""
    cfg = optimizer_config
    if cfg.name not in _OPTIMIZERS:
        raise ValueError(f"[optimizer] name = {cfg.name!r}: expected one of {', '.join(_OPTIMIZERS)}")
    if not (math.isfinite(cfg.lr) and cfg.lr > 0):  # lr = 0 would train nothing, silently
        raise ValueError(f"[optimizer] lr = {cfg.lr} must be a positive finite number")
    if cfg.early_step_in_backward:
        raise ValueError("[optimizer] early_step_in_backward is not supported with parameter groups")
    kwargs = {
        **config_kwargs(cfg),
        "fused": cfg.implementation == "fused",
        "foreach": cfg.implementation == "foreach",
    }
    decay_output = getattr(cfg, "weight_decay_output", True)
    return GroupedOptimizersContainer(model_parts, _OPTIMIZERS[cfg.name], kwargs, decay_output)
