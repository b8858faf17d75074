"""2-rank FSDP2 training of the tiny MHAR config with full activation checkpointing on CPU."""

import math
import re

import pytest
from conftest import torchrun

from mhar_titan.components.tensorboard_scalars import load_scalars, read_scalars, routing_mean_tag, routing_site_tag
from mhar_titan.model.sources import SITE_NAMES, STAT_NAMES


def test_mhar_tiny_trains_moves_its_gates_and_logs_routing_stats(tmp_path):
    run = tmp_path / "mhar"
    proc = torchrun(run, "--training.steps", "10", "--mhar.stats_freq", "5", config="configs/tiny_cpu_mhar.toml")
    log = proc.stdout + proc.stderr
    assert "Applied FSDP to the model" in log and "Applied full activation checkpointing" in log

    losses = read_scalars(run)
    assert min(losses.values()) < losses[1] - 0.5, losses
    scalars = load_scalars(run)
    for layer in range(4):  # tiny_cpu_mhar: 2 blocks of 2 layers; layers 2, 3 also read D_0
        sources = ("null", "embed", "d00")[: 2 + layer // 2]
        for site in SITE_NAMES:
            stats = (*STAT_NAMES, "w_deltas", *(f"w_{s}" for s in sources))
            values = {stat: scalars[routing_site_tag(site, stat, layer)] for stat in stats}
            assert all(list(v) == [1, 5, 10] for v in values.values()), (site, layer, values)  # step 1 too
            if layer < 2:  # block 0 reads no delta: no tag for one
                assert routing_site_tag(site, "w_d00", layer) not in scalars
            assert abs(values["gate"][10]) > 0, (site, layer)
            assert values["gate"][1] == 0.0  # step 1's forward: the zero-initialised gate
            for step in (1, 5, 10):
                total = sum(values[f"w_{s}"][step] for s in sources)
                assert total == pytest.approx(1.0, abs=1e-5), (site, layer, step)
                assert values["w_deltas"][step] == pytest.approx(
                    total - values["w_null"][step] - values["w_embed"][step]
                )
                assert 0 < values["entropy"][step] <= math.log(len(sources)) + 1e-6
    assert scalars[routing_mean_tag("gate")][10] != 0
    ce, z, total = (read_scalars(run, f"train/{k}") for k in ("ce", "z_loss", "loss"))
    for step in range(1, 11):  # the logged loss is CE + z-loss, both per valid token over both ranks
        assert 0 < z[step] < 1e-2 * ce[step]
        assert total[step] == pytest.approx(ce[step] + z[step], rel=1e-5)
        assert total[step] == pytest.approx(losses[step], rel=1e-5)
    # where each step's time went (a log step's window), shares that add up to the step's wall time on a CPU
    shares = [
        scalars[f"time/{k}"] for k in ("data", "forward_backward", "optimizer", "checkpoint", "validation", "other")
    ]
    assert all(list(s) == list(range(1, 11)) for s in shares)
    for step in range(1, 11):
        assert all(0 <= s[step] <= 1 for s in shares) and sum(s[step] for s in shares) == pytest.approx(1, abs=1e-5)
    assert re.search(r"step 10/10 .* time data \d+% fwd\+bwd \d+% opt \d+% ckpt \d+% val \d+% other \d+%", log)
    docs = read_scalars(run, "data/docs")  # the loader's counters, summed over ranks
    assert list(docs) == list(range(1, 11)) and docs[10] > docs[1] > 0
    assert sum(read_scalars(run, tag)[10] for tag in _source_tags(run)) > 0


def _source_tags(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from mhar_titan.components.tensorboard_scalars import event_files

    acc = EventAccumulator(str(event_files(run)[0]))
    acc.Reload()
    return [t for t in acc.Tags()["scalars"] if t.startswith("data/tokens/")]


def test_triton_backend_trains_under_fsdp_and_checkpointing_like_torch(tmp_path):
    """The fused kernels (interpreted on CPU) inside 2-rank FSDP2 with full activation checkpointing."""
    losses = {}
    for backend in ("torch", "triton"):
        run = tmp_path / backend
        # the interpreter's cost grows with the rows routed: one 16-token sequence per rank
        short = ("--training.steps", "3", "--training.seq_len", "16", "--training.local_batch_size", "1")
        short += ("--mhar.stats_freq", "3", "--validation.no-enable")  # validation's 256 tokens > seq_len 16
        torchrun(run, *short, "--mhar.backend", backend, config="configs/tiny_cpu_mhar.toml")
        losses[backend] = read_scalars(run)
        assert read_scalars(run, routing_mean_tag("gate"))[3] != 0
    assert list(losses["triton"]) == [1, 2, 3]
    for step, loss in losses["torch"].items():
        assert losses["triton"][step] == pytest.approx(loss, rel=1e-5), step
