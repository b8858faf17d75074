"""Run under torchrun on 2 CPU ranks by tests/test_parallelize.py: the MHAR model parallelised as training does
(parallelize.py: each block's routing sites in an FSDP2 unit of their own, the layers in torchtitan's units), the
fused routing interpreted. Checks the units' contents, then one forward and backward against the unsharded model
on the same tokens; writes what it found to the JSON file named by argv[1] (rank 0)."""

import copy
import json
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist
from tiny_runs import routed_tiny_model
from torch.distributed.fsdp import FSDPModule, fully_shard
from torchtitan.distributed import ParallelDims

from mhar_titan import cpu
from mhar_titan.config import parse_config
from mhar_titan.model.parallelize import parallelize


def unit_modules(module: FSDPModule) -> list[torch.nn.Module]:
    """The module of each parameter one FSDP2 unit manages."""
    return [p._module_info.module for p in fully_shard.state(module)._fsdp_param_group.fsdp_params]


def main() -> None:
    dist.init_process_group("gloo")
    model = routed_tiny_model(seq=16, num_blocks=2, backend="triton", device="cpu")
    reference = copy.deepcopy(model)
    config = parse_config(["--job.config_file", "configs/tiny_cpu.toml", "--activation_checkpoint.mode", "full"])
    dims = ParallelDims(dp_replicate=1, dp_shard=2, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=2)
    spec = SimpleNamespace(parallelize_fn=parallelize)
    if cpu.should_activate():  # as the trainer runs on CPU ranks: gloo, SUM reductions
        cpu.install_device_module()
        cpu.adapt_train_spec(spec)
    dims.build_mesh()
    spec.parallelize_fn(model, dims, config)
    layers = list(model.layers.values())
    sites = [site for layer in layers for site in layer.sites()]
    found = {
        "sites_are_units": all(isinstance(site, FSDPModule) for site in sites),
        "unit_sizes": [len(unit_modules(layer.attn_routing)) for layer in layers],
        "units_hold_sites_only": all(
            any(m is site for site in sites) for layer in layers for m in unit_modules(layer.attn_routing)
        ),
        "block_units_shared": [
            fully_shard.state(layers[i].attn_routing) is fully_shard.state(layers[i + 1].ffn_routing) for i in (0, 2)
        ],
        "blocks_apart": fully_shard.state(layers[0].attn_routing) is not fully_shard.state(layers[2].attn_routing),
        "layers_hold_no_site": not any(m is site for layer in layers for m in unit_modules(layer) for site in sites),
        "layers_hold_their_weights": all(any(m is layer.attention.wq for m in unit_modules(layer)) for layer in layers),
        "names": sorted(n for n, _ in model.named_parameters() if "_routing." in n)[:4],
    }
    tokens = torch.randint(0, model.vocab_size, (1, 16), generator=torch.Generator().manual_seed(1))
    out = model(tokens)
    out.float().pow(2).mean().backward()
    ref = reference(tokens)
    ref.float().pow(2).mean().backward()
    found["output_error"] = (out.detach() - ref.detach()).abs().max().item()
    # both ranks took the same tokens; FSDP sums their gradients (torchtitan divides by nothing): 2x the reference's
    errors = {}
    for (name, p), (_, r) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        full = p.grad.full_tensor()
        errors[name] = ((full - 2 * r.grad).abs().max() / (2 * r.grad).abs().max().clamp_min(1e-30)).item()
    found["worst_grad"] = max(errors.items(), key=lambda kv: kv[1])
    found["site_grads_nonzero"] = all(
        p.grad.full_tensor().abs().max().item() > 0 for n, p in model.named_parameters() if n.endswith(".query")
    )
    if dist.get_rank() == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(found, f)
    dist.barrier()  # both ranks done before either tears down (a rank leaving early can abort its peer: met once)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
