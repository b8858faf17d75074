"""The memory plan against the peaks measured on one H200 (docs/performance.md, 2026-12-01, the routed
terms in the autocast dtype: make bench-step's geometry, the 8B width at 8 and 16 layers, seq 4096,
microbatch 2, 8 MHAR blocks, both arms, every AC mode), and its command line."""

import json

import pytest
from conftest import REPO

from mhar_titan.config import parse_config
from mhar_titan.plan import GIB, estimate, geometry, host_checkpoint, main, parse_memory

# (flavor, arm, mode): (peak active GiB, allocated GiB after the forward), as make bench-step printed them
MEASURED = {
    ("marin8b_16l", "control", "full"): (84.90, 72.85),
    ("marin8b_16l", "mhar", "full"): (84.91, 75.40),  # 2026-12-03, the backward's logits kept
    ("marin8b_16l", "control", "selective"): (84.90, 78.61),
    ("marin8b_16l", "mhar", "selective"): (84.91, 81.12),
    ("marin8b_16l", "control", "none"): (97.32, 95.36),
    ("marin8b_16l", "mhar", "none"): (99.83, 97.87),
    ("marin8b_8l", "control", "full"): (52.40, 45.84),
    ("marin8b_8l", "mhar", "full"): (52.40, 47.35),
    ("marin8b_8l", "control", "selective"): (52.40, 48.73),
    ("marin8b_8l", "mhar", "selective"): (52.40, 50.23),
    ("marin8b_8l", "control", "none"): (59.06, 57.10),
    ("marin8b_8l", "mhar", "none"): (60.56, 58.61),
}
# float8 (torchtitan's converter, rowwise, the output in bf16), 2026-12-04: `make bench-step`'s geometry with
# --float8 (the control), and benchmarks.float8_parity's jobs without the EMA (the marin8b configs, 8 layers, mode none)
MEASURED_FLOAT8 = {
    ("marin8b_8l", "control", "none", True): (53.06, 51.11),
    ("marin8b_8l", "control", "selective", True): (52.40, 48.73),
    ("marin8b_8l", "control", "full", True): (52.40, 45.85),
    ("marin8b_16l", "control", "none", True): (85.32, 83.36),
    ("marin8b_8l", "control", "none", False): (42.65, None),
    ("marin8b_8l", "mhar", "none", False): (44.17, None),
}
BENCH = ["--training.seq_len", "4096", "--training.local_batch_size", "2", "--mhar.num_blocks", "8"]
FLOAT8 = ["--model.converters", "quantize.linear.float8"]


def assert_plan_within_5_percent(flavor, arm, mode, extra, peak, forward):
    cfg = parse_config(
        ["--job.config_file", str(REPO / "configs" / "tiny_cpu.toml"), "--model.flavor", flavor, *BENCH, *extra]
    )
    e = estimate(geometry(cfg, gpus=1, mhar=arm == "mhar"), mode)
    assert abs(e["peak"] / GIB - peak) <= 0.05 * peak, (e["peak"] / GIB, peak)
    if forward is not None:  # the forward's end is the backward's start before the logits' gradient
        start = e["moments"]["backward start"]
        got = (sum(start.values()) - start["logit grads"]) / GIB
        assert abs(got - forward) <= 0.05 * forward, (got, forward)


@pytest.mark.parametrize("flavor,arm,mode", list(MEASURED))
def test_plan_is_within_5_percent_of_the_measured_peak_and_forward(flavor, arm, mode):
    assert_plan_within_5_percent(flavor, arm, mode, [], *MEASURED[flavor, arm, mode])


@pytest.mark.parametrize("flavor,arm,mode,ema", list(MEASURED_FLOAT8))
def test_plan_under_float8_is_within_5_percent_of_the_measured_peak_and_forward(flavor, arm, mode, ema):
    extra = FLOAT8 + ([] if ema else ["--ema.no-enable"])
    assert_plan_within_5_percent(flavor, arm, mode, extra, *MEASURED_FLOAT8[flavor, arm, mode, ema])


def test_the_marin8b_configs_run_the_mode_the_plan_recommends_for_8_h100s(capsys):
    modes = set()
    for arm in ("control", "mhar"):
        cfg_path = str(REPO / "configs" / f"marin8b_{arm}.toml")
        main([cfg_path, "--gpus", "8", "--gpu-memory", "80GiB", "--json", "--model.flavor", "marin8b"])
        result = json.loads(capsys.readouterr().out)
        assert set(result["peak_gib"]) == {"none", "selective", "full"}
        assert all(result["peak_gib"][m]["mhar"] > result["peak_gib"][m]["control"] for m in result["peak_gib"])
        modes.add(result["recommended"])
        assert parse_config(["--job.config_file", cfg_path]).activation_checkpoint.mode == result["recommended"]
    assert len(modes) == 1  # both arms, one mode


def test_a_plan_that_cannot_fit_says_so_and_bad_input_is_named(capsys, tmp_path):
    tiny = str(REPO / "configs" / "marin8b_mhar.toml")
    main([tiny, "--gpus", "1", "--gpu-memory", "24GiB", "--model.flavor", "marin8b"])
    assert "no mode fits" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="config.json.*--model.flavor marin8b"):
        main([tiny, "--gpus", "8", "--gpu-memory", "80GiB", "--model.hf_assets_path", str(tmp_path / "absent")])
    assert parse_memory("80GiB") == 80 * GIB and parse_memory("141 GB") == 141e9
    with pytest.raises(SystemExit):
        main([tiny, "--gpus", "8", "--gpu-memory", "80 gigs"])
    with pytest.raises(SystemExit):
        main([str(tmp_path / "absent.toml"), "--gpus", "8", "--gpu-memory", "80GiB"])
    assert "absent.toml: no such file" in capsys.readouterr().err


def test_host_memory_for_checkpoints_counts_each_mode_page_locked_and_while_writing(capsys):
    """The synchronous saves' page-locked buffers: one per distinct fp32 shard shape of at least 1 MiB (at the 8B
    width: the embedding's, which the output shares, wq's and wo's, wk's and wv's, w1's and w3's, w2's); `async`
    a pageable copy of the state while a save writes; `async_with_pinned_mem` a page-locked copy kept."""
    args = ["--job.config_file", str(REPO / "configs" / "tiny_cpu.toml"), "--model.flavor", "marin8b_8l", *BENCH]
    g = geometry(parse_config([*args, "--ema.no-enable"]), gpus=1, mhar=False)
    shapes = 4 * 4096 * (128256 + 4096 + 1024 + 14336 + 14336)
    assert g.staged_bytes == shapes  # 2.47 GiB; the norms (16 KiB) go through DCP's own copy
    state = 12 * g.params  # fp32 weights and AdamW's two moments, no EMA
    assert host_checkpoint(g, "disabled") == {"page_locked": shapes, "during_save": 0.0}
    assert host_checkpoint(g, "async") == {"page_locked": shapes, "during_save": state}
    assert host_checkpoint(g, "async_with_pinned_mem") == {"page_locked": shapes + state, "during_save": 0.0}
    with pytest.raises(ValueError, match="async_mode 'sync'"):
        host_checkpoint(g, "sync")
    eight = geometry(parse_config(args), gpus=8, mhar=False)  # FSDP2 shards dim 0: 16,032 embedding rows a rank
    assert eight.staged_bytes == 4 * (16032 * 4096 + 512 * 4096 + 128 * 4096 + 1792 * 4096 + 512 * 14336)
    assert host_checkpoint(eight, "async_with_pinned_mem")["page_locked"] == eight.staged_bytes + 16 * eight.params / 8

    main(
        [
            *(str(REPO / "configs" / "marin8b_mhar.toml"), "--gpus", "8", "--gpu-memory", "80GiB"),
            *("--model.flavor", "marin8b", "--checkpoint.async_mode", "async"),
        ]
    )
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("host memory"))
    assert line.endswith("async_with_pinned_mem 15.3 page-locked (this config: async)"), line
    assert "async 0.3 page-locked + 15.0 while a save writes" in line
