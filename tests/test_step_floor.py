"""benchmarks.step_floor: the least bytes the MHAR arm moves beyond the control, and the ratio they allow."""

from __future__ import annotations

import subprocess

import pytest

from benchmarks import step_floor
from benchmarks.routing_bytes import PASSES, pass_bytes
from kernels.triton.launch import DEFAULT_TABLES

M, D, HEADS = 64, 96, 8  # small: the counts are exact integers at any size


def test_the_bodies_bytes_are_counted_by_hand():
    # 4 layers in 2 blocks, a unit of 1: each of 8 sites' routed terms read for its norm and again for the norm's
    # backward, and its gradient written; the first block's 2 deltas written and their gradients read, its second
    # layer reading the running sum; the last block's delta is no source
    assert step_floor.body_bytes(4, 2, 1) == 8 * 3 + 2 * 2 + 1
    assert step_floor.body_bytes(8, 8, 1) == 16 * 3 + 7 * 2


def test_calls_follow_the_model():
    assert step_floor.block_calls(8, 8) == [(1 + b, 2) for b in range(8)]
    assert step_floor.block_calls(16, 8) == [(1 + b, 4) for b in range(8)]
    with pytest.raises(ValueError, match="16 layers do not split into 3 blocks"):
        step_floor.block_calls(16, 3)
    with pytest.raises(ValueError, match="9 blocks"):
        step_floor.block_calls(18, 9)


def test_one_layer_a_block_leaves_nothing_to_share():
    # one layer a block: a block's call is a layer's two sites, so the least is what the tables launch
    floor = step_floor.step_floor(8, 8, M, D, HEADS, 1000.0, 1e12)
    assert floor.least_routing == sum(floor.routing.values())


def test_the_least_reads_a_blocks_sources_once_a_pass():
    # two layers a block: the forward and stats passes as launched read each of block b's 1 + b sources twice,
    # the least once: the difference is exactly 2 x sum(1 + b) tensors
    floor = step_floor.step_floor(16, 8, M, D, HEADS, 1000.0, 1e12)
    unit = M * D * 2
    assert sum(floor.routing.values()) - floor.least_routing == 2 * sum(1 + b for b in range(8)) * unit
    launched = pass_bytes(step_floor.block_calls(16, 8), M, D, HEADS, 2, DEFAULT_TABLES)
    assert floor.routing == {kind: launched[kind][1] for kind in PASSES}


def test_the_ratio_and_the_budget():
    floor = step_floor.Floor(routing={"forward": 10**9}, least_routing=0, bodies=0, control_ms=100.0, bandwidth=1e12)
    assert floor.ms(floor.launched) == pytest.approx(1.0, rel=1e-12)
    assert floor.best_ratio(floor.launched) == pytest.approx(100 / 101, rel=1e-12)
    assert floor.best_ratio(floor.least) == 1.0
    assert floor.budget_ms == pytest.approx(100 * (1 / 0.985 - 1), rel=1e-12)


def test_the_h100_geometry_is_out_of_reach_at_copy_bandwidth():
    # docs/performance.md's H100 figures (control 29,234 tokens/s at 8 layers, full AC; copy 2.93 TB/s): the bytes
    # alone take longer than the 0.985 target leaves, whatever the kernels
    floor = step_floor.step_floor(8, 8, 8192, 4096, 8, 29234.0, 2.93e12)
    assert floor.ms(floor.least) > floor.budget_ms
    assert floor.best_ratio(floor.least) < step_floor.TARGET


def test_bench_step_prints_the_floor_beside_the_measured_ratio(monkeypatch, capsys):
    monkeypatch.setattr(step_floor, "measured_bandwidth", lambda: 2.93e12)
    arm = {"tokens_per_s": 29234.0}
    results = {"full": {"control": arm, "mhar_triton": {"tokens_per_s": 29234.0 * 0.97}}, "none": {"control": arm}}
    step_floor.print_floors(results, "marin8b_8l", 8, 8192)
    out = capsys.readouterr().out
    assert "floor, full AC (8 layers, 8 blocks" in out and "measured 0.9700" in out and "none AC" not in out
    step_floor.print_floors({"full": {"control": arm}}, "marin8b_8l", 8, 8192)  # no MHAR arm: no floor
    assert capsys.readouterr().out == ""


def test_a_failed_bandwidth_measurement_leaves_the_run_standing(monkeypatch, capsys):
    # the measurement's process fails (as without CUDA): one line, no exception, the arms' tables already out
    def fail(*args, **kwargs):
        raise subprocess.CalledProcessError(1, args[0], stderr="no CUDA")

    monkeypatch.setattr(step_floor.subprocess, "run", fail)
    results = {"full": {"control": {"tokens_per_s": 1000.0}, "mhar_triton": {"tokens_per_s": 970.0}}}
    step_floor.print_floors(results, "marin8b_8l", 8, 8192)
    out = capsys.readouterr().out
    assert "floor: not computed, the copy bandwidth could not be measured" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--layers", "16", "--num-blocks", "3"], "16 layers do not split into 3 blocks"),
        (["--layers", "0"], "0 layers do not split into 8 blocks"),
        (["--layers", "-8"], "-8 layers do not split into 8 blocks"),
        (["--layers", "8", "--copy-tbps", "0"], "--copy-tbps must be positive"),
        (["--layers", "8", "--measured", "1.2"], "--measured 1.2"),
    ],
)
def test_bad_input_is_one_line(argv, message, capsys):
    base = ["--control-tokens-per-s", "1000", "--copy-tbps", "3"]
    with pytest.raises(SystemExit) as exit_:
        step_floor.main([*base, *argv])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_a_measured_ratio_at_or_above_one_is_said_not_divided_by(capsys):
    step_floor.main(["--layers", "8", "--control-tokens-per-s", "1000", "--copy-tbps", "3", "--measured", "1"])
    out = capsys.readouterr().out
    assert "measured 1.0000" in out and "no slower than the control" in out and "of copy bandwidth" not in out
