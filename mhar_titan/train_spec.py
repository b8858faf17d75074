"""The project's torchtitan train spec and its model flavors.

One spec for both arms of the pair: the control and the MHAR run train the
same code and differ only in their config.
"""

from __future__ import annotations

import copy

from torchtitan.components.tokenizer import build_hf_tokenizer
from torchtitan.protocols.train_spec import TrainSpec, get_train_spec, register_train_spec

from data.loader import build_parquet_dataloader
from mhar_titan.components.loss import build_loss_fn
from mhar_titan.components.lr_schedule import build_lr_schedulers
from mhar_titan.components.optimizer import build_optimizers
from mhar_titan.components.validate import build_fixed_set_validator
from mhar_titan.config import MODEL_NAME
from mhar_titan.hf.ledger import LedgerStateDictAdapter
from mhar_titan.model.args import FLAVORS
from mhar_titan.model.model import MHARTransformer
from mhar_titan.model.parallelize import parallelize


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
        state_dict_adapter=LedgerStateDictAdapter,  # the model's, with the HF load's ledger
    )


def train_spec() -> TrainSpec:
    """The registered spec (registering it on first use)."""
    try:
        return get_train_spec(MODEL_NAME)
    except ValueError:
        register_train_spec(MODEL_NAME, build_train_spec())
        return get_train_spec(MODEL_NAME)
