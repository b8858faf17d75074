"""Shards on object storage: a real S3 server (moto's, on a free port of 127.0.0.1) and s3fs, the client users
run, behind the same `s3://` URLs and the same code paths as on a cluster (the endpoint from AWS_ENDPOINT_URL)."""

import json

import pytest
import torch
from conftest import REPO
from s3_server import s3_server
from test_data import BATCH, ENCODE, SEQ, take

from data.config import DataConfig
from data.loader import ParquetDataLoader, ValidationLoader, source_infos
from data.shards import list_shards

BUCKET = "corpora"


@pytest.fixture(scope="module")
def s3():
    """The server (tests/s3_server.py) with the demo corpus uploaded as s3://corpora/tiny/."""
    with s3_server() as fs:
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
