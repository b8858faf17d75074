"""torchtitan's Llama-3 parallelisation (TP, AC, per-block compile, FSDP2) for the MHAR model.

Routing sites live inside their block, so they join the block's FSDP unit and
its activation checkpoint; nothing else changes.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torchtitan.config import JobConfig
from torchtitan.distributed import ParallelDims
from torchtitan.models.llama3 import parallelize_llama


def parallelize(model: nn.Module, parallel_dims: ParallelDims, job_config: JobConfig) -> nn.Module:
    mhar = model.model_args.mhar
    if mhar.enable and parallel_dims.tp_enabled:
        raise ValueError("[mhar] enable = true does not support tensor parallelism (routing needs the full width)")
    if mhar.enable and parallel_dims.cp_enabled:
        raise ValueError("[mhar] enable = true does not support context parallelism")
    if mhar.enable and job_config.compile.enable:
        allow_routing_graphs(mhar.num_blocks)
    return parallelize_llama(model, parallel_dims, job_config)


def allow_routing_graphs(num_blocks: int) -> None:
    """Let per-block compile keep every graph the routing needs, so none falls back to eager.

    All blocks are compiled from one code object, and Dynamo specialises on the
    length of the `sources` list: blocks 0..num_blocks-1 see 1..num_blocks
    sources. Layer 0 may add one more graph: its input is the embedding, which is
    also sources[0], and Dynamo guards on that aliasing (the activation-checkpoint
    wrapper hides it). So at most num_blocks + 1 graphs for training, whatever the depth,
    and as many again for validation, which runs without grad (a guard too): the
    recompile limit is raised to that bound.
    """
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 2 * (num_blocks + 1))
