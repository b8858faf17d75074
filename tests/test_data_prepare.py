"""python -m data.prepare: every input kind to shards and back, bad rows counted per reason, byte-identical
reruns, refusals, atomic output, the index and manifest beside the shards, the token estimate."""

import gzip
import itertools
import json
import re

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from test_data import BATCH, ENCODE, SEQ
from test_data_trust import invalid_utf8_shard

from data import prepare, prepare_report
from data.config import DataConfig
from data.index import read_index, shard_infos
from data.loader import ParquetDataLoader
from data.shards import list_shards, read_footer
from data.stream import epoch_streams

LIMIT = ["--max-bad-fraction", "0.5"]  # the fixture's inputs hold many bad rows on purpose


def zstd(data: bytes) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.CompressedOutputStream(sink, "zstd") as out:
        out.write(data)
    return sink.getvalue().to_pybytes()


def arrow_stream(path, table):
    with pa.ipc.new_stream(path, table.schema) as writer:
        writer.write_table(table, max_chunksize=2)


@pytest.fixture
def inputs(tmp_path):
    return make_inputs(tmp_path)


def make_inputs(tmp_path):
    """One input of each kind, bad rows in the JSON lines; returns (paths, the documents they hold in order as
    (text, source), the bad rows of web.jsonl by reason)."""
    root = tmp_path / "in"
    root.mkdir()
    web = [
        b'{"text": "first \\u00e9 line\\nwith a newline", "id": 1}',
        b'{"text": "second\\r\\nwindows"}',
        b"{not json",
        b'{"body": "no text key"}',
        b'{"text": 7}',
        b"",
        b'{"text": ""}',
        b'{"text": "bad \xff bytes"}',
        b'{"text": "lone \\ud800 surrogate"}',
        b'["a", "list"]',
        b'{"text": "\\u65e5\\u672c\\u8a9e \\ud83d\\ude42 last"}',
    ]
    (root / "web.jsonl").write_bytes(b"\n".join(web) + b"\n")
    web_docs = ["first é line\nwith a newline", "second\r\nwindows", "日本語 🙂 last"]
    web_bad = {"invalid JSON": 1, "missing text key": 1, "text not a string": 1, "invalid UTF-8": 2}
    web_bad["not a JSON object"] = 1
    books = [f"book {i} " + "word " * i for i in range(9)]
    with gzip.open(root / "books.jsonl.gz", "wt", encoding="utf-8") as f:
        f.write("".join(json.dumps({"text": t}) + "\n" for t in books))
    code = [f"def f{i}():\n    return {i}" for i in range(6)]
    lines = [json.dumps({"content": "x", "text": t}).encode() for t in code]
    (root / "code.jsonl.zst").write_bytes(zstd(b"\n".join(lines[:3]) + b"\n") + zstd(b"\n".join(lines[3:])))
    (root / "notes.txt").write_bytes("\ufeffA note\n\nin two paragraphs.\n".encode())
    hf = root / "hf"
    hf.mkdir()
    hf_texts = [["hf one", None, "hf two"], ["", "hf three", "hf four"]]
    names = []
    for i, texts in enumerate(hf_texts):
        names.append(f"data-{i:05d}-of-00002.arrow")
        arrow_stream(hf / names[-1], pa.table({"text": texts, "n": list(range(3))}))
    (hf / "state.json").write_text(json.dumps({"_data_files": [{"filename": n} for n in names]}))
    (hf / "dataset_info.json").write_text("{}")
    table_texts = ["parquet a", "parquet b", "parquet c"]
    pq.write_table(pa.table({"text": pa.array(table_texts).dictionary_encode()}), root / "table.parquet")
    paths = [root / "web.jsonl", root / "books.jsonl.gz", root / "code.jsonl.zst", root / "notes.txt", hf]
    paths.append(root / "table.parquet")
    docs = [(t, "web") for t in web_docs] + [(t, "books") for t in books] + [(t, "code") for t in code]
    docs += [("A note\n\nin two paragraphs.\n", "notes")]
    docs += [(t, "hf") for t in ("hf one", "hf two", "hf three", "hf four")] + [(t, "table") for t in table_texts]
    return [str(p) for p in paths], docs, web_bad


def run(out, *args, expect=0):
    assert prepare.main([str(out), *map(str, args)]) == expect


def read_back(out):
    """Every (text, source) of the shards, in manifest order, checking each shard's layout on the way."""
    lines = (out / "manifest.txt").read_text().splitlines()
    shards = [line for line in lines if not line.startswith("#")]
    rows = []
    for path in shards:
        parquet = pq.ParquetFile(path)
        assert parquet.schema_arrow == pa.schema([("text", pa.string()), ("source", pa.string())])
        assert parquet.metadata.row_group(0).column(0).compression == "ZSTD"
        table = parquet.read()
        rows += list(zip(table["text"].to_pylist(), table["source"].to_pylist(), strict=True))
    return shards, rows


def snapshot(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_every_input_kind_round_trips_once_in_order_with_its_source(inputs, tmp_path, capsys):
    paths, docs, _ = inputs
    out = tmp_path / "out"
    run(out, *paths, "--docs-per-shard", 8, "--row-group-docs", 3, *LIMIT)
    shards, rows = read_back(out)
    assert rows == docs
    assert [pq.ParquetFile(s).metadata.num_rows for s in shards] == [8, 8, 8, 2]
    assert all(n <= 3 for s in shards for n in read_footer(s).row_groups)
    assert shards == [str(out.resolve() / f"shard-{i:05d}.parquet") for i in range(4)]
    assert list_shards([], manifest=str(out / "manifest.txt")) == shards
    summary = json.loads((out / "summary.json").read_text())
    assert summary["documents"] == len(docs) and summary["shards"] == 4
    assert summary["text_bytes"] == sum(len(t.encode()) for t, _ in docs)
    assert {s: v["documents"] for s, v in summary["sources"].items()} == {
        "web": 3,
        "books": 9,
        "code": 6,
        "notes": 1,
        "hf": 4,
        "table": 3,
    }
    printed = capsys.readouterr().out
    assert "26 documents" in printed and "4 shards" in printed and "fewer than --min-shards 16" in printed


def test_bad_rows_are_counted_per_file_and_reason_with_their_lines(inputs, tmp_path, capsys):
    paths, docs, web_bad = inputs
    out = tmp_path / "out"
    run(out, *paths, *LIMIT)
    summary = json.loads((out / "summary.json").read_text())
    files = {f["path"].rsplit("/", 1)[-1]: f for f in summary["files"]}
    assert files["web.jsonl"]["bad"] == web_bad
    assert files["web.jsonl"]["empty"] == {"blank line": 1, "empty text": 1}
    assert files["web.jsonl"]["rows"] == 11 and files["web.jsonl"]["documents"] == 3
    assert files["hf"]["bad"] == {"text not a string": 1} and files["hf"]["empty"] == {"empty text": 1}
    assert files["hf"]["first_bad"] == [f"{paths[4]}/data-00000-of-00002.arrow: row 1: text not a string (null)"]
    assert summary["bad_rows"] == 7 and summary["rows_read"] == 26 + 7 + 3
    web = paths[0]
    assert files["web.jsonl"]["first_bad"][:3] == [
        f"{web}:3: invalid JSON (Expecting property name enclosed in double quotes)",
        f"{web}:4: missing text key (keys: body)",
        f"{web}:5: text not a string (int)",
    ]
    assert f"{web}:8: invalid UTF-8 (byte 14)" in files["web.jsonl"]["first_bad"]
    printed = capsys.readouterr().out
    assert f"{web}:9: invalid UTF-8 (a lone surrogate escape)" in printed


def test_too_many_bad_rows_fail_naming_the_worst_file_and_write_nothing(inputs, tmp_path, capsys):
    paths, _, _ = inputs
    out = tmp_path / "out"
    run(out, *paths, expect=1)  # 7 bad of 36 rows > the default 1%
    err = capsys.readouterr().err
    assert "7 of 36 rows read are bad" in err and f"Worst file: {paths[0]}" in err
    assert f"{paths[0]}:3: invalid JSON" in err
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == ["in"]
    wrong_key = tmp_path / "in" / "books.jsonl.gz"
    run(out, wrong_key, "--text-key", "body", "--shards", 2, expect=1)  # the counting pass already fails
    assert "9 of 9 rows read are bad" in capsys.readouterr().err and not out.exists()
    run(out, paths[-1], "--text-key", "body", expect=1)  # a table without the column: every row counted
    err = capsys.readouterr().err
    assert "3 of 3 rows read are bad" in err and "rows 0-2: missing text key (no column 'body'; columns: text)" in err


def test_a_rerun_is_byte_identical(inputs, tmp_path):
    paths, _, _ = inputs
    out = tmp_path / "out"
    run(out, *paths, "--docs-per-shard", 5, "--tokenizer", "assets/tiny", *LIMIT)
    first = snapshot(out)
    run(out, *paths, "--docs-per-shard", 5, "--tokenizer", "assets/tiny", "--overwrite", *LIMIT)
    assert snapshot(out) == first
    elsewhere = tmp_path / "elsewhere"
    run(elsewhere, *paths, "--docs-per-shard", 5, "--tokenizer", "assets/tiny", *LIMIT)
    again = snapshot(elsewhere)
    assert {k: v for k, v in again.items() if k != "manifest.txt"} == {
        k: v for k, v in first.items() if k != "manifest.txt"
    }


def test_a_non_empty_out_dir_is_refused_and_only_an_earlier_output_is_replaced(inputs, tmp_path, capsys):
    paths, _, _ = inputs
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.md").write_text("mine")
    run(out, *paths, *LIMIT, expect=1)
    assert "not empty (1 entries, e.g. notes.md); pass --overwrite" in capsys.readouterr().err
    run(out, *paths, *LIMIT, "--overwrite", expect=1)
    assert "holds files data.prepare does not write (notes.md)" in capsys.readouterr().err
    assert snapshot(out) == {"notes.md": b"mine"}
    (out / "notes.md").unlink()
    run(out, *paths, *LIMIT)  # an empty folder is fine
    run(tmp_path / "in" / "shards", tmp_path / "in", *LIMIT, expect=1)
    assert "inside the input folder" in capsys.readouterr().err


def test_an_interrupted_run_leaves_no_partial_output(inputs, tmp_path, monkeypatch):
    paths, _, _ = inputs
    out = tmp_path / "out"
    run(out, *paths, *LIMIT)
    earlier = snapshot(out)

    def fail(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(prepare, "write_index", fail)  # after every shard is written
    with pytest.raises(KeyboardInterrupt):
        prepare.main([str(out), *paths, *LIMIT, "--docs-per-shard", "3", "--overwrite"])
    assert snapshot(out) == earlier  # the earlier output, untouched
    with pytest.raises(KeyboardInterrupt):
        prepare.main([str(tmp_path / "new"), *paths, *LIMIT])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in", "out"]  # no half output, no partial folder


def test_the_index_beside_the_shards_matches_their_footers(inputs, tmp_path):
    paths, _, _ = inputs
    out = tmp_path / "out"
    run(out, *paths, "--docs-per-shard", 6, "--row-group-docs", 4, *LIMIT)
    index = read_index(str(out / "_index.json"))
    shards = list_shards([str(out)])
    assert [e["path"] for e in index["shards"]] == [s.rsplit("/", 1)[1] for s in shards]
    for entry, shard in zip(index["shards"], shards, strict=True):
        footer = read_footer(shard)
        assert entry["row_groups"] == list(footer.row_groups) and entry["bytes"] == (out / entry["path"]).stat().st_size
        assert entry["columns"] == [["text", "string"], ["source", "string"]]
    assert shard_infos(shards, "text", "source") == shard_infos(shards, "text", "source", index=None)


def test_shards_k_splits_evenly_and_text_modes_split_documents(tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_bytes(b"one\n\n  \ntwo a\ntwo b\r\n\nthree \xff\n\nfour\n")
    run(tmp_path / "lines", text, "--text-mode", "lines", *LIMIT)
    _, rows = read_back(tmp_path / "lines")
    assert [t for t, _ in rows] == ["one", "two a", "two b", "four"]
    summary = json.loads((tmp_path / "lines" / "summary.json").read_text())
    assert summary["files"][0]["first_bad"] == [f"{text}:7: invalid UTF-8 (byte 6)"]
    assert summary["empty_by_reason"] == {"blank line": 4}
    run(tmp_path / "blocks", text, "--text-mode", "blank-lines", "--shards", 2, *LIMIT)
    shards, rows = read_back(tmp_path / "blocks")
    assert [t for t, _ in rows] == ["one", "two a\ntwo b", "four"] and len(shards) == 2
    assert json.loads((tmp_path / "blocks" / "summary.json").read_text())["documents_per_shard"] == {"min": 1, "max": 2}
    run(tmp_path / "too_many", text, "--text-mode", "lines", "--shards", 5, *LIMIT, expect=1)
    assert "--shards 5: only 4 documents" in capsys.readouterr().err


def test_the_token_count_is_exact_for_a_small_corpus_and_an_estimate_from_a_sample(inputs, tmp_path, monkeypatch):
    paths, docs, _ = inputs
    exact = sum(len(ENCODE([t])[0]) + 1 for t, _ in docs)
    run(tmp_path / "a", *paths, "--tokenizer", "assets/tiny", *LIMIT)
    tokens = json.loads((tmp_path / "a" / "summary.json").read_text())["estimated_tokens"]
    assert tokens["total"] == exact and tokens["method"].startswith("exact")
    monkeypatch.setattr(prepare_report, "SAMPLE_BYTES", 60)
    run(tmp_path / "b", *paths, "--tokenizer", "assets/tiny/tokenizer.json", *LIMIT)
    tokens = json.loads((tmp_path / "b" / "summary.json").read_text())["estimated_tokens"]
    assert tokens["method"].startswith("estimate") and tokens["sampled_documents"] < len(docs)
    assert abs(tokens["total"] - exact) < 0.3 * exact


def test_a_saved_hf_dataset_and_bad_inputs(tmp_path, capsys):
    texts = [f"saved document {i}" for i in range(7)]
    folder = tmp_path / "saved"
    datasets.Dataset.from_dict({"text": texts, "label": list(range(7))}).save_to_disk(str(folder), num_shards=2)
    run(tmp_path / "out", folder)
    assert read_back(tmp_path / "out")[1] == [(t, "saved") for t in texts]
    splits = tmp_path / "splits"
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": texts})}).save_to_disk(str(splits))
    run(tmp_path / "out2", splits, expect=1)
    message = r"a DatasetDict of splits \(train\); name the split folder to convert, e.g. .*splits/train"
    assert re.search(message, capsys.readouterr().err)
    ipc_file = tmp_path / "file.arrow"  # the IPC file format, not the stream datasets writes
    with pa.ipc.new_file(ipc_file, pa.schema([("text", pa.large_string())])) as writer:
        writer.write_table(pa.table({"text": pa.array(texts[:3], pa.large_string())}), max_chunksize=2)
    invalid_utf8_shard(tmp_path / "unchecked.parquet")  # a string column whose bytes were never validated
    run(tmp_path / "out5", ipc_file, tmp_path / "unchecked.parquet", "--max-bad-fraction", "0.2")
    assert [t for t, _ in read_back(tmp_path / "out5")[1]][:4] == texts[:3] + ["the routing"]
    summary = json.loads((tmp_path / "out5" / "summary.json").read_text())
    assert summary["files"][1]["first_bad"] == [f"{tmp_path / 'unchecked.parquet'}: row 6: invalid UTF-8 (byte 4)"]
    (tmp_path / "data.csv").write_text("a,b\n")
    run(tmp_path / "out3", tmp_path / "data.csv", expect=1)
    assert "data.csv: not an input of a known kind" in capsys.readouterr().err
    run(tmp_path / "out4", folder, folder, expect=1)
    assert "named twice" in capsys.readouterr().err


def test_help_describes_every_argument():
    actions = [a for a in prepare.parser()._actions if a.dest != "help"]
    assert all(a.help for a in actions) and len(actions) == 12
    assert "num_streams" in prepare.parser().format_help()


def test_the_loader_reads_the_prepared_shards(inputs, tmp_path):
    paths, docs, _ = inputs
    out = tmp_path / "out"
    run(out, *paths, "--docs-per-shard", 8, *LIMIT)
    cfg = DataConfig(paths=[str(out)], num_streams=2, source_column="source")
    loader = ParquetDataLoader(cfg, list_shards(cfg.paths), ENCODE, SEQ, BATCH, 0, 1)
    it = iter(loader)
    delivered: dict[int, list[int]] = {s: [] for s in loader.local}
    for k in itertools.count():
        inputs, labels = next(it)
        stream = loader.local[k % len(loader.local)]
        delivered[stream] += [t for row in torch.cat([inputs["input"], labels[:, -1:]], dim=1).tolist() for t in row]
        if min(st["sources"]["corpus"]["epoch"] for st in loader.states.values()) >= 1:
            break
    counters = loader.counters()
    assert counters["skipped_docs"] == 0
    # Every document exactly once in the first epoch: each stream's first documents (as many as its
    # epoch-0 shards hold) are, together, the inputs' non-empty documents, each once.
    epoch0 = epoch_streams(list_shards(cfg.paths), cfg.seed, 0, cfg.num_streams)
    got = []
    for stream, tokens in delivered.items():
        count = sum(pq.read_metadata(path).num_rows for path in epoch0[stream])
        pieces, current = [], []
        for t in tokens:
            if t == ENCODE.eos_id:
                pieces.append(tuple(current))
                current = []
            else:
                current.append(t)
        got += pieces[:count]
    want = [tuple(ids) for ids in ENCODE([text for text, _ in docs if text])]
    assert sorted(got) == sorted(want)
    assert {k.removeprefix("tokens/") for k in counters if k.startswith("tokens/")} == {s for _, s in docs}
