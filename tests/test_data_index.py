"""The shard index (data.index): the footers' ShardInfo from one file, stale entries re-read from the footers,
bad shards and malformed indexes named, rank 0's answer (or its error) on every rank, the start-up benchmark."""

import json
import logging
import os
import re
import subprocess
import sys
import textwrap
import threading

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import REPO

from benchmarks.bench_startup import ThreadChannel, _Shared
from data import index as index_module
from data.index import (
    INDEX_NAME,
    BadIndexError,
    main,
    read_footers,
    read_index,
    shard_infos,
    share_from_rank0,
    startup_shards,
    write_index,
)
from data.shards import BadShardError, NoDataError, is_text_type, is_text_type_name, list_shards, shard_info


def write_shard(path, rows, row_group_size=3, **extra):
    columns = {"text": [f"doc {i}" for i in range(rows)], "source": ["web"] * rows}
    pq.write_table(pa.table({**columns, **extra}), path, row_group_size=row_group_size)


@pytest.fixture
def corpus(tmp_path):
    folder = tmp_path / "corpus"
    folder.mkdir()
    for i in range(6):
        write_shard(folder / f"shard-{i:02d}.parquet", 4 + 3 * i, row_group_size=2 + i)
    return folder


def footers_unread(monkeypatch):
    """Make any footer read fail: what is answered then came from the index."""

    def refuse(paths, threads=0):
        if paths:
            raise AssertionError(f"footers read: {paths}")
        return []

    monkeypatch.setattr(index_module, "read_footers", refuse)


def test_the_index_gives_the_footers_shard_infos(corpus, monkeypatch):
    shards = list_shards([str(corpus)])
    written = write_index(shards, str(corpus / INDEX_NAME))
    assert written == read_index(str(corpus / INDEX_NAME))
    assert [e["path"] for e in written["shards"]] == [f"shard-{i:02d}.parquet" for i in range(6)]
    assert [e["bytes"] for e in written["shards"]] == [os.path.getsize(s) for s in shards]
    assert written["shards"][0]["columns"] == [["text", "string"], ["source", "string"]]
    from_footers = shard_infos(shards, "text", "source", index=None)
    assert from_footers == {s: shard_info(s, "text", "source") for s in shards}
    footers_unread(monkeypatch)
    assert shard_infos(shards, "text", "source") == from_footers
    assert list(shard_infos(shards[::-1], "text")) == shards[::-1]  # the order given
    assert startup_shards([str(corpus)], "", "text", "source", "error") == from_footers  # one process: no group


def test_text_types_by_name_agree_with_arrow_types():
    kinds = [pa.string(), pa.large_string(), pa.string_view(), pa.null(), pa.binary(), pa.large_binary(), pa.int64()]
    kinds += [pa.dictionary(pa.int32(), pa.string()), pa.dictionary(pa.int8(), pa.large_string(), ordered=True)]
    kinds += [pa.dictionary(pa.int32(), pa.int64()), pa.list_(pa.string()), pa.struct([("text", pa.string())])]
    kinds += [pa.map_(pa.string(), pa.string())]
    assert [is_text_type_name(str(k)) for k in kinds] == [is_text_type(k) for k in kinds]
    assert sum(map(is_text_type, kinds)) == 6


def test_stale_entries_are_read_from_their_footers_with_a_warning(corpus, caplog):
    shards = list_shards([str(corpus)])
    write_index(shards, str(corpus / INDEX_NAME))
    old = os.path.getsize(shards[1])
    write_shard(shards[1], 30, row_group_size=7)  # rewritten: another size and other row groups
    write_shard(corpus / "shard-99.parquet", 5)  # added after the index
    os.remove(shards[4])  # removed: its entry is not asked for
    shards = list_shards([str(corpus)])
    with caplog.at_level(logging.INFO, logger="data.index"):
        infos = shard_infos(shards, "text", "source")
    assert infos == {s: shard_info(s, "text", "source") for s in shards}
    assert infos[shards[1]].row_groups == (7, 7, 7, 7, 2)
    messages = [r.getMessage() for r in caplog.records]
    size = os.path.getsize(shards[1])
    assert any(f"{shards[1]}: {size} bytes, {old} bytes in {corpus / INDEX_NAME}" in m for m in messages)
    assert any("1 shards differ from the shard index" in m for m in messages)
    assert any("1 of 6 shards not in a shard index: reading their footers" in m for m in messages)


def test_a_shard_its_index_lists_that_is_gone_stops_the_run_by_name_or_is_skipped_and_counted(corpus, caplog):
    """Deleted after the index was written: never a run quietly short of it (7 of 8 shards)."""
    write_index(list_shards([str(corpus)]), str(corpus / INDEX_NAME))
    gone = corpus / "shard-02.parquet"
    gone.unlink()
    said = rf"{re.escape(str(gone))}: listed in {re.escape(str(corpus / INDEX_NAME))} but not in its folder"
    for paths in ([str(corpus)], [str(corpus / "shard-0*.parquet")]):  # the folder, a glob that selects it
        with pytest.raises(BadShardError, match=said):
            startup_shards(paths, "", "text", "source", "error")
    with caplog.at_level(logging.WARNING, logger="data.shards"):
        kept = startup_shards([str(corpus)], "", "text", "source", "skip")
    assert len(kept) == 5 and str(gone) not in kept
    assert "skipping shard: " + str(gone) in caplog.text and "skipped 1 of 6 shards at start-up" in caplog.text
    # what the paths do not select is not asked for: a glob past it, the shards named one by one, a manifest's
    assert len(startup_shards([str(corpus / "shard-0[3-5].parquet")], "", "text", "source", "error")) == 3
    assert len(startup_shards([str(corpus / "shard-00.parquet")], "", "text", "source", "error")) == 1


def test_bad_shards_in_the_index_stop_the_run_or_are_skipped(corpus, caplog):
    (corpus / "shard-50.parquet").write_bytes(b"PAR1 not parquet")
    pq.write_table(pa.table({"text": ["a", "b"], "body": ["x", "y"]}), corpus / "shard-60.parquet")
    pq.write_table(pa.table({"text": [1, 2], "source": ["a", "b"]}), corpus / "shard-70.parquet")
    shards = list_shards([str(corpus)])
    written = write_index(shards, str(corpus / INDEX_NAME))
    assert written["shards"][6]["error"].startswith("unreadable parquet (")
    bad = str(corpus / "shard-50.parquet")
    with pytest.raises(BadShardError, match=rf"{re.escape(bad)}: unreadable parquet .*\(recorded in .*_index.json\)"):
        shard_infos(shards, "text", "source")
    for name in ("shard-60.parquet", "shard-70.parquet"):  # column problems: the footer's very message
        one = [str(corpus / name)]
        with pytest.raises(BadShardError) as from_index:
            shard_infos(one, "text", "source")
        with pytest.raises(BadShardError) as from_footer:
            shard_info(one[0], "text", "source")
        assert str(from_index.value) == str(from_footer.value)
    assert "holds int64, not strings" in str(from_index.value)
    with caplog.at_level(logging.WARNING, logger="data.shards"):
        kept = shard_infos(shards, "text", "source", on_bad_shard="skip")
    assert list(kept) == shards[:6]
    assert (
        "skipped 3 of 9 shards at start-up" in caplog.text and "no column 'source' (columns: text, body)" in caplog.text
    )
    assert list(shard_infos(shards[6:8], "text", on_bad_shard="skip")) == [str(corpus / "shard-60.parquet")]
    with pytest.raises(NoDataError, match="every shard is unusable"):
        shard_infos([bad], "text", on_bad_shard="skip")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda t: t[:-5], "not a readable shard index"),
        (lambda t: t.replace('"version": 1', '"version": 2'), r"version 2; this mhar-titan reads version 1"),
        (lambda t: t.replace('"bytes": ', '"bytes": -', 1), r"shards\[0\].bytes: -\d+ is not a non-negative"),
        (lambda t: t.replace('"shard-00.parquet"', '"../shard-00.parquet"'), r"shards\[0\].path: '../shard-00"),
        (lambda t: t.replace('"shard-01.parquet"', '"shard-00.parquet"'), r"shards\[1\].path: .* listed twice"),
        (lambda t: t.replace('"row_groups": [2, 2]', '"row_groups": [2, "2"]'), r"shards\[0\].row_groups"),
        (lambda t: t.replace('["text", "string"]', '["text"]', 1), r"shards\[0\].columns"),
    ],
)
def test_a_malformed_index_is_an_error_naming_the_key(corpus, change, message):
    shards = list_shards([str(corpus)])
    path = corpus / INDEX_NAME
    write_index(shards, str(path))
    path.write_text(change(path.read_text()))
    with pytest.raises(BadIndexError, match=message):
        shard_infos(shards, "text", "source")


def test_the_command_indexes_each_folder_or_one_named_index(tmp_path, monkeypatch, capsys):
    for sub, n in (("a", 2), ("b", 3)):
        (tmp_path / sub).mkdir()
        for i in range(n):
            write_shard(tmp_path / sub / f"part-{i}.parquet", 5 + i)
    pattern = str(tmp_path / "*" / "*.parquet")
    main([pattern])
    assert "a/_index.json: 2 shards, 4 row groups" in capsys.readouterr().out
    assert [len(read_index(str(tmp_path / s / INDEX_NAME))["shards"]) for s in "ab"] == [2, 3]
    main([pattern, "--out", str(tmp_path / "all.json")])
    shards = list_shards([pattern])
    assert [e["path"] for e in read_index(str(tmp_path / "all.json"))["shards"]][:2] == [
        "a/part-0.parquet",
        "a/part-1.parquet",
    ]
    want = shard_infos(shards, "text", "source", index=None)
    footers_unread(monkeypatch)
    assert shard_infos(shards, "text", "source", index=str(tmp_path / "all.json")) == want
    with pytest.raises(ValueError, match="not below the index's folder"):
        write_index(shards, str(tmp_path / "a" / "x.json"))


def test_footer_reads_log_their_progress(corpus, caplog):
    shards = list_shards([str(corpus)]) * 25  # 150: progress every 10% from 100 shards on
    with caplog.at_level(logging.INFO, logger="data.index"):
        footers = read_footers(shards, threads=4)
    assert [f.row_groups for f in footers[:6]] == [shard_info(s, "text").row_groups for s in shards[:6]]
    progress = [r.getMessage() for r in caplog.records if "shard footers" in r.getMessage()]
    assert 3 <= len(progress) <= 12 and progress[-1].startswith("[data] read 150 of 150 shard footers")


def on_thread_ranks(ranks, compute):
    """share_from_rank0 on `ranks` threads; (results, errors) per rank. A rank still waiting fails the test."""
    shared = _Shared()
    results, errors = [None] * ranks, [None] * ranks

    def rank(r):
        try:
            results[r] = share_from_rank0(compute, ThreadChannel(shared, r))
        except Exception as e:
            errors[r] = e

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    assert not any(t.is_alive() for t in threads), "a rank is still waiting"
    return results, errors


def test_rank0s_answer_and_its_errors_reach_every_rank():
    calls = []

    def compute():
        calls.append(1)
        return {"shards": [["s3://b/x.parquet", [3, 4]]], "é": None}

    results, errors = on_thread_ranks(4, compute)
    assert calls == [1] and errors == [None] * 4 and results == [compute()] * 4

    def fails():
        raise NoDataError("[data] no training data: x.parquet")

    results, errors = on_thread_ranks(4, fails)
    assert all(type(e) is NoDataError for e in errors) and str(errors[0]) == "[data] no training data: x.parquet"
    assert all(str(e) == "[data] no training data: x.parquet [raised on rank 0: NoDataError]" for e in errors[1:])
    _, errors = on_thread_ranks(3, lambda: {"not JSON": {1, 2}})
    assert all(isinstance(e, TypeError) for e in errors)
    _, errors = on_thread_ranks(2, lambda: 1 / 0)
    assert type(errors[0]) is ZeroDivisionError and type(errors[1]) is RuntimeError
    assert share_from_rank0(lambda: {"alone": 1}) == {"alone": 1}  # no process group: computed here


RANK_SCRIPT = """
import json, sys
import torch.distributed as dist
from data.index import startup_shards, share_from_rank0
from data.shards import BadShardError
rank, store, corpus, empty = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
infos = startup_shards([corpus], "", "text", "source", "error")
print(json.dumps({"rank": rank, "shards": {p: list(i.row_groups) for p, i in infos.items()}}))
def unreadable():
    raise BadShardError("x.parquet: unreadable")
try:
    share_from_rank0(unreadable)
except BadShardError as e:
    print("caught", e)
try:
    startup_shards([empty], "", "text", "", "error")
except FileNotFoundError as e:
    print("caught", e)
dist.destroy_process_group()
"""


def test_startup_shards_over_a_gloo_group_share_rank0s_answer_and_errors(corpus, tmp_path):
    (tmp_path / "empty").mkdir()
    script = tmp_path / "rank.py"
    script.write_text(textwrap.dedent(RANK_SCRIPT))
    args = [str(tmp_path / "store"), str(corpus), str(tmp_path / "empty")]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(r), *args],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    lines = [out.splitlines() for out, _ in outs]
    first = [json.loads(lines[r][0]) for r in range(2)]
    want = {s: list(shard_info(s, "text").row_groups) for s in list_shards([str(corpus)])}
    assert first[0]["shards"] == first[1]["shards"] == want
    assert lines[0][1] == "caught x.parquet: unreadable"
    assert lines[1][1] == "caught x.parquet: unreadable [raised on rank 0: BadShardError]"
    assert all("matches no parquet file" in lines[r][2] for r in range(2))


def test_the_startup_benchmark_runs_and_prints_its_table():
    cmd = [sys.executable, "-m", "benchmarks.bench_startup", "--quick"]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120, check=True).stdout
    rows = {
        line.split(" | ")[0].strip("| "): line.split(" | ")
        for line in out.splitlines()
        if re.match(r"\| [abcd] \|", line)
    }
    requests = {mode: int(row[3].replace(",", "")) for mode, row in rows.items()}
    assert sorted(requests) == ["a", "b", "c", "d"]
    # 4 ranks: each lists (2 requests) and opens and reads 64 footers in mode a; only rank 0 does in b
    assert requests["a"] == 4 * requests["b"] == 4 * (2 + 2 * 64)
    # with the index: the path's look-up and listing, the folder's listing, one GET of the index
    assert requests["c"] == 4 * requests["d"] == 4 * 4
    assert "every rank of every mode found the same 64 shards" in out


def test_the_index_cli_answers_bad_input_in_one_line(tmp_path):
    for argv, said in [
        ([str(tmp_path / "nothing")], f"[data] paths: '{tmp_path / 'nothing'}' matches no parquet file"),
        (
            [str(REPO / "assets" / "tiny" / "corpus"), "--out", str(tmp_path / "elsewhere" / "i.json")],
            "not below the index's folder",
        ),
    ]:
        with pytest.raises(SystemExit) as stop:
            main(argv)
        assert str(stop.value).startswith("python -m data.index: ") and said in str(stop.value)
        assert "\n" not in str(stop.value)
