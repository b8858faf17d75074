"""The model's arguments: torchtitan's Llama-3 arguments plus the `[mhar]` graft, the flavors, and the
arguments of an HF checkpoint's config.json (`[model] flavor = "hf"`)."""

from __future__ import annotations

import copy
import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

import fsspec
from torchtitan.config import JobConfig
from torchtitan.models.llama3.model.args import RoPEScalingArgs, TransformerModelArgs

from kernels.routing import BACKENDS, MAX_TRITON_SOURCES
from mhar_titan.model.hf_config import llama_args_from_hf_config
from mhar_titan.model.sources import SourceLayout

# `[model] flavor = "hf"`: the architecture of the config.json in `model.hf_assets_path`.
HF_FLAVOR = "hf"
_LLAMA_FIELDS = tuple(f.name for f in dataclasses.fields(TransformerModelArgs))


@dataclass
class MHAR:
    """`[mhar]`: delta multi-head attention residuals. The control arm has enable = false."""

    enable: bool = False
    """Add the routing sites: the MHAR arm (false: the control, torchtitan's Llama-3 and no routing parameters)."""
    num_heads: int = 8
    """Routing heads H per site; must divide the model width."""
    num_blocks: int = 8
    """Blocks whose aggregated deltas become sources; must divide the layer count."""
    backend: str = "auto"
    """auto (triton on CUDA, torch elsewhere), torch (the reference), triton (the fused kernels'
    eager path) or triton_op (the same kernels through their custom op): kernels.routing.BACKENDS."""
    lr_multiplier: float = 1.0
    """Routing parameters train at lr * lr_multiplier, without weight decay."""
    stats_freq: int = 10
    """Log routing statistics to TensorBoard at step 1 and every this many steps (0: never)."""

    def validate(self, dim: int, n_layers: int) -> None:
        """Fail at start-up, naming the setting, on values the model cannot use (only when enabled)."""
        if not self.enable:
            return
        if self.num_heads <= 0 or dim % self.num_heads:
            raise ValueError(f"[mhar] num_heads = {self.num_heads} must be positive and divide the model width {dim}")
        try:
            layout = SourceLayout(self.num_blocks, n_layers)
        except ValueError as e:
            raise ValueError(f"[mhar] {e}") from None
        if self.backend not in BACKENDS:
            raise ValueError(f"[mhar] backend = {self.backend!r} must be one of {', '.join(BACKENDS)}")
        if self.backend != "torch" and not layout.fits(MAX_TRITON_SOURCES):
            raise ValueError(
                f"[mhar] num_blocks = {self.num_blocks}: the triton backend routes over at most "
                f'{MAX_TRITON_SOURCES} blocks; use backend = "torch" for more'
            )
        if not self.lr_multiplier >= 0:
            raise ValueError(f"[mhar] lr_multiplier = {self.lr_multiplier} must be >= 0")
        if self.stats_freq < 0:
            raise ValueError(f"[mhar] stats_freq = {self.stats_freq} must be >= 0 (0 turns statistics off)")


@dataclass
class MHARModelArgs(TransformerModelArgs):
    mhar: MHAR = field(default_factory=MHAR)

    def update_from_config(self, job_config: JobConfig, **kwargs) -> None:
        if job_config.model.flavor == HF_FLAVOR:
            path = job_config.model.hf_assets_path.rstrip("/") + "/config.json"
            with fsspec.open(path, "r") as f:
                llama = llama_args_from_hf_config(json.load(f), source=path)
            for name in _LLAMA_FIELDS:
                setattr(self, name, getattr(llama, name))
        super().update_from_config(job_config, **kwargs)
        # Document masking is flex attention's block mask (torchtitan's llama3 get_attention_masks); plain causal
        # stays on sdpa, its fastest kernel.
        self.attn_mask_type = getattr(job_config.model, "attention_mask", "causal")
        self.attn_type = "flex" if self.attn_mask_type == "block_causal" else "sdpa"
        self.mhar = copy.deepcopy(job_config.mhar)
        self.validate()

    def validate(self) -> None:
        self.mhar.validate(self.dim, self.n_layers)

    @property
    def layout(self) -> SourceLayout:
        """The routing sources' layout of these arguments (MHAR on: `validate` has checked it)."""
        return SourceLayout(self.mhar.num_blocks, self.n_layers)


def model_args_from_hf_config(
    config: dict[str, Any], source: str = "config.json", *, allow_mhar: bool = False
) -> MHARModelArgs:
    """MHARModelArgs (routing off) for a Llama-3.x config.json; see hf_config.llama_args_from_hf_config."""
    llama = llama_args_from_hf_config(config, source, allow_mhar=allow_mhar)
    return MHARModelArgs(**{name: getattr(llama, name) for name in _LLAMA_FIELDS})


FLAVORS: dict[str, MHARModelArgs] = {
    # A few million parameters for CPU runs: the demo and the test suite.
    # vocab 2048 matches assets/tiny/tokenizer.json; eos 1 is its <|end_of_text|>.
    "tiny": MHARModelArgs(
        dim=256,
        n_layers=4,
        n_heads=8,
        n_kv_heads=4,
        vocab_size=2048,
        multiple_of=256,
        norm_eps=1e-5,
        rope_theta=500000,
        eos_id=1,
    ),
    # Marin-8B (Llama-3.1 architecture): docs/recipe.md, "Base model".
    "marin8b": MHARModelArgs(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=128256,
        ffn_dim_multiplier=1.3,
        multiple_of=1024,
        norm_eps=1e-5,
        rope_theta=500000,
        rope_scaling_args=RoPEScalingArgs(
            scaling_factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
        eos_id=128001,
    ),
}


# The 8B width cut to 16 layers: what one GPU holds for speed benchmarks (make bench-step); and to
# 8 layers, the second depth the memory plan is checked at (python -m mhar_titan.plan).
FLAVORS["marin8b_16l"] = dataclasses.replace(FLAVORS["marin8b"], n_layers=16)
FLAVORS["marin8b_8l"] = dataclasses.replace(FLAVORS["marin8b"], n_layers=8)

# The architecture is read from `model.hf_assets_path`/config.json at start-up.
FLAVORS[HF_FLAVOR] = MHARModelArgs()
