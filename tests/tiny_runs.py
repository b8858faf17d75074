"""Run folders as train_cpt.py leaves them, written in-process (no torchrun), for tests of the tools that
read runs: model_args.json and one complete DCP checkpoint with a weight EMA; and the tiny MHAR model with
routing already trained a little (random routing parameters, open gates)."""

import copy
import dataclasses
import json

import torch
import torch.distributed.checkpoint as dcp
from conftest import REPO

from mhar_titan.hf.export import init_hf
from mhar_titan.model.args import FLAVORS, MHAR
from mhar_titan.model.model import MHARTransformer, build_initialised


def routed_tiny_model(seq: int, num_blocks: int, backend: str, device: str) -> MHARTransformer:
    """The tiny flavor with MHAR on, torchtitan's initialisation, then random routing parameters
    (gates at 0.1 scale), built on `device` with seed 0."""
    args = copy.deepcopy(FLAVORS["tiny"])
    args.max_seq_len = seq
    args.mhar = MHAR(enable=True, num_blocks=num_blocks, backend=backend)
    torch.manual_seed(0)
    with torch.device(device):
        model = MHARTransformer(args)
    with torch.no_grad():
        model.init_weights()
        for name, p in model.named_parameters():
            if "_routing." in name:
                p.copy_(torch.randn_like(p) * (0.1 if name.endswith(".gate") else 1.0))
    return model


def write_tiny_run(run, base, mhar: MHAR, seed: int, step: int, record: bool = True) -> None:
    """The tiny flavor at `step`; with MHAR, open gates and non-trivial routing (random routing parameters).
    `record=False` adds the checkpoint to a run folder that has its model_args.json (a reader may be at it)."""
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
    if record:
        info = {"hf_assets_path": str(base), "args": dataclasses.asdict(args)}
        (run / "model_args.json").write_text(json.dumps(info))


def write_tiny_pair(root, step: int) -> None:
    """A pair folder as launch/pair.sh leaves it: a tiny HF base, and control and MHAR (2 blocks, torch
    routing) runs from it, each with one checkpoint at `step`."""
    base = root / "base"
    init_hf(str(base), "tiny", tokenizer_dir=str(REPO / "assets" / "tiny"), seed=0)
    write_tiny_run(root / "control", base, MHAR(enable=False), seed=1, step=step)
    write_tiny_run(
        root / "mhar", base, MHAR(enable=True, num_heads=8, num_blocks=2, backend="torch"), seed=1, step=step
    )
