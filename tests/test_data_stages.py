"""Issue 39, mixture stages: weights that change at training steps, each stage's shares within 1% of its weights on
each rank, the step of a window the same on any number of ranks, exact resume before, at and after a boundary (also
from 2 ranks to 1), the refusals, the fingerprint, the counters, and the preview from a step."""

import json

import pytest
import torch
from conftest import REPO
from test_data import BATCH, ENCODE, SEQ
from test_data_mixture import STREAMS, mixed_cfg, per_stream, run_batches, write_source

from data.config import DataConfig
from data.counters import mixture_counter, stage_shares
from data.loader import ParquetDataLoader, check_stages, source_shards
from data.mixture import bounds, phase, pick
from data.stages import parse_stages, stream_batches_before
from mhar_titan.components import fingerprint
from mhar_titan.config import parse_config
from mhar_titan.preview import main as preview_main

WEIGHTS = {"web": 0.6, "code": 0.3, "math": 0.1}


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("stages")
    return {name: write_source(tmp / name, name, docs) for name, docs in (("web", 60), ("code", 40), ("math", 30))}


def staged(sources, stages, weights=WEIGHTS):
    return mixed_cfg(sources, weights, mixture_stages=stages)


def loader(cfg, rank=0, world=1, accumulation=1):
    return ParquetDataLoader(cfg, source_shards(cfg), ENCODE, SEQ, BATCH, rank, world, accumulation=accumulation)


def test_each_stage_delivers_its_weights_within_1_percent_on_each_rank(sources):
    """Two ranks, two microbatches a step each: stage 1 (the mixture's weights) for steps 1-300, stage 2 (math
    left out) for 301-600; the shares each rank delivered inside each stage, from its stage counters."""
    stage2 = {"web": 0.25, "code": 0.75, "math": 0.0}
    cfg = staged(sources, ["301: web=1 code=3 math=0"])
    for rank in range(2):
        ld = loader(cfg, rank, 2, accumulation=2)
        it = iter(ld)
        for stage, weights in ((1, WEIGHTS), (2, stage2)):
            for _ in range(300 * 2):
                next(it)
            counters = ld.counters()
            assert ld.schedule.at(ld.step()).number == stage and ld.step() == 300 * stage
            shares = stage_shares(counters)
            for name, w in weights.items():
                assert abs(shares[f"data/stage_share/{name}"] - w) < 0.01, (rank, stage, shares)
            assert sum(mixture_counter(counters, "stage_tokens").values()) == 300 * 2 * BATCH * SEQ
        assert mixture_counter(counters, "stage_tokens")["math"] == 0


def test_a_windows_step_and_source_are_the_same_on_any_number_of_ranks(sources):
    """The global batch g is batch g // num_streams of stream g % num_streams, in step g // (global batches a
    step) + 1: one rank taking 4 microbatches a step and two ranks taking 2 each read every stream alike."""
    cfg = staged(sources, ["4: web=0 code=0 math=1", "7: web=1 code=1 math=0"])
    one = loader(cfg, accumulation=4)
    ref = per_stream(one, run_batches(one, 40))  # 10 steps
    for rank in range(2):
        ld = loader(cfg, rank, 2, accumulation=2)
        for s, windows in per_stream(ld, run_batches(ld, 20)).items():
            assert len(windows) == len(ref[s]) == 10
            assert all(
                torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(windows, ref[s], strict=True)
            )
    # steps 4-6 read math alone: each stream's batches 3..5 (one batch a stream a step here)
    for s in range(STREAMS):
        assert stream_batches_before(4, s, STREAMS, 4) == 3 and stream_batches_before(7, s, STREAMS, 4) == 6


@pytest.mark.parametrize("saved_after", [4, 5, 6], ids=["before", "at", "after"])
def test_resume_before_at_and_after_a_boundary_from_2_ranks_to_1_is_exact(sources, saved_after):
    """The boundary is step 6; a checkpoint after step 4, 5 or 6 of two ranks resumes on one rank (the same
    global batch: 2 x 2 microbatches a step, then 1 x 4) and every stream continues with the uninterrupted
    run's windows."""
    cfg = staged(sources, ["6: web=0.1 code=0.1 math=0.8"])
    ref_loader = loader(cfg, accumulation=4)
    ref = per_stream(ref_loader, run_batches(ref_loader, 10 * 4))
    state = {}
    for rank in range(2):
        ld = loader(cfg, rank, 2, accumulation=2)
        run_batches(ld, saved_after * 2)
        state.update(json.loads(json.dumps(ld.state_dict())))  # through JSON, as a checkpoint holds it
    resumed = loader(cfg, accumulation=4)
    resumed.load_state_dict({**state, "batches": saved_after * 4})  # as the trainer places it: step x accumulation
    got = per_stream(resumed, run_batches(resumed, (10 - saved_after) * 4), start=saved_after * 4)
    for s in range(STREAMS):
        assert len(got[s]) == 10 - saved_after
        pairs = zip(got[s], ref[s][saved_after:], strict=True)
        assert all(torch.equal(g[0], r[0]) and torch.equal(g[1], r[1]) for g, r in pairs), s
    assert resumed.counters() == ref_loader.counters()  # the stage counters too


def test_a_window_is_picked_from_the_mixtures_sequence_against_its_steps_stage(sources):
    cfg = staged(sources, ["3: web=0 code=1 math=0"])
    ld = loader(cfg)  # one rank, one microbatch a step: batch k is step k + 1, from stream k % 4
    run_batches(ld, 4 * STREAMS)
    edges = bounds(list(WEIGHTS.values()))
    for s in range(STREAMS):
        early = 1 if s < 2 else 0  # batch 0 of streams 0 and 1 is in step 1 or 2; every other batch in stage 2
        picks = [pick(phase(cfg.seed, s), j, edges) for j in range(early * BATCH)]  # stage 1's weights
        later = SEQ * BATCH * (4 - early)
        expect = {name: SEQ * picks.count(i) + (later if name == "code" else 0) for i, name in enumerate(WEIGHTS)}
        assert ld.states[s]["tokens"] == expect, s
        assert ld.states[s]["stage"] == {"number": 2, "tokens": {"web": 0, "code": later, "math": 0}}
        assert ld.states[s]["windows"] == 4 * BATCH


@pytest.mark.parametrize(
    "stages,says",
    [
        (["5: web=1 code=1 math=1 blog=1"], r"stage 2\): no mixture source 'blog' \(the sources: web, code, math\)"),
        (["5: web=-0.5 code=1 math=1"], r"weight -0\.5 of 'web' must be finite and >= 0"),
        (["5: web=1 code=1"], r"no weight for math: name every source"),
        (["5: web=0 code=0 math=0"], r"every weight is 0"),
        (["9: web=1 code=1 math=1", "5: web=1 code=0 math=0"], r"'5: .*' \(stage 3\): starts at step 5, not after"),
        (["1: web=1 code=1 math=1"], r"starts at step 1, not after stage 1's step 1"),
        (["21: web=1 code=1 math=1"], r"starts at step 21, past the run's last step 20"),
        (["x: web=1 code=1 math=1"], r"step 'x' is not a whole number"),
        (["web=1 code=1 math=1"], r"expected 'STEP: name=weight"),
        (["5: web=1 code=1 math=1 web=2"], r"source 'web' named twice"),
    ],
    ids=[
        "unknown-source",
        "negative",
        "missing-source",
        "all-zero",
        "out-of-order",
        "at-step-1",
        "past-the-end",
        "bad-step",
        "no-step",
        "twice",
    ],
)
def test_bad_stages_are_refused_naming_the_stage_and_value(sources, stages, says):
    cfg = staged(sources, stages)
    with pytest.raises(ValueError, match=says):
        parse_stages(cfg, list(WEIGHTS), list(WEIGHTS.values()), 20)


def test_the_job_refuses_bad_stages_before_any_work_and_without_a_mixture():
    base = ["--job.config_file", str(REPO / "configs" / "tiny_cpu.toml")]
    with pytest.raises(ValueError, match=r"starts at step 151, past the run's last step 150"):
        parse_config([*base, "--data.mixture_stages", "151: docstrings=1 code=1"])
    # the run's last step is its LR schedule's end when that is later (a schedule trained in several jobs)
    cfg = parse_config(
        [
            *base,
            "--training.steps",
            "100",
            "--lr_scheduler.total_steps",
            "150",
            "--data.mixture_stages",
            "121: docstrings=1 code=1",
        ]
    )
    assert [s.start for s in check_stages(cfg).stages] == [1, 121]
    with pytest.raises(ValueError, match=r"mixture_stages change the weights of a mixture: set \[data\] mixture"):
        parse_stages(DataConfig(paths=["x"], mixture_stages=["5: corpus=1"]), ["corpus"], [1.0], None)


def test_the_fingerprint_records_the_stages_normalised_and_a_change_is_refused(sources):
    def group(stages):
        return fingerprint.data_group(SimpleJob(staged(sources, stages)), {n: [] for n in WEIGHTS})

    plain, a, b = group([]), group(["301: web=1 code=3 math=0"]), group(["301: web=0.25 code=0.75 math=0"])
    assert "mixture_stages" not in plain  # as every run recorded before stages
    assert (
        a["mixture_stages"]
        == b["mixture_stages"]
        == [{"number": 2, "start": 301, "weights": {"web": 0.25, "code": 0.75, "math": 0.0}}]
    )
    moved = group(["401: web=1 code=3 math=0"])
    diffs = fingerprint.describe(fingerprint.differences({"data": a}, {"data": moved}))
    assert diffs == [
        'data.mixture_stages: [{"number": 2, "start": 301, "weights": {"web": 0.25, "code": '
        '0.75, "math": 0.0}}] in the run, [{"number": 2, "start": 401, "weights": {"web": 0.25, '
        '"code": 0.75, "math": 0.0}}] now'
    ]


class SimpleJob:
    """What data_group reads of a job config."""

    def __init__(self, data):
        self.data = data
        self.training = type("T", (), {"local_batch_size": BATCH})()


def test_the_preview_from_a_step_shows_that_stages_shares(sources, tmp_path, capsys):
    mixture = ", ".join(f'"{n}={w}:{sources[n]}"' for n, w in WEIGHTS.items())
    config = tmp_path / "staged.toml"
    config.write_text(
        f'[job]\ncustom_config_module = "mhar_titan.config"\n[model]\nname = "llama3_mhar"\nflavor = "tiny"\n'
        f'hf_assets_path = "{REPO / "assets" / "tiny"}"\n'
        f"[training]\nsteps = 200\nseq_len = {SEQ}\nlocal_batch_size = {BATCH}\nglobal_batch_size = {2 * BATCH}\n"
        f'[data]\nmixture = [{mixture}]\nmixture_stages = ["101: web=0 code=1 math=3"]\nnum_streams = {STREAMS}\n'
        "check_shards = false\nvalidation_fraction = 0.02\n"
    )
    out = {}
    for step in (1, 101):  # the command's main (tests/test_data_trust.py runs `python -m mhar_titan.preview`)
        preview_main([str(config), "--world", "2", "--json", "--step", str(step), "--batches", "400"])
        out[step] = json.loads(capsys.readouterr().out)
    assert [st["stage"] for st in out[1]["stages"]] == [1, 2] and [st["stage"] for st in out[101]["stages"]] == [2]
    shares = out[101]["stages"][0]["source_shares"]
    assert shares["web"] == 0 and abs(shares["math"] - 0.75) < 0.02 and abs(shares["code"] - 0.25) < 0.02
    assert out[101]["source_shares"] == shares and out[101]["step"] == 101
    first = out[1]["stages"][0]
    assert first["from_step"] == 1 and first["weights"] == pytest.approx({"web": 0.6, "code": 0.3, "math": 0.1})
