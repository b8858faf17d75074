"""A step's values combined on a rank of a real gloo group (tests/test_hooks.py spawns it): a module of its own, so that
the spawned ranks import torch and the hook protocol alone, not the trainer the test file imports."""

import json

import torch
import torch.distributed as dist

from mhar_titan.components.hooks import Scalar, reduce_scalars


def reduce_on_rank(rank: int, world: int, init: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        named = {
            "flag": Scalar(torch.tensor(rank == 1), "max"),  # one rank raises it
            "largest": Scalar(torch.tensor(float(rank) + 0.5), "max"),
            "total": Scalar(torch.tensor([1.0, 2.0]) * (rank + 1), "sum"),
            "average": Scalar(torch.tensor([[2.0, 4.0]]) * (rank + 1), "mean"),
            "global": Scalar(torch.tensor(3.25)),  # the same on every rank: as given
        }
        reduced = reduce_scalars(named, dist.group.WORLD)
        record = {name: [t.dtype == torch.float64, list(t.shape), t.flatten().tolist()] for name, t in reduced.items()}
        with open(f"{out}.{rank}", "w") as f:
            json.dump({"order": list(reduced), "values": record}, f)
    finally:
        dist.destroy_process_group()
