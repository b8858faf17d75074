"""Issue 18, the data side: JSON (never pickled) loader state of constant size, exact resume from any
batch (inside a document many windows long, with loader workers, on fewer ranks), truncation of long
documents, errors instead of endless loops on corpora without data, every Arrow string type, bad UTF-8."""

import json
import logging
import pickle
import random
import re
import struct
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from conftest import REPO, torchrun
from test_data import BATCH, ENCODE, SEQ, WORDS, by_stream, cfg_for, flat, loader, stream_docs, take, take_until

from data.config import DataConfig
from data.loader import ParquetDataLoader, ValidationLoader
from data.shards import BadShardError, NoDataError, check_shards, list_shards
from data.stream import _RateLimitedLog
from mhar_titan.preview import main as preview_main

WINDOW = BATCH * (SEQ + 1)


def words(rng, n):
    return " ".join(rng.choice(WORDS) for _ in range(n))


@pytest.fixture
def long_corpus(tmp_path):
    """Four shards (one per stream and epoch), each with short, empty and null documents and one document
    of about 1200 tokens: 35 windows of BATCH x (SEQ + 1)."""
    rng = random.Random(18)
    folder = tmp_path / "long"
    folder.mkdir()
    docs = {}
    for i in range(4):
        texts = [words(rng, rng.randint(1, 20)) for _ in range(5)] + [words(rng, 300), "", None]
        rng.shuffle(texts)
        sources = [rng.choice(["web", "code"]) for _ in texts]
        path = folder / f"shard-{i:02d}.parquet"
        pq.write_table(pa.table({"text": texts, "source": sources}), path, row_group_size=4)
        docs[str(path)] = list(zip(texts, sources, strict=True))
    return folder, docs


def states_after_each_batch(ld, n):
    """The windows of n batches and the JSON-round-tripped state_dict before and after each."""
    it, batches, states = iter(ld), [], [json.loads(json.dumps(ld.state_dict()))]
    for _ in range(n):
        batches.append(next(it))
        states.append(json.loads(json.dumps(ld.state_dict())))
    return batches, states


def same(a, b):
    return all(torch.equal(x[0]["input"], y[0]["input"]) and torch.equal(x[1], y[1]) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_from_the_state_after_any_batch_continues_exactly(long_corpus, workers):
    folder, _ = long_corpus
    cfg = cfg_for(folder)
    n = 120  # 60 batches per stream: through each stream's long document and into its next epoch
    want, states = states_after_each_batch(loader(cfg, 1), n)
    got, states_w = states_after_each_batch(loader(cfg, 1, workers=workers), n)
    assert same(got, want) and states_w == states  # states do not depend on the loader workers
    offsets = [json.loads(st[f"stream_{s:05d}"])["sources"]["corpus"]["offset"] for st in states for s in (1, 3)]
    assert max(offsets) > 20 * WINDOW  # some states lie deep inside a long document
    assert {json.loads(states[-1][f"stream_{s:05d}"])["sources"]["corpus"]["epoch"] for s in (1, 3)} == {1}
    assert max(len(st[f"stream_{s:05d}"]) for st in states for s in (1, 3)) < 400  # constant size, no tokens

    cuts = range(n - 1) if workers == 0 else range(0, n - 1, 13)  # each resume with workers starts processes
    for k in cuts:
        resumed = loader(cfg, 1, workers=workers)
        resumed.load_state_dict(states[k])
        batches, _ = take(resumed, 2)
        assert same(batches, want[k : k + 2]), f"resumed after batch {k}"
        assert json.loads(json.dumps(resumed.state_dict())) == states[k + 2], f"state, resumed after batch {k}"


def test_resume_on_one_rank_after_two_from_any_batch(long_corpus):
    folder, docs = long_corpus
    cfg = cfg_for(folder)
    reference = loader(cfg, 0, world=1)
    ref_batches, _ = take(reference, 100)
    ref = {s: flat(b) for s, b in by_stream(reference, ref_batches).items()}
    for s in range(4):  # the documented order: every stream's documents joined by end-of-text
        text = [t for doc in stream_docs(cfg, docs, s) for t in ENCODE([doc])[0] + [ENCODE.eos_id]]
        assert ref[s][: len(text)] == text[: len(ref[s])], f"stream {s}"

    ranks = [loader(cfg, r, world=2) for r in range(2)]
    iters = [iter(ld) for ld in ranks]
    got = {s: [] for s in range(4)}
    for k in range(40):  # cut after every batch of both ranks
        state = {}
        for ld in ranks:
            state.update(json.loads(json.dumps(ld.state_dict())))  # what DCP gathers from both ranks
        one = loader(cfg, 0, world=1)
        one.load_state_dict(state)
        tail, _ = take(one, 4)
        for s, b in by_stream(one, tail, start=k).items():
            tokens = flat(got[s] + b)
            assert tokens == ref[s][: len(tokens)], f"stream {s}, cut after {k} batches per rank"
        for ld, it in zip(ranks, iters, strict=True):
            for s, b in by_stream(ld, [next(it)], start=k).items():
                got[s] += b


def _in_source(change):
    """`change` applied to the state of the stream's one source ('corpus') inside the mixture state."""

    def apply(v):
        state = json.loads(v)
        state["sources"]["corpus"] = change(state["sources"]["corpus"])
        return json.dumps(state)

    return apply


SUB = "dataloader.stream_00000.sources.corpus"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda v: pickle.dumps(json.loads(v)), r"dataloader.stream_00000: not a JSON stream state \(bytes: a pickled"),
        (lambda v: "{not json", r"dataloader.stream_00000: not a JSON stream state"),
        (lambda v: 7, r"dataloader.stream_00000: not a JSON stream state \(a int, not a str\)"),
        (lambda v: "[1, 2]", r"dataloader.stream_00000: .*not an object"),
        (lambda v: json.dumps({**json.loads(v), "buffer": [1, 2]}), r"not a mixture stream state \(keys"),
        (lambda v: json.dumps({**json.loads(v), "windows": -2}), r"dataloader.stream_00000.windows: -2"),
        (_in_source(lambda st: {**st, "buffer": [1, 2]}), r"unknown: \['buffer'\]"),
        (_in_source(lambda st: {k: x for k, x in st.items() if k != "row"}), r"missing: \['row'\]"),
        (_in_source(lambda st: {**st, "offset": 1.5}), rf"{SUB}.offset: 1.5"),
        (_in_source(lambda st: {**st, "docs": True}), rf"{SUB}.docs: True"),
        (_in_source(lambda st: {**st, "epoch": -1}), rf"{SUB}.epoch: -1"),
        (_in_source(lambda st: {**st, "source_tokens": {"web": "3"}}), r"source_tokens.web: '3'"),
        (_in_source(lambda st: {**st, "source_tokens": [3]}), rf"{SUB}.source_tokens: \[3\]"),
    ],
)
def test_loader_state_is_json_and_anything_else_is_refused_naming_the_key(long_corpus, change, message):
    folder, _ = long_corpus
    cfg = cfg_for(folder)
    ld = loader(cfg, 0)
    take(ld, 3)
    state = ld.state_dict()
    assert type(state["batches"]) is int and all(type(v) is str for k, v in state.items() if k != "batches")
    fresh = loader(cfg, 0)
    with pytest.raises(ValueError, match=message):
        fresh.load_state_dict({**state, "stream_00000": change(state["stream_00000"])})
    assert fresh.batches == 0  # nothing half-loaded
    with pytest.raises(ValueError, match="dataloader.stream_00002: missing"):
        fresh.load_state_dict({k: v for k, v in state.items() if k != "stream_00002"})
    with pytest.raises(ValueError, match="dataloader.batches: '3'"):
        fresh.load_state_dict({**state, "batches": "3"})


def test_nothing_in_data_unpickles():
    for path in (REPO / "data").glob("*.py"):
        assert not re.search(r"import pickle|pickle\.load|from pickle", path.read_text()), path


def test_long_documents_are_truncated_counted_and_logged(long_corpus, caplog, monkeypatch):
    monkeypatch.setattr("data.stream._TRUNCATIONS", _RateLimitedLog("truncation"))  # the first ones are logged in full
    folder, docs = long_corpus
    cap = 100
    cfg = cfg_for(folder, max_document_tokens=cap)
    ld = loader(cfg, 0, world=1)
    with caplog.at_level(logging.WARNING, logger="data.stream"):
        batches = take_until(ld, lambda bs: len(bs) >= 60)
    delivered = {s: flat(b) for s, b in by_stream(ld, batches).items()}
    docs_done = truncated = cut = 0
    for s in range(4):
        position = 0
        for epoch in range(3):
            for doc in stream_docs(cfg, docs, s, epoch):
                ids = ENCODE([doc])[0]
                kept = ids[:cap] + [ENCODE.eos_id]
                assert delivered[s][position : position + len(kept)] == kept[: max(0, len(delivered[s]) - position)]
                if position + len(kept) <= len(delivered[s]):
                    docs_done += 1
                    truncated += len(ids) > cap
                    cut += max(0, len(ids) - cap)
                position += len(kept)
    counters = ld.counters()
    assert truncated >= 4  # each stream delivered its long document at least once
    assert (counters["docs"], counters["truncated_docs"], counters["truncated_tokens"]) == (docs_done, truncated, cut)
    logged = [r.getMessage() for r in caplog.records if "truncated to max_document_tokens = 100" in r.getMessage()]
    assert logged and all("shard-0" in m and ": row group " in m and ", row " in m for m in logged)


def test_truncation_warnings_are_rate_limited(caplog):
    log = _RateLimitedLog("truncation", first=10)
    with caplog.at_level(logging.WARNING, logger="data.stream"):
        for i in range(2500):
            log.warn(f"doc {i}")
    assert [r.getMessage().split()[2] for r in caplog.records] == [str(i) for i in range(10)] + ["99", "999"]
    assert caplog.records[-1].getMessage().endswith("[truncation 1000]")


def empty_corpus(folder):
    """Four shards without a single token: empty strings, nulls, a column of Arrow type null."""
    folder.mkdir()
    columns = [["", ""], [None, None, None], pa.nulls(2), ["", None]]
    for i, texts in enumerate(columns):
        pq.write_table(pa.table({"text": texts, "source": ["web"] * len(texts)}), folder / f"empty-{i}.parquet")
    return folder


def test_a_corpus_without_tokens_is_an_error_naming_it_not_a_hang(tmp_path):
    # (with loader workers the error reaches the main process as well, but torch's DataLoader then
    # takes 10 s to shut its workers down: left out here)
    folder = empty_corpus(tmp_path / "empty")
    with pytest.raises(NoDataError, match=r"empty-0.parquet, .*empty-3.parquet yield no token") as e:
        take(loader(cfg_for(folder), 0), 1)
    assert "9 rows: 9 documents empty or null, 0 held out for validation" in str(e.value)


def test_streams_with_an_empty_epoch_go_on_when_other_shards_hold_documents(tmp_path, caplog):
    folder = empty_corpus(tmp_path / "partly")
    pq.write_table(pa.table({"text": [words(random.Random(1), 40)] * 3, "source": ["web"] * 3}), folder / "z.parquet")
    cfg = DataConfig(paths=[str(folder)], num_streams=5, seed=7)
    with caplog.at_level(logging.WARNING, logger="data.stream"):
        take(ParquetDataLoader(cfg, list_shards(cfg.paths), ENCODE, SEQ, BATCH, 0, 1), 10)
    assert any("yielded no document" in r.getMessage() for r in caplog.records)


def test_skipping_every_shard_at_start_up_is_an_error(tmp_path):
    for i in range(2):
        (tmp_path / f"bad-{i}.parquet").write_bytes(b"not parquet")
    with pytest.raises(NoDataError, match=r"every shard is unusable.*bad-0.parquet, .*bad-1.parquet"):
        check_shards(list_shards([str(tmp_path)]), "text", "", "skip")


def test_a_validation_set_without_a_window_is_an_error_on_every_rank(tmp_path, long_corpus):
    folder, _ = long_corpus
    tiny = tmp_path / "tiny.parquet"
    pq.write_table(pa.table({"text": ["the stream", None, ""], "source": ["web"] * 3}), tiny)
    cfg = cfg_for(folder, validation_paths=[str(tiny)])
    with pytest.raises(NoDataError, match=r"tiny.parquet yield no complete window of 2 x 17 tokens \(3 rows: 2 doc"):
        list(ValidationLoader(cfg, list_shards(cfg.paths), ENCODE, SEQ, BATCH, 0, 1))
    # two ranks: one with a window, one without: no error here (the validator reports the empty share
    # on every rank at once); two ranks without: both raise
    cfg = cfg_for(folder, validation_paths=[str(tiny), str(folder / "shard-00.parquet")])
    shares = [list(ValidationLoader(cfg, [], ENCODE, SEQ, BATCH, r, 2)) for r in range(2)]
    assert shares[0] and not shares[1]
    other = tmp_path / "zz.parquet"
    pq.write_table(pa.table({"text": ["of"], "source": ["web"]}), other)
    cfg = cfg_for(folder, validation_paths=[str(tiny), str(other)])
    for rank in range(2):
        with pytest.raises(NoDataError, match=r"tiny.parquet, .*zz.parquet yield no complete window"):
            list(ValidationLoader(cfg, [], ENCODE, SEQ, BATCH, rank, 2))


def test_training_on_an_empty_corpus_stops_on_every_rank_naming_it(tmp_path):
    folder = empty_corpus(tmp_path / "nothing")
    mixture = ("--data.mixture", f"docstrings=1:{folder},code=1:{folder}")  # the tiny config's source names
    proc = torchrun(tmp_path / "run", *mixture, "--training.steps", "2", check=False, timeout=120)
    assert proc.returncode != 0
    log = proc.stdout + proc.stderr
    assert "NoDataError" in log and f"{folder / 'empty-0.parquet'}" in log


def test_preview_of_an_empty_corpus_exits_with_an_error_naming_it(tmp_path):
    folder = empty_corpus(tmp_path / "nothing")
    cmd = [sys.executable, "-m", "mhar_titan.preview", "configs/tiny_cpu.toml"]
    cmd += ["--data.mixture", f"docstrings=1:{folder},code=1:{folder}"]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert "NoDataError" in out.stderr and str(folder / "empty-0.parquet") in out.stderr


def string_corpus(folder, kind):
    """Four shards of the same documents, the text and source columns stored as Arrow type `kind`."""
    rng = random.Random(5)
    folder.mkdir()
    for i in range(4):
        texts = [words(rng, rng.randint(1, 40)) for _ in range(9)] + ["", None]
        sources = [rng.choice(["web", "code"]) for _ in texts]
        columns = {}
        for name, values in (("text", texts), ("source", sources)):
            array = pa.array(values)
            if kind == "dictionary":
                array = array.dictionary_encode()
            elif kind == "dictionary_large":
                array = array.cast(pa.large_string()).dictionary_encode()
            elif kind != "string":
                array = array.cast(getattr(pa, kind)())
            columns[name] = array
        pq.write_table(pa.table(columns), folder / f"part-{i}.parquet", row_group_size=4)
    return folder


def test_every_arrow_string_type_reads_the_same(tmp_path):
    plain = loader(cfg_for(string_corpus(tmp_path / "string", "string")), 0)
    want, _ = take(plain, 12)
    for kind in ("large_string", "string_view", "dictionary", "dictionary_large"):
        folder = string_corpus(tmp_path / kind, kind)
        ld = loader(cfg_for(folder), 0)
        got, _ = take(ld, 12)
        assert same(got, want), kind
        assert ld.counters() == plain.counters(), kind


def invalid_utf8_shard(path):
    """Row group 1, row 2 holds bytes that are not UTF-8, in a column typed string (pyarrow does not check)."""
    good = [b"the routing", b"depth of", b"residual stream", b"of the"]
    bad = [b"naive", b"stream", b"bad \xff\xfe bytes", b"depth"]
    groups = []
    for values in (good, bad):
        offsets = struct.pack(f"<{len(values) + 1}i", *[sum(map(len, values[:i])) for i in range(len(values) + 1)])
        buffers = [None, pa.py_buffer(offsets), pa.py_buffer(b"".join(values))]
        groups.append(pa.Array.from_buffers(pa.string(), len(values), buffers))
    with pq.ParquetWriter(path, pa.schema([("text", pa.string())])) as writer:
        for array in groups:
            writer.write_table(pa.table({"text": array}))


def test_invalid_utf8_stops_naming_the_file_and_row_or_is_skipped_and_counted(long_corpus, caplog):
    folder, _ = long_corpus
    invalid_utf8_shard(folder / "shard-99.parquet")
    cfg = DataConfig(paths=[str(folder)], num_streams=1, seed=7)
    with pytest.raises(BadShardError, match=r"shard-99.parquet: row group 1, row 2: column 'text' is not valid UTF-8"):
        take_until(ParquetDataLoader(cfg, list_shards(cfg.paths), ENCODE, SEQ, BATCH, 0, 1), lambda bs: False)
    cfg.on_bad_shard = "skip"
    ld = ParquetDataLoader(cfg, list_shards(cfg.paths), ENCODE, SEQ, BATCH, 0, 1)
    with caplog.at_level(logging.WARNING, logger="data.stream"):
        take_until(ld, lambda bs: ld.counters()["skipped_shards"] >= 1)
    assert any("skipping shard" in r.getMessage() and "shard-99.parquet" in r.getMessage() for r in caplog.records)


def test_a_state_whose_head_document_is_gone_is_refused_naming_it(long_corpus):
    folder, _ = long_corpus
    cfg = cfg_for(folder)
    ld = loader(cfg, 1)
    _, states = states_after_each_batch(ld, 30)
    state = next(st for st in states if json.loads(st["stream_00001"])["sources"]["corpus"]["offset"] > 0)
    head = json.loads(state["stream_00001"])
    head["sources"]["corpus"]["offset"] = 10**6
    resumed = loader(cfg, 1)
    resumed.load_state_dict({**state, "stream_00001": json.dumps(head)})
    with pytest.raises(ValueError, match=r"stream 1: the state's head \(epoch 0, .*shard-0\d.parquet, row group"):
        take(resumed, 2)


def test_the_preview_of_a_config_that_is_not_there_is_one_line_naming_it(capsys):
    with pytest.raises(SystemExit) as e:
        preview_main(["configs/not_there.toml"])
    assert "configs/not_there.toml" in str(e.value) and "\n" not in str(e.value)
