"""Stock torchtitan 0.2.2: its llama3 model, parallelisation, Trainer, loss, optimizer and LR
schedule, fed by this project's parquet loader, with this project's flavors as its geometries.
The baseline arm of `make bench-step` (our control must be as fast as this).

    torchrun --nproc-per-node=1 -m benchmarks.stock_titan --model.name llama3_stock --model.flavor tiny ...
"""

from __future__ import annotations

import dataclasses

from torchtitan.models import llama3
from torchtitan.models.llama3.model.args import TransformerModelArgs
from torchtitan.protocols.train_spec import TrainSpec, register_train_spec
from torchtitan.train import Trainer, main

from data.loader import build_parquet_dataloader
from mhar_titan import cpu
from mhar_titan.model.args import FLAVORS, HF_FLAVOR

STOCK_NAME = "llama3_stock"


def stock_train_spec() -> TrainSpec:
    names = [f.name for f in dataclasses.fields(TransformerModelArgs) if f.init]
    flavors = {
        flavor: TransformerModelArgs(**{n: getattr(args, n) for n in names})
        for flavor, args in FLAVORS.items()
        if flavor != HF_FLAVOR
    }
    return dataclasses.replace(
        llama3.get_train_spec(), model_args=flavors, build_dataloader_fn=build_parquet_dataloader
    )


if __name__ == "__main__":
    spec = stock_train_spec()
    register_train_spec(STOCK_NAME, spec)
    if cpu.should_activate():
        cpu.activate([spec])
    main(Trainer)
