"""The project's config sections, merged into torchtitan's JobConfig.

`train_cpt.py` passes `--job.custom_config_module=mhar_titan.config` unless the
command line names another module, so every job has these sections.
"""

from dataclasses import dataclass, field

from data.config import DataConfig
from kernels.routing import BACKENDS, MAX_TRITON_SOURCES


@dataclass
class MHAR:
    """`[mhar]`: delta multi-head attention residuals. The control arm has enable = false."""

    enable: bool = False
    num_heads: int = 8
    """Routing heads H per site; must divide the model width."""
    num_blocks: int = 8
    """Blocks whose aggregated deltas become sources; must divide the layer count."""
    backend: str = "auto"
    """auto (triton on CUDA once built, torch elsewhere), torch or triton."""
    lr_multiplier: float = 1.0
    """Routing parameters train at lr * lr_multiplier, without weight decay."""
    stats_freq: int = 10
    """Log routing statistics to TensorBoard every this many steps (0: never)."""

    def validate(self, dim: int, n_layers: int) -> None:
        """Fail at start-up, naming the setting, on values the model cannot use (only when enabled)."""
        if not self.enable:
            return
        if self.num_heads <= 0 or dim % self.num_heads:
            raise ValueError(f"[mhar] num_heads = {self.num_heads} must be positive and divide the model width {dim}")
        if self.num_blocks <= 0 or n_layers % self.num_blocks:
            raise ValueError(
                f"[mhar] num_blocks = {self.num_blocks} must be positive and divide the layer count {n_layers}"
            )
        if self.backend not in BACKENDS:
            raise ValueError(f"[mhar] backend = {self.backend!r} must be one of {', '.join(BACKENDS)}")
        if self.backend != "torch" and self.num_blocks > MAX_TRITON_SOURCES:
            raise ValueError(
                f"[mhar] num_blocks = {self.num_blocks}: the triton backend routes over at most "
                f'{MAX_TRITON_SOURCES} blocks; use backend = "torch" for more'
            )
        if not self.lr_multiplier >= 0:
            raise ValueError(f"[mhar] lr_multiplier = {self.lr_multiplier} must be >= 0")
        if self.stats_freq < 0:
            raise ValueError(f"[mhar] stats_freq = {self.stats_freq} must be >= 0 (0 turns statistics off)")


@dataclass
class Optimizer:
    """Additions to torchtitan's `[optimizer]`."""

    weight_decay_output: bool = True
    """Decay the output projection (embeddings, norms, biases and routing never decay)."""


@dataclass
class Loss:
    """`[loss]`: the training objective."""

    z_loss: float = 1e-4
    """Coefficient of the z-loss, mean over valid tokens of logsumexp(logits)^2 (0: plain CE)."""


@dataclass
class EMA:
    """`[ema]`: an fp32 weight EMA, sharded like the parameters, checkpointed, validated and exportable."""

    enable: bool = True
    beta: float = 0.999
    """ema <- beta * ema + (1 - beta) * weights after every applied optimizer step."""
    every: int = 1
    """Update only at steps that are multiples of this, with beta**every: the same horizon at 1/every
    of the cost (an fp32 read-modify-write of every weight shard, about 2.5% of an 8B step on one
    H200). Between updates the EMA lags the weights by fewer than `every` steps; keep validation
    and checkpoint intervals multiples of it."""


@dataclass
class Training:
    """Additions to torchtitan's `[training]`."""

    max_bad_steps: int = 5
    """Steps with a non-finite loss or gradient norm are skipped; this many in a row stop the run."""


@dataclass
class Checkpoint:
    """Additions to torchtitan's `[checkpoint]`."""

    keep_every: int = 0
    """Besides the last keep_latest_k, keep every checkpoint whose step is a multiple of this (0: none)."""
    allow_changes: list[str] = field(default_factory=list)
    """Fingerprint groups a resume may change on purpose: base, data, schedule (logged and recorded in
    fingerprint.json). Empty: a resume whose settings differ from the run's is refused."""


@dataclass
class Validation:
    """Additions to torchtitan's `[validation]`."""

    at_start: bool = True
    """A run that starts at step 0 (not a resume) validates the loaded base once before its first update:
    val/ce and val/ce_ema at step 0, the reference for each arm's change in the comparison."""


@dataclass
class JobConfig:
    mhar: MHAR = field(default_factory=MHAR)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: Optimizer = field(default_factory=Optimizer)
    loss: Loss = field(default_factory=Loss)
    ema: EMA = field(default_factory=EMA)
    training: Training = field(default_factory=Training)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    validation: Validation = field(default_factory=Validation)
