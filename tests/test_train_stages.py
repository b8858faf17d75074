"""Mixture stages through train_cpt.py on 2 CPU ranks: the stage and its shares in TensorBoard, and a resume across
the boundary that continues bit for bit (same ranks) and reads the same data from 2 ranks to 1."""

import shutil
from pathlib import Path

import pytest
from conftest import torchrun

from mhar_titan.components.tensorboard_scalars import LOSS_TAG, load_scalars, read_scalars

# tiny_cpu.toml's mixture (docstrings 0.7, code 0.3), then code-heavy from step 5 of 8
STAGED = (
    *("--data.mixture_stages", "5: docstrings=1 code=9"),
    *("--lr_scheduler.total_steps", "8", "--lr_scheduler.warmup_steps", "2"),
    *("--checkpoint.interval", "4", "--validation.no-enable"),
)


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("staged") / "run"
    proc = torchrun(run, "--training.steps", "8", *STAGED)
    assert "[data] mixture stage 2 begins at step 5: docstrings 10.0%, code 90.0%" in proc.stdout + proc.stderr
    return run


def data_tags(run: Path) -> dict[str, dict[int, float]]:
    return {tag: series for tag, series in load_scalars(run).items() if tag.startswith("data/") or tag == "tokens_seen"}


def test_the_stage_and_its_shares_are_logged(straight):
    stage = read_scalars(straight, "data/stage")
    assert stage == {s: (1.0 if s < 5 else 2.0) for s in range(1, 9)}
    tags = data_tags(straight)
    for step in (4, 8):
        shares = {t: v[step] for t, v in tags.items() if t.startswith("data/stage_share/")}
        assert sorted(shares) == ["data/stage_share/code", "data/stage_share/docstrings"]
        assert abs(sum(shares.values()) - 1) < 1e-6
    # stage 1 (steps 1-4) at its weights 0.7 / 0.3; stage 2 (5-8) counted from its first step, at 0.1 / 0.9
    assert tags["data/stage_share/docstrings"][4] > 0.5 and tags["data/stage_share/code"][8] > 0.75
    assert tags["data/stage_share/code"][4] == tags["data/mixture/code/share"][4]  # stage 1 is the run so far


@pytest.fixture(scope="module")
def first_half(tmp_path_factory) -> Path:
    """Steps 1-4 on 2 ranks, the checkpoint just before the boundary."""
    run = tmp_path_factory.mktemp("half") / "run"
    torchrun(run, "--training.steps", "4", *STAGED)
    return run


def test_a_resume_at_the_boundary_continues_bit_for_bit(straight, first_half, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(first_half, run)
    torchrun(run, "--training.steps", "8", *STAGED)
    for tag in (LOSS_TAG, "grad_norm"):
        assert read_scalars(run, tag) == read_scalars(straight, tag), tag
    assert data_tags(run) == data_tags(straight)


def test_from_2_ranks_to_1_at_the_boundary_every_rank_count_reads_the_same_data(straight, first_half, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(first_half, run)
    # one rank, the same global batch (2 microbatches of 4 sequences a step), the stage from step 5 on
    torchrun(run, "--training.steps", "8", *STAGED, "--training.global_batch_size", "8", nproc=1)
    want, got = data_tags(straight), data_tags(run)
    assert sorted(got) == sorted(want)
    for tag, series in want.items():
        assert got[tag] == series, tag
