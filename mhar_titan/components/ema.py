"""Weight EMA held as fp32 shards beside the FSDP2 parameter shards.

Each rank updates only its own shard after the optimizer step (no all-gather); the
EMA checkpoints as DTensors under the parameters' plain names (activation-checkpoint
and compile wrappers stripped), so it reshards on load like the model does. It starts
from the weights actually loaded: if a checkpoint restores it, that copy; otherwise
the parameters at the first step, after the HF or checkpoint load.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from mhar_titan.components.hooks import Hook, Step

STATE = "ema"  # its entry in the checkpoint
_WRAPPERS = ("_checkpoint_wrapped_module.", "_orig_mod.")


def plain_name(name: str) -> str:
    """A parameter's name without activation-checkpoint or torch.compile wrapper segments."""
    for wrapper in _WRAPPERS:
        name = name.replace(wrapper, "")
    return name


SWAP_CHUNK = 1 << 24  # elements of the exchange buffer: 64 MiB of fp32


def _exchange(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    """Swap the contents of each pair of same-dtype contiguous tensors, chunk by chunk through one buffer."""
    if not a:
        return
    buffer = torch.empty(min(SWAP_CHUNK, max(t.numel() for t in a)), dtype=a[0].dtype, device=a[0].device)
    for x, y in zip(a, b, strict=True):
        fx, fy = x.view(-1), y.view(-1)
        for i in range(0, fx.numel(), SWAP_CHUNK):
            n = min(SWAP_CHUNK, fx.numel() - i)
            t = buffer[:n]
            t.copy_(fx[i : i + n])
            fx[i : i + n].copy_(fy[i : i + n])
            fy[i : i + n].copy_(t)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class WeightEMA(Stateful):
    """ema <- beta**every * ema + (1 - beta**every) * param, in fp32, after the applied optimizer
    steps whose number is a multiple of `every` (1: every step). Which steps update depends on the
    step number alone, so a resumed run updates exactly where an uninterrupted one does."""

    def __init__(self, model: nn.Module, beta: float, every: int = 1):
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"[ema] beta = {beta} must be in [0, 1)")
        if every < 1:
            raise ValueError(f"[ema] every = {every} must be at least 1")
        self.beta, self.every, self.model = beta, every, model
        self.params = {plain_name(n): p for n, p in model.named_parameters() if p.requires_grad}
        with torch.no_grad():
            self.shadow = {n: torch.zeros_like(p, dtype=torch.float32) for n, p in self.params.items()}
        self.ready = False  # becomes true once loaded from a checkpoint or copied from the weights

    def _pairs(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        names = list(self.params)
        return [_local(self.shadow[n]) for n in names], [_local(self.params[n].detach()) for n in names]

    @torch.no_grad()
    def start(self) -> None:
        """Copy the current weights in, unless a checkpoint already restored the EMA."""
        if self.ready:
            return
        self._copy_weights()
        self.ready = True

    def _copy_weights(self) -> None:
        shadows, params = self._pairs()
        torch._foreach_copy_(shadows, params)

    @torch.no_grad()
    def update(self, step: int) -> None:
        """Called after the optimizer step `step` (1-based) was applied."""
        if not self.ready:
            raise RuntimeError("WeightEMA.update before start(): the EMA has no initial weights")
        if step % self.every:
            return
        shadows, params = self._pairs()
        params = [p.float() for p in params]  # no copy for fp32 master weights
        torch._foreach_lerp_(shadows, params, 1.0 - self.beta**self.every)

    @contextmanager
    def swapped_in(self) -> Iterator[None]:
        """The EMA weights in the model for the block, then the training weights back, bit for bit.

        Where the parameters are fp32 (as the shadow is), their contents are exchanged in place through a buffer
        of SWAP_CHUNK elements, so validation needs no copy of this rank's parameter shards (a copy put the
        validation peak of one H100 above the training step's); otherwise the weights are backed up. Nothing is
        gathered."""
        if not self.ready:
            raise RuntimeError("WeightEMA.swapped_in before start(): the EMA has no weights yet")
        shadows, params = self._pairs()
        in_place = all(
            p.dtype == s.dtype and p.is_contiguous() and s.is_contiguous() for p, s in zip(params, shadows, strict=True)
        )
        with torch.no_grad():
            if in_place:
                _exchange(params, shadows)
            else:
                backup = [p.clone() for p in params]
                for p, s in zip(params, shadows, strict=True):
                    p.copy_(s)
        self._drop_gathered()
        try:
            yield
        finally:
            with torch.no_grad():
                if in_place:
                    _exchange(params, shadows)
                else:
                    torch._foreach_copy_(params, backup)
            self._drop_gathered()

    def _drop_gathered(self) -> None:
        """Free FSDP's gathered copies so the next forward gathers the swapped shards."""
        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()

    @torch.no_grad()
    def state_dict(self) -> dict[str, torch.Tensor]:
        """The EMA; before it has started (a seed checkpoint, written before any step) that is the weights."""
        if not self.ready:
            self._copy_weights()  # not `ready`: a checkpoint loaded into these tensors restores the EMA, else start()
        return dict(self.shadow)

    def load_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        missing = sorted(set(self.shadow) - set(state_dict))
        if missing:
            raise KeyError(f"EMA state lacks {len(missing)} parameters, e.g. {missing[:3]}")
        with torch.no_grad():
            for name, t in self.shadow.items():
                if state_dict[name] is not t:  # DCP loads in place; a plain dict is copied
                    t.copy_(state_dict[name])
        self.ready = True


class EMA(Hook):
    """The weight EMA in a job (`[ema]`): kept from the weights the run loaded, updated after every applied step,
    checkpointed as an entry of its own; validation swaps it in (components/validate.py)."""

    name = "ema"

    def __init__(self, settings: Any):
        self.settings = settings
        self.ema: WeightEMA | None = None

    def set_up(self, trainer: Any) -> None:
        if self.settings.enable:
            self.ema = WeightEMA(trainer.model_parts[0], self.settings.beta, self.settings.every)

    def checkpointed(self) -> dict[str, WeightEMA]:
        return {} if self.ema is None else {STATE: self.ema}

    def start(self, step: int) -> None:
        if self.ema is not None:
            self.ema.start()  # after the load: a restored EMA stays, otherwise it starts from the loaded weights

    def after_step(self, step: Step) -> None:
        if self.ema is not None and step.applied:
            self.ema.update(step.number)
