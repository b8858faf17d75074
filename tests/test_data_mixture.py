"""Issue 22, mixtures: weighted named sources, shares batch by batch, the same batches for both arms and
on any number of ranks, exact resume (also onto another rank count), a source that runs out, refused and
allowed mixture changes, named validation sets."""

import json
import logging
import random
import re
import shutil
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from conftest import REPO, torchrun
from test_data import BATCH, ENCODE, SEQ, WORDS
from tokenizers import Tokenizer, processors
from torchtitan.components.tokenizer import HuggingFaceTokenizer

import data.stream as stream_module
from data.config import DataConfig
from data.counters import mixture_shares
from data.loader import Encoder, ParquetDataLoader, ValidationLoader, source_infos, source_shards
from data.mixture import GOLDEN, ONE, bounds, parse_mixture, parse_source, parse_validation_sets, phase, pick
from mhar_titan.components import fingerprint

STREAMS = 4


def write_source(folder, name, docs_per_shard, shards=STREAMS, seed=0):
    """`shards` parquet shards of random word documents whose source column is `name`."""
    rng = random.Random(f"{name}:{seed}")
    folder.mkdir(parents=True)
    for i in range(shards):
        texts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 40))) for _ in range(docs_per_shard)]
        table = pa.table({"text": texts, "source": [name] * len(texts)})
        pq.write_table(table, folder / f"shard-{i:02d}.parquet", row_group_size=8)
    return folder


@pytest.fixture
def sources(tmp_path):
    return {
        name: write_source(tmp_path / name, name, docs)
        for name, docs in (("web", 60), ("code", 40), ("math", 30), ("tiny", 2))
    }


def mixed_cfg(sources, weights, **kw):
    mixture = [f"{name}={w}:{sources[name]}" for name, w in weights.items()]
    return DataConfig(mixture=mixture, num_streams=STREAMS, source_column="source", check_shards=False, **kw)


def mixed_loader(cfg, rank=0, world=1, workers=0, batch=BATCH):
    return ParquetDataLoader(cfg, source_shards(cfg), ENCODE, SEQ, batch, rank, world, workers)


def run_batches(ld, n):
    it = iter(ld)
    return [next(it) for _ in range(n)]


def per_stream(ld, batches, start=0):
    """{stream id: [its windows]} of batches taken from `ld` from batch `start` on."""
    out = {}
    for k, (inputs, labels) in enumerate(batches, start):
        out.setdefault(ld.local[k % len(ld.local)], []).append((inputs["input"], labels))
    return out


@pytest.mark.parametrize("weights", [{"web": 0.7, "code": 0.3}, {"web": 0.5, "code": 0.3, "math": 0.2}])
def test_token_shares_match_the_weights_within_1_percent_over_1000_batches(sources, weights):
    cfg = mixed_cfg(sources, weights)
    ld = mixed_loader(cfg)
    run_batches(ld, 1000)
    counters = ld.counters()
    shares = mixture_shares(counters)
    total = sum(weights.values())
    for name, w in weights.items():
        assert abs(shares[f"data/mixture/{name}/share"] - w / total) < 0.01, shares
        # every window of a source's count came from that source's documents (their source column)
        assert counters[f"tokens/{name}"] * SEQ == counters[f"mixture/{name}/tokens"] * (SEQ + 1)
    assert sum(counters[f"mixture/{n}/tokens"] for n in weights) == 1000 * BATCH * SEQ


def test_the_pick_is_a_pure_function_with_bounded_discrepancy_on_every_prefix():
    """|count - w n| stays small for every prefix of every stream (a property of the golden-ratio
    sequence; checked exhaustively here, deterministic: no random input)."""
    assert GOLDEN == int(((5**0.5 - 1) / 2) * ONE) or abs(GOLDEN - ((5**0.5 - 1) / 2) * ONE) < 2**12
    weights = [0.55, 0.25, 0.15, 0.05]
    edges = bounds(weights)
    for stream in range(16):
        start, counts, worst = phase(0, stream), [0] * 4, 0.0
        for j in range(20000):
            counts[pick(start, j, edges)] += 1
            worst = max(worst, max(abs(c - w * (j + 1)) for c, w in zip(counts, weights, strict=True)))
        assert worst < 6, (stream, worst)
    assert [pick(phase(3, 1), j, edges) for j in range(50)] == [pick(phase(3, 1), j, edges) for j in range(50)]
    assert [pick(phase(3, 1), j, edges) for j in range(50)] != [pick(phase(4, 1), j, edges) for j in range(50)]


def test_both_arms_and_any_rank_count_see_the_same_windows_per_stream(sources):
    cfg = mixed_cfg(sources, {"web": 0.6, "code": 0.4})
    one = mixed_loader(cfg)
    again = mixed_loader(cfg)
    a, b = run_batches(one, 40), run_batches(again, 40)
    assert all(torch.equal(x[0]["input"], y[0]["input"]) and torch.equal(x[1], y[1]) for x, y in zip(a, b, strict=True))
    ref = per_stream(one, a)
    ranks = [mixed_loader(cfg, rank=r, world=2) for r in range(2)]
    for ld in ranks:
        for s, windows in per_stream(ld, run_batches(ld, 20)).items():
            assert all(torch.equal(w[0], r[0]) for w, r in zip(windows, ref[s], strict=False)), s


def test_resume_onto_another_rank_count_continues_every_stream_exactly(sources):
    cfg = mixed_cfg(sources, {"web": 0.5, "code": 0.3, "math": 0.2})
    ref_loader = mixed_loader(cfg)
    ref = per_stream(ref_loader, run_batches(ref_loader, 64))  # 16 batches per stream
    ranks = [mixed_loader(cfg, rank=r, world=2) for r in range(2)]
    state = {}
    for ld in ranks:
        run_batches(ld, 10)  # 5 batches of each of its two streams
        state.update(json.loads(json.dumps(ld.state_dict())))
    resumed = mixed_loader(cfg)  # one rank now holds all four streams
    resumed.load_state_dict({**state, "batches": 20})
    got = per_stream(resumed, run_batches(resumed, 8 * STREAMS), start=20)
    for s in range(STREAMS):
        pairs = zip(got[s], ref[s][5:], strict=False)
        assert all(torch.equal(g[0], r[0]) and torch.equal(g[1], r[1]) for g, r in pairs)
        assert len(got[s]) == 8


def test_a_source_read_to_its_end_starts_its_next_epoch_logged_and_counted(sources, caplog):
    cfg = mixed_cfg(sources, {"web": 0.5, "tiny": 0.5})
    ld = mixed_loader(cfg)
    with caplog.at_level(logging.INFO, logger="data.mixture"):
        run_batches(ld, 40)
    counters = ld.counters()
    assert counters["mixture/tiny/epochs"] > 0 and counters["mixture/web/epochs"] == 0
    assert any("source 'tiny' read to its end; epoch 1 begins" in r.getMessage() for r in caplog.records)
    assert abs(mixture_shares(counters)["data/mixture/tiny/share"] - 0.5) < 0.05  # re-read, at its weight


def test_mixture_settings_are_checked_naming_the_entry(sources):
    assert parse_source("web=0.7:s3://b/web/*.parquet+/x").paths == ("s3://b/web/*.parquet", "/x")
    assert parse_source("m=2:@/data/m.txt").manifest == "/data/m.txt"
    for bad, message in [
        ("web:0.7:/x", "expected 'name=weight:paths'"),
        ("web=heavy:/x", "weight 'heavy' is not a number"),
        ("web=0:/x", "must be positive"),
        ("w b=1:/x", "may hold letters"),
    ]:
        with pytest.raises(ValueError, match=message):
            parse_source(bad)
    with pytest.raises(ValueError, match="names a source twice"):
        parse_mixture(DataConfig(mixture=[f"a=1:{sources['web']}", f"a=1:{sources['code']}"]))
    with pytest.raises(ValueError, match="replaces paths"):
        parse_mixture(DataConfig(mixture=[f"a=1:{sources['web']}"], paths=["x"]))
    few = DataConfig(mixture=[f"web=1:{sources['web']}"], num_streams=8, check_shards=False)
    with pytest.raises(ValueError, match="source 'web' has 4 usable shards .* fewer than num_streams = 8"):
        mixed_loader(few)
    with pytest.raises(ValueError, match="on_source_exhausted"):
        DataConfig(on_source_exhausted="wrap").validate()


def test_a_changed_mixture_is_a_fingerprint_difference_and_its_state_is_carried_by_name(sources, caplog):
    before = mixed_cfg(sources, {"web": 0.7, "code": 0.3})
    after = mixed_cfg(sources, {"web": 0.6, "math": 0.4})

    class Job:  # the fields data_group reads
        def __init__(self, data):
            self.data = data
            self.training = SimpleNamespace(local_batch_size=4)

    old = fingerprint.data_group(Job(before), source_shards(before))
    new = fingerprint.data_group(Job(after), source_shards(after))
    lines = fingerprint.describe(fingerprint.differences({"data": old}, {"data": new}))
    assert "data.mixture.web.weight: 0.7 in the run, 0.6 now" in lines
    assert any(line.startswith("data.mixture.code.weight: 0.3 in the run") for line in lines)
    assert any(line.startswith("data.mixture.math.weight: ") for line in lines)

    ld = mixed_loader(before)
    run_batches(ld, 12)
    state = ld.state_dict()
    moved = mixed_loader(after)
    with caplog.at_level(logging.WARNING, logger="data.mixture"):
        moved.load_state_dict(state)
    log = " ".join(r.getMessage() for r in caplog.records)
    assert "source 'code' is no longer in the mixture" in log and "source 'math' is new to the mixture" in log
    web = {s: json.loads(state[f"stream_{s:05d}"])["sources"]["web"] for s in range(STREAMS)}
    assert all(moved.states[s]["sources"]["web"] == web[s] for s in range(STREAMS))  # web continues where it was


def test_named_validation_sets_paths_and_held_out_per_source(sources, tmp_path):
    extra = write_source(tmp_path / "extra", "extra", 20, shards=2)
    cfg = mixed_cfg(
        sources,
        {"web": 0.5, "code": 0.5},
        validation_fraction=0.2,
        validation_sets=["web:heldout=web", f"extra:{extra}", "all:heldout=*"],
    )
    sets = parse_validation_sets(cfg)
    assert [(v.name, v.heldout) for v in sets] == [("web", "web"), ("extra", None), ("all", "*")]
    shards = source_shards(cfg)
    web = ValidationLoader(cfg, shards["web"], ENCODE, SEQ, BATCH, 0, 1, vset=sets[0])
    code_and_web = ValidationLoader(cfg, shards["web"] + shards["code"], ENCODE, SEQ, BATCH, 0, 1, vset=sets[2])
    named = ValidationLoader(cfg, [], ENCODE, SEQ, BATCH, 0, 1, vset=sets[1])
    first, second = list(web), list(web)
    assert first and all(torch.equal(a[1], b[1]) for a, b in zip(first, second, strict=True))  # a fixed set
    assert len(list(code_and_web)) > len(first) and list(named)
    # held-out documents never reach training
    ld = mixed_loader(cfg)
    run_batches(ld, 30)
    assert ld.counters()["held_out_docs"] > 0
    for bad, message in [
        ("v:heldout=none", "no mixture source 'none'"),
        ("v heldout", "expected 'name:paths'"),
    ]:
        with pytest.raises(ValueError, match=message):
            parse_validation_sets(DataConfig(mixture=cfg.mixture, validation_fraction=0.1, validation_sets=[bad]))
    with pytest.raises(ValueError, match="set validation_fraction"):
        parse_validation_sets(DataConfig(mixture=cfg.mixture, validation_sets=["v:heldout=web"]))


def test_a_run_whose_source_runs_out_under_stop_ends_short_with_a_checkpoint_and_every_relaunch_at_once(tmp_path):
    tiny = write_source(tmp_path / "tiny", "tiny", 2)
    run = tmp_path / "run"
    mixture = ("--data.mixture", f"docstrings=0.5:assets/tiny/corpus,tiny=0.5:{tiny}")  # torchtitan: a,b
    args = ("--data.validation_sets", "docstrings:heldout=docstrings", "--validation.no-enable")
    args += ("--data.on_source_exhausted", "stop", "--training.steps", "30", "--checkpoint.interval", "50")
    proc = torchrun(run, *mixture, *args, check=False)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 66 and "Training completed" not in log  # not a finished run: not requeued either
    stopped = re.search(
        r"source\(s\) tiny read to their end .* the run stops at step (\d+) of 30, with a checkpoint", log
    )
    assert stopped and int(stopped.group(1)) < 30, log[-3000:]
    step = int(stopped.group(1))
    assert (run / "checkpoint" / f"step-{step}" / ".metadata").is_file()
    assert log.count("read to their end with [data] on_source_exhausted = 'stop'") == 2  # both ranks, same step
    assert f"step {step + 1}/30" not in log
    again = torchrun(run, *mixture, *args, check=False)  # a relaunch stops before training a step
    log = again.stdout + again.stderr
    assert again.returncode == 66 and f"the run stopped at step {step} of 30, before training any step" in log
    assert f"step {step + 1}/30" not in log and "Training starts" not in log


def test_with_the_start_up_check_no_stream_reads_a_footer(sources, monkeypatch):
    cfg = DataConfig(
        mixture=[f"web=0.5:{sources['web']}", f"tiny=0.5:{sources['tiny']}"],
        num_streams=STREAMS,
        source_column="source",
    )
    shards, infos = source_infos(cfg)  # one footer read per shard, here (rank 0 in a job)
    assert sorted(infos) == sorted(p for paths in shards.values() for p in paths)

    def refuse(path, *args):
        raise AssertionError(f"footer of {path} read again")

    monkeypatch.setattr(stream_module, "shard_info", refuse)
    ld = ParquetDataLoader(cfg, shards, ENCODE, SEQ, BATCH, 0, 1, 0, infos)
    run_batches(ld, 60)
    assert ld.counters()["mixture/tiny/epochs"] > 0  # every shard of a source reached


def test_documents_start_with_bos_where_the_tokenizer_template_puts_one(tmp_path):
    """Llama-3's tokenizer (Marin-8B's) prepends <|begin_of_text|> through its post-processor; the
    demo tokenizer has none. 'auto' follows the template, 'always' / 'never' decide."""
    tiny = REPO / "assets" / "tiny"
    tok = Tokenizer.from_file(str(tiny / "tokenizer.json"))
    bos = tok.token_to_id("<|begin_of_text|>")
    special = [("<|begin_of_text|>", bos)]
    tok.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A", special_tokens=special)
    llama_like = tmp_path / "llama_like"
    llama_like.mkdir()
    tok.save(str(llama_like / "tokenizer.json"))
    shutil.copy(tiny / "tokenizer_config.json", llama_like)
    text = ["the residual stream"]
    plain = Encoder(HuggingFaceTokenizer(str(tiny)))(text)[0]
    assert plain[0] != bos
    assert Encoder(HuggingFaceTokenizer(str(llama_like)))(text)[0] == [bos, *plain]
    assert Encoder(HuggingFaceTokenizer(str(tiny)), "always")(text)[0] == [bos, *plain]
    assert Encoder(HuggingFaceTokenizer(str(llama_like)), "never")(text)[0] == plain
    with pytest.raises(ValueError, match="bos = 'sometimes'"):
        DataConfig(bos="sometimes").validate()
