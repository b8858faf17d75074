"""The project's torchtitan train spec and its model flavors.

One spec for both arms of the pair: the control and the MHAR run train the
same code and differ only in their config.
"""

from __future__ import annotations

import copy
import dataclasses

from torchtitan.components.tokenizer import build_hf_tokenizer
from torchtitan.models.llama3.model.args import RoPEScalingArgs
from torchtitan.protocols.train_spec import TrainSpec, get_train_spec, register_train_spec

from data.loader import build_parquet_dataloader
from mhar_titan.hf.adapter import MHARStateDictAdapter
from mhar_titan.loss import build_loss_fn
from mhar_titan.lr_schedule import build_lr_schedulers
from mhar_titan.model import HF_FLAVOR, MHARModelArgs, MHARTransformer
from mhar_titan.optimizer import build_optimizers
from mhar_titan.parallelize import parallelize
from mhar_titan.validate import build_fixed_set_validator

MODEL_NAME = "llama3_mhar"

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
    # Marin-8B (Llama-3.1 architecture): DESIGN.md section 1.
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


# The 8B width cut to 16 layers: what one GPU holds for speed benchmarks (make bench-step).
FLAVORS["marin8b_16l"] = dataclasses.replace(FLAVORS["marin8b"], n_layers=16)

# The architecture is read from `model.hf_assets_path`/config.json at start-up.
FLAVORS[HF_FLAVOR] = MHARModelArgs()


def build_train_spec() -> TrainSpec:
    return TrainSpec(
        model_cls=MHARTransformer,
        model_args=copy.deepcopy(FLAVORS),  # the trainer and cpu.py mutate them
        parallelize_fn=parallelize,
        pipelining_fn=None,  # MHAR sources span the whole depth: no pipeline stages
        build_optimizers_fn=build_optimizers,
        build_lr_schedulers_fn=build_lr_schedulers,
        build_dataloader_fn=build_parquet_dataloader,
        build_tokenizer_fn=build_hf_tokenizer,
        build_loss_fn=build_loss_fn,
        build_validator_fn=build_fixed_set_validator,
        state_dict_adapter=MHARStateDictAdapter,
    )


def train_spec() -> TrainSpec:
    """The registered spec (registering it on first use)."""
    try:
        return get_train_spec(MODEL_NAME)
    except ValueError:
        register_train_spec(MODEL_NAME, build_train_spec())
        return get_train_spec(MODEL_NAME)
