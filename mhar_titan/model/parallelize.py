"""torchtitan's Llama-3 parallelisation (TP, AC, per-block compile, FSDP2) for the MHAR model.

Routing sites live inside their block, so they join the block's FSDP unit and
its activation checkpoint. Two MHAR-only changes, both invisible to the math:
- full activation checkpointing keeps the fused routing op's outputs instead of
  re-running it (`keep_routing_outputs`): 2 x [B, T, d] per layer (2.1 GB at the
  bench-step geometry, where the peak did not move) for one routing forward pass less;
- with per-block compile, the fp32 sum of each block's deltas is compiled too.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
from torchtitan.config import ActivationCheckpoint, JobConfig
from torchtitan.distributed import ParallelDims
from torchtitan.models.llama3 import parallelize_llama
from torchtitan.tools.logging import logger

import kernels.triton.autograd  # noqa: F401  (registers torch.ops.mhar.route_fwd)


def parallelize(model: nn.Module, parallel_dims: ParallelDims, job_config: JobConfig) -> nn.Module:
    """torchtitan's parallelize_llama (torchtitan/models/llama3/infra/parallelize.py); for MHAR first the
    routing's compile settings and full AC keeping the routing outputs, and no TP or CP."""
    mhar = model.model_args.mhar
    if not mhar.enable:
        return parallelize_llama(model, parallel_dims, job_config)
    if parallel_dims.tp_enabled:
        raise ValueError("[mhar] enable = true does not support tensor parallelism (routing needs the full width)")
    if parallel_dims.cp_enabled:
        raise ValueError("[mhar] enable = true does not support context parallelism")
    compile_model = job_config.compile.enable and "model" in job_config.compile.components
    if compile_model:
        allow_routing_graphs(mhar.num_blocks)
        model.block_delta = torch.compile(model.block_delta, backend=job_config.compile.backend, fullgraph=True)
    ac = job_config.activation_checkpoint
    if ac.mode == "full":
        apply_routing_keeping_ac(model, ac)
        # torchtitan's apply_ac is skipped below; its dynamo setting applies here too
        torch._C._dynamo.eval_frame._set_lru_cache(False)
        job_config = dataclasses.replace(job_config, activation_checkpoint=dataclasses.replace(ac, mode="none"))
    return parallelize_llama(model, parallel_dims, job_config)


def keep_routing_outputs(ctx, func, *args, **kwargs) -> CheckpointPolicy:
    """Selective-checkpoint policy: save the fused routing op's outputs, recompute the rest."""
    if func == torch.ops.mhar.route_fwd.default:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def apply_routing_keeping_ac(model: nn.Module, ac: ActivationCheckpoint) -> None:
    """torchtitan's full per-block activation checkpointing, with `keep_routing_outputs`. Forked from
    torchtitan 0.2.2 torchtitan/distributed/activation_checkpoint.py, _apply_full_ac and apply_ac.

    The policy sees the routing as one op under torch.compile (the custom op); eager
    calls run the kernels through an autograd.Function that it cannot see, and are
    recomputed as under plain full AC. Either way the numbers are the same.
    """
    context_fn = functools.partial(create_selective_checkpoint_contexts, keep_routing_outputs)
    for layer_id, block in model.layers.named_children():
        wrapped = checkpoint_wrapper(
            block,
            context_fn=context_fn,
            preserve_rng_state=ac.preserve_rng_state,
            determinism_check=ac.determinism_check,
            early_stop=ac.early_stop,
            debug=ac.debug,
        )
        model.layers.register_module(layer_id, wrapped)
    logger.info("Applied full activation checkpointing to the model, keeping the routing op's outputs")


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
