"""Shards on object storage: real S3 servers (moto's and SeaweedFS, tests/s3_server.py) and s3fs, the client users
run, behind the same `s3://` URLs and the same code paths as on a cluster (the endpoint from AWS_ENDPOINT_URL).
Every test runs against each server."""

import json
import os
import re
import subprocess
import sys

import pytest
import torch
from conftest import REPO
from s3_server import SERVERS, s3_server
from test_data import BATCH, ENCODE, SEQ, take
from test_data_prepare import LIMIT, make_inputs

from data import prepare
from data.atomic import HOST, OutputError, RemoteFolder
from data.config import DataConfig
from data.index import INDEX_NAME, startup_shards, write_index
from data.loader import ParquetDataLoader, ValidationLoader, source_infos
from data.shards import PREPARING, BadShardError, UnfinishedFolderError, list_shards

BUCKET = "corpora"


@pytest.fixture(scope="module", params=SERVERS)
def s3(request):
    """Each server (tests/s3_server.py) with the demo corpus uploaded as s3://corpora/tiny/."""
    with s3_server(request.param) as fs:
        fs.mkdir(BUCKET)
        fs.put(f"{REPO}/assets/tiny/corpus/", f"{BUCKET}/tiny/corpus/", recursive=True)
        fs.put(f"{REPO}/assets/tiny/code/", f"{BUCKET}/tiny/code/", recursive=True)
        yield fs


def config(root: str, **kw) -> DataConfig:
    return DataConfig(paths=[f"{root}/corpus"], validation_paths=[f"{root}/code"], num_streams=4, seed=3, **kw)


def loader(cfg: DataConfig, rank: int = 0) -> ParquetDataLoader:
    """As a job builds it: the start-up check lists the shards and reads their footers (through s3fs here)."""
    shards, infos = source_infos(cfg)
    return ParquetDataLoader(cfg, shards, ENCODE, SEQ, BATCH, rank, 2, 0, infos=infos)


def test_shards_on_s3_give_the_windows_state_and_contents_of_the_same_shards_on_disk(s3):
    local, remote = config(str(REPO / "assets" / "tiny")), config(f"s3://{BUCKET}/tiny")
    assert list_shards(remote.paths) == [f"s3://{BUCKET}/tiny/corpus/shard-{i:05d}.parquet" for i in range(4)]
    for rank in (0, 1):
        ours, theirs = loader(local, rank), loader(remote, rank)
        (a, _), (b, _) = take(ours, 12), take(theirs, 12)
        for (x, lx), (y, ly) in zip(a, b, strict=True):
            assert torch.equal(x["input"], y["input"]) and torch.equal(lx, ly)
        # the streams' states name shards by their path below the corpus folder: a resume may move the corpus
        assert ours.state_dict() == theirs.state_dict()
        assert ours.contents() == theirs.contents() is not None  # the fingerprint's content digest (sizes, footers)
    (val_a, val_b) = (list(ValidationLoader(c, [], ENCODE, SEQ, BATCH, 0, 1)) for c in (local, remote))
    assert val_a and len(val_a) == len(val_b)
    assert all(torch.equal(x[0]["input"], y[0]["input"]) for x, y in zip(val_a, val_b, strict=True))


def test_a_loader_on_s3_resumes_exactly_from_its_state(s3):
    cfg = config(f"s3://{BUCKET}/tiny")
    want, _ = take(loader(cfg, 1), 10)
    first = loader(cfg, 1)
    head, _ = take(first, 4)
    second = loader(cfg, 1)
    second.load_state_dict(json.loads(json.dumps(first.state_dict())))  # as a checkpoint keeps it: JSON
    tail, _ = take(second, 6)
    for k, ((a, la), (b, lb)) in enumerate(zip(want, head + tail, strict=True)):
        assert torch.equal(a["input"], b["input"]) and torch.equal(la, lb), k


def test_a_bucket_or_prefix_that_is_not_there_is_named_before_any_batch(s3):
    for url in (f"s3://{BUCKET}/nothing-here", "s3://no-such-bucket/corpus"):
        with pytest.raises(FileNotFoundError, match=f"^\\[data\\] paths: '{url}' matches no parquet file$"):
            list_shards([url])


# -- python -m data.prepare writing to s3:// -------------------------------------------------------------


def test_a_shard_deleted_from_a_store_prefix_its_index_lists_is_named_not_dropped(s3):
    """The object gone, `_index.json` still listing it: start-up names it, never 3 of 4 shards in silence."""
    prefix = f"{BUCKET}/gone"
    s3.put(f"{REPO}/assets/tiny/code/", f"{prefix}/", recursive=True)
    shards = list_shards([f"s3://{prefix}"])
    write_index(shards, f"s3://{prefix}/{INDEX_NAME}")
    s3.rm(f"{prefix}/shard-00001.parquet")
    said = f"s3://{prefix}/shard-00001.parquet: listed in s3://{prefix}/{INDEX_NAME} but not in its folder"
    with pytest.raises(BadShardError, match=re.escape(said)):
        startup_shards([f"s3://{prefix}"], "", "text", "source", "error")
    assert len(startup_shards([f"s3://{prefix}"], "", "text", "source", "skip")) == len(shards) - 1


@pytest.fixture
def prepare_inputs(tmp_path):
    return make_inputs(tmp_path)


def prepare_to(url: str, *args: str) -> int:
    return prepare.main([url, *args])


def test_prepare_to_s3_writes_what_it_writes_locally_and_the_loader_reads_it(s3, prepare_inputs, tmp_path, capsys):
    paths, docs, _ = prepare_inputs
    args = [*paths, *LIMIT, "--docs-per-shard", "5", "--row-group-docs", "2"]
    local, url = tmp_path / "local", f"s3://{BUCKET}/prepared/corpus"
    assert prepare.main([str(local), *args]) == 0
    assert prepare_to(url, *args) == 0
    assert "wrote s3://corpora/prepared/corpus/ (manifest.txt" in capsys.readouterr().out
    names = sorted(p.name for p in local.iterdir())
    assert sorted(s3.ls(f"{BUCKET}/prepared/corpus", refresh=True)) == [f"{BUCKET}/prepared/corpus/{n}" for n in names]
    shards = [n for n in names if n.endswith(".parquet")]
    for name in [*shards, INDEX_NAME]:  # byte-identical shards; the index names them relative to its folder
        assert s3.cat(f"{BUCKET}/prepared/corpus/{name}") == (local / name).read_bytes(), name
    summary = json.loads(s3.cat(f"{BUCKET}/prepared/corpus/summary.json"))
    want = json.loads((local / "summary.json").read_text())
    assert summary == want  # the same counts, shards and settings
    manifest = s3.cat(f"{BUCKET}/prepared/corpus/manifest.txt").decode().splitlines()[1:]
    assert manifest == [f"{url}/{n}" for n in shards]
    # the loader reads the URL as it reads the folder: the same windows, and the index found beside the shards
    ours, theirs = (DataConfig(paths=[p], num_streams=2, seed=3) for p in (str(local), url))
    a, b = (take(loader(c, 0), 6)[0] for c in (ours, theirs))
    assert all(torch.equal(x["input"], y["input"]) for (x, _), (y, _) in zip(a, b, strict=True))
    assert DataConfig(manifest=f"{url}/manifest.txt").manifest and list_shards([], f"{url}/manifest.txt") == [
        f"{url}/{n}" for n in shards
    ]


def test_prepare_to_s3_refuses_what_it_must_not_replace_and_overwrites_its_own(s3, prepare_inputs, capsys):
    paths, _, _ = prepare_inputs
    url = f"s3://{BUCKET}/refusals/corpus"
    s3.pipe(f"{BUCKET}/refusals/corpus/notes.md", b"a user's file")
    assert prepare_to(url, *paths, *LIMIT) == 1
    assert capsys.readouterr().err == (
        f"error: {url}: not empty (1 entries, e.g. notes.md); pass --overwrite to replace\n"
    )
    assert prepare_to(url, *paths, *LIMIT, "--overwrite") == 1
    assert "holds files data.prepare does not write (notes.md); refusing to replace it" in capsys.readouterr().err
    s3.rm_file(f"{BUCKET}/refusals/corpus/notes.md")
    assert prepare_to(url, *paths, *LIMIT, "--docs-per-shard", "3") == 0
    first = sorted(s3.ls(f"{BUCKET}/refusals/corpus", refresh=True))
    assert prepare_to(url, *paths, *LIMIT) == 1 and "pass --overwrite" in capsys.readouterr().err
    assert prepare_to(url, *paths, *LIMIT, "--docs-per-shard", "100", "--overwrite") == 0
    assert "deleted the earlier output" in capsys.readouterr().err
    second = sorted(s3.ls(f"{BUCKET}/refusals/corpus", refresh=True))
    assert len(first) > len(second) == 4  # one shard now: the earlier shards are gone, not left beside it
    assert list_shards([url]) == [f"{url}/shard-00000.parquet"]


def test_a_failed_prepare_to_s3_leaves_nothing_and_a_killed_one_leaves_a_marker_the_loader_refuses(
    s3, prepare_inputs, capsys
):
    paths, _, _ = prepare_inputs
    url = f"s3://{BUCKET}/failed/corpus"
    # too many bad rows is found after the shards are uploaded: they go again, with the marker
    assert prepare_to(url, *paths, "--docs-per-shard", "2") == 1
    assert "bad" in capsys.readouterr().err and not s3.exists(f"{BUCKET}/failed/corpus")
    # a run killed midway: its shards and marker stay, from a process of this host that is gone
    assert prepare_to(url, *paths, *LIMIT, "--docs-per-shard", "2") == 0
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    marker = {"pid": int(gone.stdout), "host": HOST, "started": "2026-12-06T00:00:00Z"}
    s3.rm_file(f"{BUCKET}/failed/corpus/summary.json")
    s3.pipe(f"{BUCKET}/failed/corpus/{PREPARING}", json.dumps(marker).encode())
    for paths_ in ([url], [f"{url}/*.parquet"]):  # a folder, and a glob (found in the start-up listing)
        with pytest.raises(UnfinishedFolderError, match=f"^{url}: data.prepare has not finished writing this folder"):
            source_infos(DataConfig(paths=paths_, num_streams=2))
    assert prepare_to(url, *paths, *LIMIT) == 1
    assert f"left incomplete by a killed data.prepare (PID {marker['pid']} on host {HOST}" in capsys.readouterr().err
    assert prepare_to(url, *paths, *LIMIT, "--docs-per-shard", "2", "--overwrite") == 0
    assert "removing the incomplete output of a killed data.prepare" in capsys.readouterr().err
    assert not s3.exists(f"{BUCKET}/failed/corpus/{PREPARING}") and list_shards([url])
    # a run of another host, or a live one of this host, is never removed
    for owner, said in (
        ({**marker, "host": "elsewhere"}, "has not finished; if that run is gone, delete"),
        ({**marker, "pid": os.getppid()}, f"being written by data.prepare (PID {os.getppid()}"),
    ):
        s3.pipe(f"{BUCKET}/failed/corpus/{PREPARING}", json.dumps(owner).encode())
        assert prepare_to(url, *paths, *LIMIT, "--overwrite") == 1
        assert said in capsys.readouterr().err
    s3.rm_file(f"{BUCKET}/failed/corpus/{PREPARING}")


def test_two_prepares_to_one_prefix_cannot_both_claim_it(s3):
    first, second = (RemoteFolder(f"s3://{BUCKET}/claimed", PREPARING, "data.prepare") for _ in range(2))
    first.claim()
    with pytest.raises(OutputError, match="another data.prepare began writing it just now"):
        second.claim()
    first.finish()
    assert not s3.exists(f"{BUCKET}/claimed/{PREPARING}")
