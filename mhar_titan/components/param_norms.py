"""Per-layer weight, gradient and update norms, every `[norms] freq` steps: the signal that found the Marin 8B
cooldown's slow loss creep (the output layer's norm growing, until z-loss), which one global gradient norm hides.

Groups: `embedding`, `layerNN` (a block's attention, MLP and norms), `routingNN` (the layer's routing sites, MHAR
arm), `final_norm`, `output`. For each group, on the steps due:
- `norms_weight/<group>`: the weights after the step's update;
- `norms_grad/<group>`: the gradient before clipping (the clipped one divided by the clip coefficient);
- `norms_update/<group>`: the update the optimizer applied, from its state after the step (Adam and AdamW:
  lr * m_hat / (sqrt(v_hat) + eps), plus AdamW's decoupled decay), so no copy of the weights is kept.

Each is computed on the rank's own shards, and the sums of squares of every group go through one all-reduce over the
data-parallel ranks and one read-back, after the step's update (which the update norm needs): one sync of the host
on the steps due, none on the others. A skipped step (non-finite values) has no norms.
"""

from __future__ import annotations

import math
import re
from typing import Any

import torch
import torch.distributed as dist

from mhar_titan.components.hooks import Hook, Step
from mhar_titan.components.tensorboard_scalars import NORM_KINDS, norm_tag
from mhar_titan.model.model import RoutingSite

KINDS = NORM_KINDS
_WRAPPERS = re.compile(r"(_checkpoint_wrapped_module|_orig_mod|_fsdp_wrapped_module)\.")
_LAYER = re.compile(r"^layers\.(\d+)\.")


def group_of(name: str, routing: bool) -> str:
    """The norm group of a parameter, from its name (wrappers of activation checkpointing and compile removed)."""
    clean = _WRAPPERS.sub("", name)
    if m := _LAYER.match(clean):
        return f"{'routing' if routing else 'layer'}{int(m[1]):02d}"
    for prefix, group in (("tok_embeddings.", "embedding"), ("output.", "output"), ("norm.", "final_norm")):
        if clean.startswith(prefix):
            return group
    return "other"


def norm_groups(model: torch.nn.Module) -> dict[int, str]:
    """{id(parameter): group} for every trainable parameter (routing by module type, as the optimizer's groups)."""
    routing = {id(p) for module in model.modules() if isinstance(module, RoutingSite) for p in module.parameters()}
    return {id(p): group_of(name, id(p) in routing) for name, p in model.named_parameters() if p.requires_grad}


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank (FSDP2), a plain tensor as it is."""
    return t.to_local() if hasattr(t, "to_local") else t


def adam_update(p: torch.Tensor, state: dict[str, Any], group: dict[str, Any], decoupled: bool) -> torch.Tensor:
    """The update Adam(W) applied to `p` at its last step (p_after - p_before), from `p` and the state after it:
    AdamW is p <- p (1 - lr wd) - a with a = lr / bc1 * m / (sqrt(v) / sqrt(bc2) + eps), so the update is
    -(lr wd p + a) / (1 - lr wd); Adam folds its decay into the gradient, and its update is -a."""
    t = float(state["step"])
    beta1, beta2 = group["betas"]
    lr, eps, wd = float(group["lr"]), float(group["eps"]), float(group["weight_decay"])
    m, v, w = (_local(x).float() for x in (state["exp_avg"], state["exp_avg_sq"], p.detach()))
    a = m.mul(lr / (1 - beta1**t)).div_(v.sqrt().div_(math.sqrt(1 - beta2**t)).add_(eps))
    if not decoupled or wd == 0.0:
        return a.neg_()
    return a.add_(w, alpha=lr * wd).div_(-(1 - lr * wd))


class ParameterNorms(Hook):
    """Per-group weight, gradient and update norms on the steps `due` names, in TensorBoard (nothing on the others)."""

    name = "param_norms"

    def __init__(self, freq: int):
        if freq < 0:
            raise ValueError(f"[norms] freq = {freq} must be >= 0 (0 turns the norms off)")
        self.freq = freq
        self.values: dict[str, float] = {}

    def due(self, step: int) -> bool:
        """At step 1 (charts start at the start) and every `freq` steps."""
        return self.freq > 0 and (step == 1 or step % self.freq == 0)

    def set_up(self, trainer: Any) -> None:
        self.models = trainer.model_parts
        self.optimizers = trainer.optimizers.optimizers
        self.max_norm = float(trainer.job_config.training.max_norm)
        self.dp_group = trainer.dp_group
        self.replicas = max(1, getattr(trainer.parallel_dims, "dp_replicate", 1))  # each shard's copies in HSDP
        groups: dict[int, str] = {}
        for model in self.models:
            groups.update(norm_groups(model))
        self.group_of = groups
        self.names = sorted(set(groups.values()))

    def after_step(self, step: Step) -> None:
        self.values = {}
        if not (self.due(step.number) and step.applied and "grad_norm" in step.values):
            return
        index = {name: i for i, name in enumerate(self.names)}
        device = next(iter(self.models[0].parameters())).device
        squares = torch.zeros(len(KINDS), len(self.names), dtype=torch.float64, device=device)
        clip = min(1.0, self.max_norm / (step.values["grad_norm"] + 1e-6))  # torch's clip_grad_norm_ coefficient
        for opt in self.optimizers:
            decoupled = isinstance(opt, torch.optim.AdamW)
            for group in opt.param_groups:
                for p in group["params"]:
                    col = index[self.group_of[id(p)]]
                    squares[0, col] += _local(p.detach()).float().square().sum()
                    if p.grad is not None:
                        squares[1, col] += _local(p.grad).float().square().sum() / (clip * clip)
                    if opt.state.get(p):
                        squares[2, col] += adam_update(p, opt.state[p], group, decoupled).square().sum()
        if self.dp_group is not None:
            dist.all_reduce(squares, group=self.dp_group)
        norms = (squares / self.replicas).sqrt().tolist()  # the one read-back
        self.values = {norm_tag(kind, g): norms[k][col] for k, kind in enumerate(KINDS) for g, col in index.items()}

    def metrics(self, step: Step) -> dict[str, float]:
        return dict(self.values)
