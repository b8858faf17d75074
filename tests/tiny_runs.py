"""Run folders as train_cpt.py leaves them, written in-process (no torchrun), for tests of the tools that
read runs: model_args.json and one complete DCP checkpoint with a weight EMA."""

import dataclasses
import json

import torch
import torch.distributed.checkpoint as dcp

from mhar_titan.model.args import FLAVORS, MHAR
from mhar_titan.model.model import build_initialised


def write_tiny_run(run, base, mhar: MHAR, seed: int, step: int) -> None:
    """The tiny flavor at `step`; with MHAR, open gates and non-trivial routing (random routing parameters)."""
    args = dataclasses.replace(FLAVORS["tiny"], mhar=mhar)
    torch.manual_seed(seed)
    model = build_initialised(args)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "_routing." in name:
                p.copy_(0.3 * torch.randn_like(p))
    state = dict(model.state_dict())
    state.update({f"ema.{n}": p.detach() * 0.5 for n, p in model.named_parameters()})
    dcp.save(state, checkpoint_id=str(run / "checkpoint" / f"step-{step}"), no_dist=True)
    (run / "model_args.json").write_text(json.dumps({"hf_assets_path": str(base), "args": dataclasses.asdict(args)}))
