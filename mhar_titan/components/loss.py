"""Cross-entropy plus z-loss, summed over valid tokens (torchtitan divides by their global count).

    loss = CE + z_coeff * logsumexp(logits)^2     per valid token

The two parts are accumulated (detached) per step so the trainer can log `train/ce` and
`train/z_loss` separately; evaluation uses `cross_entropy_sum` alone.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.config import JobConfig
from torchtitan.tools.logging import logger


def ce_and_z_sums(pred: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sum of CE, sum of logsumexp^2, number of valid tokens) over the batch, in fp32."""
    logits = pred.flatten(0, 1).float()
    flat = labels.flatten(0, 1)
    ce = F.cross_entropy(logits, flat, reduction="sum", ignore_index=IGNORE_INDEX)
    valid = flat != IGNORE_INDEX
    z = (torch.logsumexp(logits, dim=-1).square() * valid).sum()
    return ce, z, valid.sum()


def cross_entropy_sum(pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return ce_and_z_sums(pred, labels)[0]


class ZLossCrossEntropy:
    """The training loss; `take_parts()` returns and resets (ce_sum, z_term_sum, tokens) since the last call."""

    def __init__(self, z_coeff: float, compiled: bool = False, backend: str = "inductor"):
        self.z_coeff = z_coeff
        self._sums = torch.compile(ce_and_z_sums, backend=backend) if compiled else ce_and_z_sums
        self._parts: list[torch.Tensor] | None = None

    def __call__(self, pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        ce, z, tokens = self._sums(pred, labels)
        z_term = self.z_coeff * z
        parts = [ce.detach(), z_term.detach(), tokens.detach().to(ce.dtype)]
        self._parts = parts if self._parts is None else [a + b for a, b in zip(self._parts, parts, strict=True)]
        return ce + z_term if self.z_coeff else ce

    def take_parts(self) -> torch.Tensor | None:
        parts, self._parts = self._parts, None
        return None if parts is None else torch.stack(parts)


def build_loss_fn(job_config: JobConfig, **_: object) -> ZLossCrossEntropy:
    """The `TrainSpec` loss builder: `[loss] z_loss` (1e-4 by default)."""
    coeff = job_config.loss.z_loss
    if coeff < 0:
        raise ValueError(f"[loss] z_loss = {coeff} must be >= 0")
    compiled = job_config.compile.enable and "loss" in job_config.compile.components
    if compiled:
        logger.info("Compiling the loss function with torch.compile")
    return ZLossCrossEntropy(coeff, compiled, job_config.compile.backend)
