"""The CPU device module and the gloo/masked-sdpa adaptation of train specs."""

import os
import subprocess
import sys
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from conftest import REPO
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torchtitan.models.attention import FlexAttentionWrapper

from mhar_titan import cpu
from mhar_titan.train_spec import build_train_spec


def test_device_module_reports_process_peak_memory():
    mod = cpu.CPUDeviceModule()
    assert mod.get_device_properties().total_memory > 2**30
    assert mod.get_device_name().startswith("CPU")
    mod.reset_peak_memory_stats()
    before = mod.memory_stats()["reserved_bytes.all.peak"]
    block = torch.ones(64 * 2**20, dtype=torch.float32)  # 256 MiB, touched
    after = mod.memory_stats()["reserved_bytes.all.peak"]
    del block
    assert after - before >= 200 * 2**20


def test_activate_points_every_torchtitan_device_global_at_cpu():
    script = (
        "import torchtitan.train, torchtitan.tools.profiling\n"
        "from mhar_titan import cpu\n"
        "cpu.activate([])\n"
        "import importlib\n"
        "for mod, names in cpu._DEVICE_GLOBALS.items():\n"
        "    m = importlib.import_module(mod)\n"
        "    for n in names:\n"
        "        v = getattr(m, n)\n"
        "        assert (v == 'cpu') if n == 'device_type' else isinstance(v, cpu.CPUDeviceModule), (mod, n, v)\n"
        "import torchtitan.models.attention as a\n"
        "from torch.nn.attention.flex_attention import create_block_mask\n"
        "assert a._compiled_create_block_mask is create_block_mask  # block masks built without torch.compile\n"
        "from torchtitan.components.metrics import build_device_memory_monitor\n"
        "assert build_device_memory_monitor().get_peak_stats().max_reserved_gib > 0\n"
        "print('ok')\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


@pytest.fixture
def gloo_world():
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(d, 'store')}", rank=0, world_size=1)
        try:
            yield init_device_mesh("cpu", (1,))
        finally:
            dist.destroy_process_group()


def _shard(model: nn.Module, mesh) -> nn.Module:
    for layer in model:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _sum_flags(model: nn.Module) -> list[bool]:
    groups = [m._get_fsdp_state()._fsdp_param_group for m in model.modules() if isinstance(m, FSDPModule)]
    return [g.force_sum_reduction_for_comms for g in groups if g is not None]


def test_adapted_spec_forces_sum_reductions_and_masked_sdpa_for_flex(gloo_world):
    spec = build_train_spec()
    spec.parallelize_fn = lambda model, mesh: _shard(model, mesh)

    def model() -> nn.Sequential:
        return nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 8), FlexAttentionWrapper()))

    plain = spec.parallelize_fn(model(), gloo_world)
    assert _sum_flags(plain) == [False, False]

    cpu.adapt_train_spec(spec)
    cpu.adapt_train_spec(spec)  # idempotent
    adapted = spec.parallelize_fn(model(), gloo_world)
    assert _sum_flags(adapted) == [True, True]
    assert isinstance(adapted[1][1], cpu.MaskedSDPA)  # flex attention has no CPU backward
    # a fresh spec is unaffected
    assert build_train_spec().parallelize_fn is not spec.parallelize_fn
