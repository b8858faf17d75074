"""The sharded-parquet pipeline: order, packing, exact resume (workers, rank changes), bad input."""

import hashlib
import json
import pickle
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from conftest import REPO
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.components.tokenizer import HuggingFaceTokenizer

from data import loader as data_loader
from data.config import DataConfig
from data.loader import Encoder, ParquetDataLoader, ValidationLoader
from data.shards import BadShardError, held_out, list_shards, read_row_group, shard_info
from data.stream import _permutation, epoch_streams, shard_keys
from mhar_titan.preview import main as preview_main

SEQ, BATCH = 16, 2
ENCODE = Encoder(HuggingFaceTokenizer(str(REPO / "assets" / "tiny")))
WORDS = ["routing", "depth", "Zürich", "naïve", "日本語", "emoji🙂", "the", "of", "residual", "stream", "λ"]


def random_doc(rng, long=False):
    n = rng.randint(80, 150) if long else rng.randint(1, 30)  # long: several windows of SEQ tokens
    return " ".join(rng.choice(WORDS) for _ in range(n))


@pytest.fixture
def corpus(tmp_path):
    """Six shards of two or three row groups: short, long (several windows), unicode, empty and null documents."""
    rng = random.Random()
    folder = tmp_path / "shards"
    folder.mkdir()
    docs = {}
    for i in range(6):
        texts = [random_doc(rng, long=rng.random() < 0.1) for _ in range(rng.randint(8, 14))]
        texts[rng.randrange(len(texts))] = ""
        texts[rng.randrange(len(texts))] = None
        sources = [rng.choice(["web", "code"]) for _ in texts]
        path = folder / f"shard-{i:02d}.parquet"
        pq.write_table(
            pa.table({"text": texts, "source": sources, "score": list(range(len(texts)))}), path, row_group_size=5
        )
        docs[str(path)] = list(zip(texts, sources, strict=True))
    return folder, docs


def cfg_for(folder, **kw):
    return DataConfig(paths=[str(folder / "*.parquet")], source_column="source", num_streams=4, seed=7, **kw)


def loader(cfg, rank=0, world=2, workers=0):
    return ParquetDataLoader(cfg, list_shards(cfg.paths), ENCODE, SEQ, BATCH, rank, world, workers)


def take(ld, n, it=None):
    it = it or iter(ld)
    return [next(it) for _ in range(n)], it


def take_until(ld, done, cap=3000):
    """Batches until done(batches) holds (at most cap)."""
    batches, it = [], iter(ld)
    while not done(batches):
        assert len(batches) < cap, "condition never met"
        batches += [next(it) for _ in range(20)]
    return batches


def stream_docs(cfg, docs, stream, epoch=0):
    """The documents of one logical stream in one epoch, by the documented order."""
    out = []
    for path in epoch_streams(sorted(docs), cfg.seed, epoch, cfg.num_streams)[stream]:
        sizes = shard_info(path, "text").row_groups
        name = Path(path).name  # the key: the path below the corpus folder
        for rg in _permutation(len(sizes), f"rg:{cfg.seed}:{epoch}:{name}"):
            texts, _ = read_row_group(path, rg, "text")
            for row in _permutation(len(texts), f"row:{cfg.seed}:{epoch}:{name}:{rg}"):
                if texts[row] and not held_out(texts[row], cfg.validation_fraction):
                    out.append(texts[row])
    return out


def flat(batches):
    """A stream's token sequence from its windows: every input row plus its last label."""
    tokens = []
    for b, labels in batches:
        for row, lab in zip(b["input"], labels, strict=True):
            assert torch.equal(row[1:], lab[:-1])
            tokens += row.tolist() + [lab[-1].item()]
    return tokens


def by_stream(ld, batches, start=0):
    """Split a rank's batches by the stream each came from (batch k from local stream k mod n)."""
    out = {s: [] for s in ld.local}
    for k, batch in enumerate(batches, start):
        out[ld.local[k % len(ld.local)]].append(batch)
    return out


def test_windows_are_the_documents_joined_by_eos_in_order(corpus):
    folder, docs = corpus
    cfg = cfg_for(folder)
    seen = {}
    for rank in range(2):
        ld = loader(cfg, rank)
        want = {}
        for s in ld.local:
            want[s] = [t for text in stream_docs(cfg, docs, s) for t in ENCODE([text])[0] + [ENCODE.eos_id]]
        batches = take_until(
            ld, lambda bs, ld=ld, want=want: all(len(flat(b)) >= len(want[s]) for s, b in by_stream(ld, bs).items())
        )
        for s, sb in by_stream(ld, batches).items():
            assert flat(sb)[: len(want[s])] == want[s], f"stream {s}"
            seen[s] = stream_docs(cfg, docs, s)
    all_docs = [t for v in docs.values() for t, _ in v if t]
    assert sorted(d for v in seen.values() for d in v) == sorted(all_docs)  # every document once, on one rank


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_at_random_cut_points_is_exact(corpus, workers):
    folder, _ = corpus
    cfg = cfg_for(folder)
    want, _ = take(loader(cfg, 1, workers=workers), 24)
    cut = random.randint(1, 23)
    first = loader(cfg, 1, workers=workers)
    head, _ = take(first, cut)
    state = json.loads(json.dumps(first.state_dict()))
    second = loader(cfg, 1, workers=workers)
    second.load_state_dict(state)
    tail, _ = take(second, 24 - cut)
    for k, ((a, la), (b, lb)) in enumerate(zip(want, head + tail, strict=True)):
        assert torch.equal(a["input"], b["input"]) and torch.equal(la, lb), f"batch {k} (cut {cut})"


@pytest.mark.parametrize("settings", [{}, {"prefetch_factor": 4, "persistent_workers": True}])
def test_state_and_stream_do_not_depend_on_loader_workers(corpus, settings, monkeypatch):
    """Nor on torchtitan's other [training.dataloader] settings, which reach torch's DataLoader."""
    folder, _ = corpus
    cfg = cfg_for(folder)
    plain = loader(cfg, 0)
    with_workers = ParquetDataLoader(cfg, list_shards(cfg.paths), ENCODE, SEQ, BATCH, 0, 2, 2, workers=settings)
    a, _ = take(plain, 9)
    given, torch_loader = {}, data_loader.DataLoader
    monkeypatch.setattr(data_loader, "DataLoader", lambda *a, **kw: given.update(kw) or torch_loader(*a, **kw))
    b, _ = take(with_workers, 9)
    assert given["prefetch_factor"] == settings.get("prefetch_factor", 2) and given["num_workers"] == 2
    assert given["persistent_workers"] == settings.get("persistent_workers", False)
    assert all(torch.equal(x[0]["input"], y[0]["input"]) for x, y in zip(a, b, strict=True))
    assert plain.state_dict() == with_workers.state_dict()


@pytest.mark.parametrize("settings", [{"prefetch_factor": 4}, {"persistent_workers": True}])
def test_worker_settings_without_workers_are_refused_by_name(corpus, settings):
    with pytest.raises(ValueError, match=r"^\[training.dataloader\] prefetch_factor and persistent_workers act on"):
        ParquetDataLoader(
            cfg_for(corpus[0]), list_shards(cfg_for(corpus[0]).paths), ENCODE, SEQ, BATCH, 0, 2, workers=settings
        )


def test_resume_on_four_ranks_after_two_keeps_every_streams_order(corpus):
    folder, _ = corpus
    cfg = cfg_for(folder)
    reference = loader(cfg, 0, world=1)  # all four streams on one rank
    ref_batches, _ = take(reference, 48)
    ref = {s: flat(b) for s, b in by_stream(reference, ref_batches).items()}

    got = {s: [] for s in range(4)}
    state = {}
    for rank in range(2):
        ld = loader(cfg, rank, world=2)
        batches, _ = take(ld, 5)
        for s, b in by_stream(ld, batches).items():
            got[s] += b
        state.update(ld.state_dict())  # what DCP gathers from both ranks
    for rank in range(4):
        ld = loader(cfg, rank, world=4)
        ld.load_state_dict(state)
        batches, _ = take(ld, 6)
        got[rank] += batches
    for s in range(4):
        tokens = flat(got[s])
        assert tokens == ref[s][: len(tokens)], f"stream {s}"


def test_same_seed_same_stream_in_another_process(corpus):
    folder, _ = corpus
    cfg = cfg_for(folder)
    batches, _ = take(loader(cfg, 0), 6)
    digest = hashlib.sha256(b"".join(b["input"].numpy().tobytes() for b, _ in batches)).hexdigest()
    code = (
        "import hashlib, sys; sys.path.insert(0, 'tests')\n"
        "from test_data import cfg_for, loader, take\nfrom pathlib import Path\n"
        f"batches, _ = take(loader(cfg_for(Path({str(folder)!r})), 0), 6)\n"
        "print(hashlib.sha256(b''.join(b['input'].numpy().tobytes() for b, _ in batches)).hexdigest())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == digest
    other, _ = take(loader(cfg_for(folder, validation_fraction=0.0).__class__(**{**cfg.__dict__, "seed": 8}), 0), 6)
    assert any(not torch.equal(a[0]["input"], b[0]["input"]) for a, b in zip(batches, other, strict=True))


def test_the_same_corpus_elsewhere_is_read_in_the_same_order(corpus, tmp_path):
    folder, _ = corpus
    moved = tmp_path / "another" / "mount" / "corpus"
    shutil.copytree(folder, moved)
    here, _ = take(loader(cfg_for(folder), 1), 8)
    there, _ = take(loader(cfg_for(moved), 1), 8)
    for a, b in zip(here, there, strict=True):
        assert torch.equal(a[0]["input"], b[0]["input"]) and torch.equal(a[1], b[1])
    keys = shard_keys(["/data/x/a/p.parquet", "/data/x/b/p.parquet", "/data/x/b/q.parquet"])
    assert list(keys.values()) == ["a/p.parquet", "b/p.parquet", "b/q.parquet"]
    assert shard_keys(["s3://bucket/c/one.parquet"]) == {"s3://bucket/c/one.parquet": "one.parquet"}


def test_counters_count_documents_sources_and_skips(corpus):
    folder, docs = corpus
    cfg = cfg_for(folder)
    ld = loader(cfg, 0, world=1)
    # one epoch everywhere
    batches = take_until(ld, lambda bs: all(st["sources"]["corpus"]["epoch"] >= 1 for st in ld.states.values()))
    counters = ld.counters()
    per_epoch_empty = sum(1 for v in docs.values() for t, _ in v if not t)
    assert counters["skipped_docs"] >= per_epoch_empty
    # source tokens count as they are delivered: exactly the tokens of the windows so far
    assert counters["tokens/web"] + counters["tokens/code"] == sum(b["input"].numel() + BATCH for b, _ in batches)
    assert counters["truncated_docs"] == counters["truncated_tokens"] == 0


def test_bad_shards_fail_naming_the_file_or_are_skipped_and_counted(corpus):
    folder, _ = corpus
    bad = folder / "shard-99.parquet"
    bad.write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(BadShardError, match="shard-99.parquet: unreadable"):
        take_until(loader(cfg_for(folder), 0, world=1), lambda bs: False)
    ld = loader(cfg_for(folder, on_bad_shard="skip"), 0, world=1)
    take_until(ld, lambda bs: ld.counters()["skipped_shards"] >= 1)

    bad.unlink()
    pq.write_table(pa.table({"body": ["x"] * 3}), bad)
    with pytest.raises(BadShardError, match=r"shard-99.parquet: no column 'text'"):
        take_until(loader(cfg_for(folder), 0, world=1), lambda bs: False)
    bad.unlink()
    pq.write_table(pa.table({"text": [1, 2, 3], "source": ["a", "b", "c"]}), bad)
    with pytest.raises(BadShardError, match=r"shard-99.parquet: column 'text' holds int64"):
        take_until(loader(cfg_for(folder), 0, world=1), lambda bs: False)


def test_start_up_check_finds_bad_shards_before_any_batch(corpus):
    from data.shards import check_shards

    folder, docs = corpus
    (folder / "shard-99.parquet").write_bytes(b"not parquet")
    shards = list_shards([str(folder)])
    with pytest.raises(BadShardError, match="shard-99.parquet: unreadable"):
        check_shards(shards, "text", "source", "error")
    assert check_shards(shards, "text", "source", "skip") == sorted(docs)


def test_validation_set_is_fixed_finite_and_held_out(corpus):
    folder, docs = corpus
    cfg = cfg_for(folder, validation_fraction=0.3)
    val = ValidationLoader(cfg, list_shards(cfg.paths), ENCODE, SEQ, BATCH, 0, 1)
    first, second = list(val), list(val)
    assert first and len(first) == len(second)
    assert all(torch.equal(a[0]["input"], b[0]["input"]) for a, b in zip(first, second, strict=True))
    held = [t for v in docs.values() for t, _ in v if t and held_out(t, 0.3)]
    train_docs = [d for s in range(4) for d in stream_docs(cfg, docs, s)]
    assert held and not set(held) & set(train_docs)


def test_document_starts_can_be_left_out_of_the_loss(corpus):
    """`loss_on_document_start = false`: the same windows; the label after each eos, and only it, is ignored."""
    folder, _ = corpus
    # batches until one holds an eos (the random corpus may open with a document longer than a batch)
    a = take_until(loader(cfg_for(folder)), lambda bs: any((x["input"] == ENCODE.eos_id).any() for x, _ in bs))
    b, _ = take(loader(cfg_for(folder, loss_on_document_start=False)), len(a))
    for (inputs, labels), (inputs_b, labels_b) in zip(a, b, strict=True):
        at_eos = inputs["input"] == ENCODE.eos_id
        assert torch.equal(inputs["input"], inputs_b["input"])
        assert torch.equal(labels_b, labels.masked_fill(at_eos, IGNORE_INDEX)) and (labels_b[~at_eos] >= 0).all()
    cfg = cfg_for(folder, validation_fraction=0.3, loss_on_document_start=False)
    val = list(ValidationLoader(cfg, list_shards(cfg.paths), ENCODE, SEQ, BATCH, 0, 1))
    assert val and all(torch.equal(labels == IGNORE_INDEX, inputs["input"] == ENCODE.eos_id) for inputs, labels in val)


def test_loader_settings_are_checked():
    with pytest.raises(ValueError, match="on_bad_shard"):
        DataConfig(on_bad_shard="ignore").validate()
    with pytest.raises(ValueError, match="multiple of the 3 DP ranks"):
        ParquetDataLoader(DataConfig(num_streams=4), ["x"], ENCODE, SEQ, BATCH, 0, 3)


def test_preview_prints_windows_and_source_statistics(monkeypatch, capsys):
    """`python -m mhar_titan.preview`'s main in this process (tests/test_data_trust.py runs the command)."""
    monkeypatch.chdir(REPO)
    preview_main(["configs/tiny_cpu.toml", "--training.seq_len", "32", "--n", "3", "--batches", "100", "--json"])
    record = json.loads(capsys.readouterr().out)
    assert [w["window"] for w in record["windows"]] == [0, 1, 2] and all(len(w["ids"]) == 33 for w in record["windows"])
    shares = record["source_shares"]
    assert set(shares) == {"docstrings", "code"} and abs(shares["docstrings"] - 0.7) < 0.02, shares
    assert record["batches"] == 100 and record["counters"]["mixture/code/tokens"] > 0
    preview_main(["configs/tiny_cpu.toml", "--n", "8"])
    text = capsys.readouterr().out
    assert "--- window 1" in text and "end of document" in text and "source docstrings:" in text
    assert "% of tokens (weight 70.0%)" in text


def test_a_path_that_is_not_there_matches_no_shard(corpus, tmp_path):
    folder, _ = corpus
    for absent in (tmp_path / "absent", tmp_path / "absent.parquet"):
        with pytest.raises(FileNotFoundError, match=f"'{absent}' matches no parquet file"):
            list_shards([str(folder), str(absent)])
    assert list_shards([str(folder)]) == list_shards([str(folder / "*.parquet")])


@pytest.mark.parametrize("workers", [0, 2])
def test_a_special_tokens_text_inside_a_document_is_text_not_a_boundary(tmp_path, workers):
    """A page that quotes `<|end_of_text|>` (or `<|begin_of_text|>`) must not end its document there: only the stream
    puts the end-of-text id between documents, also in loader workers (the encoder pickled)."""
    quoted = "the model stops at <|end_of_text|> and starts at <|begin_of_text|>, the docs say"
    original = HuggingFaceTokenizer(str(REPO / "assets" / "tiny")).tokenizer
    specials = {original.token_to_id("<|end_of_text|>"), original.token_to_id("<|begin_of_text|>")}
    assert specials & set(original.encode(quoted, add_special_tokens=False).ids)  # the plain tokenizer fakes both
    ids = ENCODE([quoted])[0]
    assert not specials & set(ids) and original.decode(ids, skip_special_tokens=False) == quoted
    assert pickle.loads(pickle.dumps(ENCODE))([quoted]) == [ids]
    assert specials & set(original.encode(quoted, add_special_tokens=False).ids)  # the tokenizer itself unchanged
    folder = tmp_path / "shards"
    folder.mkdir()
    texts = [quoted, "a plain page", quoted + " twice"] * 4
    for i in range(2):  # a stream each, a loader worker each
        pq.write_table(pa.table({"text": texts, "source": ["web"] * len(texts)}), folder / f"shard-{i:02d}.parquet")
    cfg = DataConfig(paths=[str(folder / "*.parquet")], source_column="source", num_streams=2, seed=7)
    ld = loader(cfg, rank=0, world=1, workers=workers)
    batches, _ = take(ld, 4)
    tokens = flat(batches)
    documents = tokens.count(ENCODE.eos_id)
    assert documents >= 3 and not (specials - {ENCODE.eos_id}) & set(tokens)
    # every end-of-text id in the stream ends a whole document: what follows each is the start of one of the texts
    starts = {tuple(ENCODE([t])[0][:3]) for t in texts}
    cut = [i for i, t in enumerate(tokens) if t == ENCODE.eos_id and i + 3 < len(tokens)]
    assert cut and all(tuple(tokens[i + 1 : i + 4]) in starts for i in cut)
