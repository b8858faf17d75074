"""Run torchtitan's trainer on CPU processes over gloo.

torchtitan 0.2.2 hard-wires its device to CUDA at import time, gloo has no
PREMUL_SUM reduction (and a known AVG bug), and FlexAttention has no CPU
backward. `activate()` fixes all three in one place, so the rest of the project
runs the same code on 8 GPUs and on 2 CPU ranks in CI. Nothing else in the
project knows which device it runs on.

Flex attention's block masks (`[model] attention_mask = "block_causal"`) are built on a CPU without
torch.compile and applied by sdpa as an explicit boolean mask evaluated from the same mask function,
so CPU ranks compute the masking GPUs do, not plain causal attention.
"""

from __future__ import annotations

import functools
import importlib
import os
import platform
import resource
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, create_mask
from torchtitan.models.attention import FlexAttentionWrapper
from torchtitan.protocols.train_spec import TrainSpec
from torchtitan.tools.logging import logger

from mhar_titan.titan_compat import BLOCK_MASK_BUILDER
from mhar_titan.titan_compat import DEVICE_GLOBALS as _DEVICE_GLOBALS  # the table the CPU shims rebind


def should_activate() -> bool:
    """CPU mode when this host has no CUDA device (CI, laptops, login nodes)."""
    return not torch.cuda.is_available()


class CPUDeviceModule:
    """The subset of the `torch.cuda` API torchtitan calls, answered for the host.

    Memory figures are the process's resident set (VmHWM), the CPU analogue of
    the CUDA caching allocator's peak.
    """

    def set_device(self, device: torch.device | int | str) -> None:
        pass

    def current_device(self) -> int:
        return 0

    def device_count(self) -> int:
        return 1

    def synchronize(self, device: Any = None) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def get_device_name(self, device: Any = None) -> str:
        return _cpu_model_name()

    def get_device_properties(self, device: Any = None) -> SimpleNamespace:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return SimpleNamespace(name=_cpu_model_name(), total_memory=total)

    def reset_peak_memory_stats(self, device: Any = None) -> None:
        # Writing 5 to clear_refs resets VmHWM to the current RSS (Linux >= 4.0).
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass

    def memory_stats(self, device: Any = None) -> dict[str, int]:
        peak = _peak_rss_bytes()
        return {
            "active_bytes.all.peak": peak,
            "reserved_bytes.all.peak": peak,
            "num_alloc_retries": 0,
            "num_ooms": 0,
        }


@functools.cache
def _cpu_model_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return "CPU " + line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "CPU " + (platform.processor() or platform.machine())


def _peak_rss_bytes() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


_active = False


def activate(train_specs: list[TrainSpec]) -> None:
    """Point torchtitan at the CPU and adapt `train_specs` for gloo and sdpa."""
    global _active
    if not _active:
        install_device_module()
        _active = True
        logger.info(f"No CUDA device: training on {_cpu_model_name()} with gloo")
    for spec in train_specs:
        adapt_train_spec(spec)


def install_device_module() -> None:
    """Replace torchtitan's CUDA device globals with the CPU ones, and its compiled block-mask builder with the
    eager one (compiling it needs a C++ toolchain and takes longer than a tiny job)."""
    values = {"device_type": "cpu", "device_module": CPUDeviceModule()}
    for module_name, names in _DEVICE_GLOBALS.items():
        module = importlib.import_module(module_name)
        for name in names:
            if not hasattr(module, name):
                raise RuntimeError(f"{module_name}.{name} is gone: torchtitan is not 0.2.2")
            setattr(module, name, values[name])
    module_name, name = BLOCK_MASK_BUILDER
    setattr(importlib.import_module(module_name), name, create_block_mask)


class MaskedSDPA(nn.Module):
    """Flex attention's place on a CPU: sdpa with the block mask's mask function evaluated densely.

    Every layer of a step gets the same BlockMask, so its dense [batch, 1, q, kv] mask is built once.
    """

    _last: tuple[BlockMask, torch.Tensor] | None = None

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        block_mask: BlockMask,
        enable_gqa: bool = False,
        scale: float | None = None,
        **unsupported: Any,
    ) -> torch.Tensor:
        if any(x is not None and x is not False for x in unsupported.values()):
            raise NotImplementedError(f"flex attention on a CPU: {sorted(unsupported)} not supported")
        last = MaskedSDPA._last
        if last is None or last[0] is not block_mask:
            dense = create_mask(block_mask.mask_mod, q.shape[0], 1, q.shape[-2], k.shape[-2], device=q.device)
            MaskedSDPA._last = last = (block_mask, dense)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=last[1], scale=scale, enable_gqa=enable_gqa)


def adapt_train_spec(spec: TrainSpec) -> None:
    """SUM gradient reductions on every FSDP unit; flex attention as sdpa with its mask."""
    if not getattr(spec.parallelize_fn, "_cpu_sum_reductions", False):
        spec.parallelize_fn = _for_cpu(spec.parallelize_fn)


def use_masked_sdpa(model: nn.Module) -> int:
    """Replace every flex attention module of `model` with MaskedSDPA; how many were replaced."""
    found = [
        (parent, name)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, FlexAttentionWrapper)
    ]
    for parent, name in found:
        setattr(parent, name, MaskedSDPA())
    return len(found)


def _for_cpu(parallelize_fn: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
    """Flex attention as masked sdpa (before any compile sees the modules), and every FSDP unit reducing
    gradients with plain SUM (gloo lacks PREMUL_SUM).

    torchtitan already sets the gradient divide factor to 1 and divides the loss
    by the global token count, so SUM is the exact reduction it wants.
    """

    @functools.wraps(parallelize_fn)
    def parallelize(model: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
        if use_masked_sdpa(model):
            logger.info("CPU: flex attention runs as sdpa with the same block mask, evaluated densely")
        model = parallelize_fn(model, *args, **kwargs)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
        return model

    parallelize._cpu_sum_reductions = True  # type: ignore[attr-defined]
    return parallelize
