"""torchtitan's Llama-3 parallelisation (TP, AC, per-block compile, FSDP2) for the MHAR model.

The control arm is torchtitan's `parallelize_llama` unchanged. For the MHAR arm, activation
checkpointing and per-block compile wrap each block's `BlockBody` (its two sublayers, with the
sites' routed terms as inputs) rather than the whole block, and FSDP2 shards the blocks as
torchtitan does. So the routing runs once per step in every AC mode, outside the recomputed and
compiled region: its outputs (2 x [B, T, d] per layer) are the body's inputs, kept by the
checkpoint, as the control keeps each block's input; and the fused kernels run through their
eager path, which sums each source's gradient in place across all the calls that read it,
reads each source's norm once, and serves a block's calls with one mix pass (kernels/README.md).
With the `torch` backend (the reference) each site is checkpointed (when AC is on) and compiled
(when the model is) on its own instead. Each block delta is summed inside the bodies.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torchtitan.config import TORCH_DTYPE_MAP, JobConfig
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.activation_checkpoint import apply_ac
from torchtitan.models.llama3 import parallelize_llama
from torchtitan.models.llama3.infra.parallelize import _op_sac_save_list, apply_compile
from torchtitan.tools import utils as titan_utils
from torchtitan.tools.logging import logger

from kernels.routing import resolve_backend
from mhar_titan.model.model import MHARBlock
from mhar_titan.model.sources import SourceLayout

# Backends whose routing op keeps only references to its inputs for the backward (nothing for a
# checkpoint to drop); the torch reference saves its intermediates and is checkpointed per site.
_SAVES_NOTHING = ("triton", "triton_op")


def parallelize(model: nn.Module, parallel_dims: ParallelDims, job_config: JobConfig) -> nn.Module:
    """torchtitan's parallelize_llama (torchtitan/models/llama3/infra/parallelize.py); for MHAR its AC and
    per-block compile applied to the blocks' bodies and routing sites first, and no TP or CP."""
    mhar = model.model_args.mhar
    if not mhar.enable:
        return parallelize_llama(model, parallel_dims, job_config)
    if parallel_dims.tp_enabled:
        raise ValueError("[mhar] enable = true does not support tensor parallelism (routing needs the full width)")
    if parallel_dims.cp_enabled:
        raise ValueError("[mhar] enable = true does not support context parallelism")
    compile_model = job_config.compile.enable and "model" in job_config.compile.components
    ac = job_config.activation_checkpoint
    wrap_blocks(model, job_config, compile_model)
    if parallel_dims.fsdp_enabled:
        shard_routing_units(model, parallel_dims, job_config)
    # torchtitan's AC and compile are applied above; the rest (FSDP2 or DDP) as for the control
    rest = dataclasses.replace(
        job_config,
        activation_checkpoint=dataclasses.replace(ac, mode="none"),
        compile=dataclasses.replace(
            job_config.compile, components=[c for c in job_config.compile.components if c != "model"]
        ),
    )
    if compile_model and parallel_dims.dp_replicate_enabled and not parallel_dims.fsdp_enabled:
        torch._dynamo.config.optimize_ddp = "ddp_optimizer"  # what parallelize_llama's apply_ddp sets
    return parallelize_llama(model, parallel_dims, rest)


def wrap_blocks(model: nn.Module, job_config: JobConfig, compile_model: bool) -> None:
    """torchtitan's activation checkpointing (any mode) and per-block compile on each block's body,
    the torch backend's sites wrapped on their own."""
    ac = job_config.activation_checkpoint
    blocks: dict[str, MHARBlock] = dict(model.layers.items())
    bodies = BodyTree(blocks)
    if ac.mode != "none":
        # torchtitan's own AC (full, op-level or layer selective) on each body: the block's FQNs
        # stay valid (the body names its submodules as the block does)
        apply_ac(
            bodies,
            ac,
            model_compile_enabled=compile_model,
            op_sac_save_list=_op_sac_save_list,
            base_folder=job_config.job.dump_folder,
        )
    if compile_model:
        apply_compile(bodies, job_config.compile)
    for layer_id, block in blocks.items():
        block.set_body(bodies.layers[layer_id])
    backend = resolve_backend(model.model_args.mhar.backend, torch.device(titan_utils.device_type))
    if backend not in _SAVES_NOTHING:
        if compile_model:
            allow_routing_graphs(model.model_args.layout)
        wrap_reference_sites(blocks, checkpointed=ac.mode != "none", compiled=compile_model, job_config=job_config)
    logger.info(
        f"MHAR: activation checkpointing ({ac.mode}) and compile ({compile_model}) wrap each block's body; "
        f"the routing ({backend}) runs once per step, outside them"
    )


class BodyTree(nn.Module):
    """The blocks' bodies under `layers`, as torchtitan's apply_ac and apply_compile expect a model;
    used only while wrapping them (the model's module tree does not hold it)."""

    def __init__(self, blocks: dict[str, MHARBlock]):
        super().__init__()
        self.layers = nn.ModuleDict({layer_id: block.body for layer_id, block in blocks.items()})


def wrap_reference_sites(
    blocks: dict[str, MHARBlock], *, checkpointed: bool, compiled: bool, job_config: JobConfig
) -> None:
    """The torch backend's per-site routing (each block's `ReferenceRoute`): checkpointed per call (it
    saves its stacked fp32 sources and norms otherwise) and compiled in place (`nn.Module.compile`)."""
    ac = job_config.activation_checkpoint
    for block in blocks.values():
        reference = block.reference
        if checkpointed:
            reference = checkpoint_wrapper(reference, preserve_rng_state=False, determinism_check=ac.determinism_check)
        if compiled:
            reference.compile(backend=job_config.compile.backend, fullgraph=True)
        block.set_reference(reference)


def shard_routing_units(model: nn.Module, parallel_dims: ParallelDims, job_config: JobConfig) -> None:
    """Each block's routing sites in one FSDP2 unit of their own, before torchtitan's apply_fsdp shards
    the layers (which then leaves them out): the model routes a block's sites together at the block's
    start, before its later layers' units are gathered. Kept gathered from the forward to the backward
    (a block's sites hold 3 d + 1 parameters each, a few hundred KiB in bf16); their gradients are
    reduce-scattered when the backward ends. Mesh and mixed precision as torchtitan's parallelize_llama
    gives its apply_fsdp (torchtitan/models/llama3/infra/parallelize.py); the state-dict names stay the
    layers' (`layers.N.attn_routing.query`), since the sites stay where they are in the module tree."""
    names = ["dp_replicate", "fsdp"] if parallel_dims.dp_replicate_enabled else ["fsdp"]
    training = job_config.training
    fsdp_config = {
        "mesh": parallel_dims.get_mesh(names),
        "mp_policy": MixedPrecisionPolicy(
            param_dtype=TORCH_DTYPE_MAP[training.mixed_precision_param],
            reduce_dtype=TORCH_DTYPE_MAP[training.mixed_precision_reduce],
        ),
        "reshard_after_forward": False,
    }
    if training.enable_cpu_offload:
        fsdp_config["offload_policy"] = CPUOffloadPolicy()
    layers = list(model.layers.values())
    for layer_ids in model.model_args.layout.blocks():
        fully_shard([site for i in layer_ids for site in layers[i].sites()], **fsdp_config)


def allow_routing_graphs(layout: SourceLayout) -> None:
    """Let each compiled site keep every graph it needs: Dynamo specialises on the length of the
    `sources` list, 1..max_caller_sources, with and without grad (validation), so none falls back to
    eager; 2 * max_sources (the null counted) leaves one to spare each way."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 2 * layout.max_sources)
