"""What a user meets when the store fails (issue 52, item 4): missing credentials, a bucket that is not there,
a shard deleted mid-run, a dropped or stalled connection. Each against a real S3 server (moto's), through an
HTTP proxy that drops or stalls requests, with the bounds set as a user sets them (AWS_MAX_ATTEMPTS for
botocore's retries, FSSPEC_S3 for s3fs's timeouts): each ends in bounded time, in one error naming the URL."""

import errno
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import fsspec.config
import pytest
import torch
from aiohttp import ClientPayloadError
from botocore.exceptions import ClientError
from conftest import REPO, torchrun
from s3_server import SERVERS, s3_server
from test_data import BATCH, ENCODE, SEQ, take

from benchmarks.s3_proxy import S3Proxy
from data.config import DataConfig
from data.index import FOOTER_THREADS
from data.loader import ParquetDataLoader, source_infos
from data.shards import BadShardError, read_row_group
from data.store import BoundedSession, StoreError, filesystem, store_call
from data.stream import epoch_streams
from mhar_titan.components.checkpoint.checksums import verify_share
from mhar_titan.components.checkpoint.layout import complete_steps
from mhar_titan.main import refusals

BUCKET = "corpora"
ATTEMPTS = 2  # AWS_MAX_ATTEMPTS in these tests: botocore tries each request twice in all
TIMEOUT_S = 1  # s3fs's connect and read timeouts in these tests (FSSPEC_S3)


@pytest.fixture(scope="module", params=SERVERS)
def s3(request):
    """The server with the demo corpus at s3://corpora/tiny/corpus/; yields (client, endpoint)."""
    with s3_server(request.param) as fs:
        fs.mkdir(BUCKET)
        fs.put(f"{REPO}/assets/tiny/corpus/", f"{BUCKET}/tiny/corpus/", recursive=True)
        yield fs, os.environ["AWS_ENDPOINT_URL"]


def config(root: str, **kw) -> DataConfig:
    return DataConfig(paths=[f"{root}/corpus"], num_streams=4, seed=3, **kw)


def loader(cfg: DataConfig) -> ParquetDataLoader:
    """As a job builds it: the start-up lists the shards and reads the index (or footers); rank 0 of 2."""
    shards, infos = source_infos(cfg)
    return ParquetDataLoader(cfg, shards, ENCODE, SEQ, BATCH, 0, 2, 0, infos=infos)


@contextmanager
def bounded(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The small bounds, set as a user sets them: AWS_MAX_ATTEMPTS in the environment, and FSSPEC_S3 as fsspec
    reads it from the environment at import (here after import: parsed the same way into fsspec's config)."""
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", str(ATTEMPTS))
    parsed: dict = {}
    options = {"config_kwargs": {"connect_timeout": TIMEOUT_S, "read_timeout": TIMEOUT_S}}
    fsspec.config.set_conf_env(parsed, {"FSSPEC_S3": json.dumps(options)})
    monkeypatch.setitem(fsspec.config.conf, "s3", parsed["s3"])
    yield


@contextmanager
def proxied(endpoint: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[S3Proxy]:
    """The store behind a proxy (benchmarks/s3_proxy.py) that forwards everything until a test sets its fault."""
    with S3Proxy(endpoint, stall_s=60) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        yield proxy


def gets(kind: str, first: int | None = None) -> tuple[Callable[[str, str], str | None], list[str]]:
    """A fault that answers `kind` to the first `first` GETs (every GET: None), and the GETs it saw."""
    seen: list[str] = []

    def fault(method: str, path: str) -> str | None:
        if method != "GET":
            return None
        seen.append(path)
        return kind if first is None or len(seen) <= first else None

    return fault, seen


def copy_corpus(fs, name: str) -> str:
    """A copy of the corpus of its own for a test that changes it; its URL root."""
    fs.copy(f"{BUCKET}/tiny/corpus/", f"{BUCKET}/{name}/corpus/", recursive=True)
    return f"s3://{BUCKET}/{name}"


# -- start-up ------------------------------------------------------------------------------------


def test_missing_credentials_stop_the_start_up_with_one_line_naming_the_url(s3, monkeypatch, caplog):
    for key in [k for k in os.environ if k.startswith("AWS_") and ("KEY" in k or "TOKEN" in k or "PROFILE" in k)]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/credentials")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent/config")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance-metadata lookup: this is no cloud VM
    url = f"s3://{BUCKET}/tiny/corpus"
    start = time.monotonic()
    with pytest.raises(StoreError, match=f"^{url}: listing \\[data\\] paths: no credentials for the store") as e:
        source_infos(config(f"s3://{BUCKET}/tiny"))
    assert time.monotonic() - start < 5 and "AWS_ACCESS_KEY_ID" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(SystemExit) as stop, refusals():  # as the trainer's start-up: one line, exit 2
        source_infos(config(f"s3://{BUCKET}/tiny"))
    assert stop.value.code == 2
    assert [r.message for r in caplog.records if r.levelno >= logging.ERROR][-1].startswith(f"StoreError: {url}: ")


def test_a_bucket_that_is_not_there_stops_the_start_up_naming_it(s3):
    with pytest.raises(SystemExit) as stop, refusals():
        source_infos(config("s3://no-such-bucket/tiny"))
    assert stop.value.code == 2
    with pytest.raises(FileNotFoundError, match="^\\[data\\] paths: 's3://no-such-bucket/tiny/corpus' matches no"):
        source_infos(config("s3://no-such-bucket/tiny"))


# -- a shard deleted mid-run ---------------------------------------------------------------------


def first_shard(cfg: DataConfig, shards: list[str]) -> str:
    """The shard stream 0 (rank 0's first) reads first."""
    return epoch_streams(shards, cfg.seed, 0, cfg.num_streams)[0][0]


def test_a_shard_deleted_after_start_up_stops_the_run_naming_it(s3):
    fs, _ = s3
    cfg = config(copy_corpus(fs, "deleted"))
    data = loader(cfg)
    gone = first_shard(cfg, next(iter(data.shards.values())))
    fs.rm(gone.removeprefix("s3://"))
    with pytest.raises(BadShardError, match=f"^{gone}: row group \\d+ unreadable \\(FileNotFoundError"):
        take(data, 4)


def test_with_on_bad_shard_skip_a_deleted_shard_is_skipped_counted_and_logged(s3, caplog):
    fs, _ = s3
    cfg = config(copy_corpus(fs, "deleted-skip"), on_bad_shard="skip")
    data = loader(cfg)
    gone = first_shard(cfg, next(iter(data.shards.values())))
    fs.rm(gone.removeprefix("s3://"))
    with caplog.at_level(logging.WARNING, logger="data.stream"):
        take(data, 4)
    assert data.counters()["skipped_shards"] == 1
    assert any(r.message.startswith(f"[data] skipping shard: {gone}: row group") for r in caplog.records)


# -- dropped and stalled connections -------------------------------------------------------------


def test_dropped_connections_are_retried_and_give_the_same_windows(s3, monkeypatch):
    fs, endpoint = s3
    cfg = config(f"s3://{BUCKET}/tiny")
    want, _ = take(loader(cfg), 6)
    with bounded(monkeypatch), proxied(endpoint, monkeypatch) as proxy:
        data = loader(cfg)
        proxy.fault, seen = gets("drop", first=ATTEMPTS - 1)  # fewer than botocore's attempts: retried by it
        got, _ = take(data, 6)
    assert proxy.faults == ATTEMPTS - 1 and len(seen) > ATTEMPTS
    for (a, la), (b, lb) in zip(want, got, strict=True):
        assert torch.equal(a["input"], b["input"]) and torch.equal(la, lb)


@pytest.mark.parametrize("fault", ["drop", "stall"])
def test_a_connection_dropped_or_stalled_every_time_ends_within_the_bound_naming_the_shard(s3, monkeypatch, fault):
    _, endpoint = s3
    url = f"s3://{BUCKET}/tiny/corpus/shard-0000{fault == 'stall'}.parquet"
    with bounded(monkeypatch), proxied(endpoint, monkeypatch) as proxy:
        proxy.fault, seen = gets(fault)
        start = time.monotonic()
        with pytest.raises(StoreError, match=f"^{url}: reading row group 0: the store failed") as e:
            read_row_group(url, 0, "text")
        elapsed = time.monotonic() - start
    assert "AWS_MAX_ATTEMPTS" in str(e.value) and "\n" not in str(e.value)
    if fault == "drop":
        assert elapsed < 10, elapsed
        # botocore's attempts, each sent at most twice: aiohttp sends an idempotent request once more on a fresh
        # connection when a kept-alive one closes without an answer (RFC 9112, 9.3.1.1)
        assert ATTEMPTS <= len(seen) <= 2 * ATTEMPTS, seen
    else:  # each attempt waits out the read timeout
        assert "ReadTimeoutError" in str(e.value)
        assert ATTEMPTS * TIMEOUT_S <= elapsed < ATTEMPTS * TIMEOUT_S + 5, elapsed
        assert len(seen) == ATTEMPTS, seen


def test_a_store_failure_mid_run_is_never_skipped_as_a_bad_shard(s3, monkeypatch):
    _, endpoint = s3
    cfg = config(f"s3://{BUCKET}/tiny", on_bad_shard="skip")
    with bounded(monkeypatch), proxied(endpoint, monkeypatch) as proxy:
        data = loader(cfg)
        proxy.fault, _ = gets("drop")
        with pytest.raises(StoreError, match=f"^s3://{BUCKET}/tiny/corpus/shard-0000\\d.parquet: reading row group"):
            take(data, 2)
    assert data.counters()["skipped_shards"] == 0


def test_an_answer_cut_short_is_read_again_once_and_a_5xx_answer_is_not(caplog):
    """Failures the proxy cannot make: a body cut short (botocore had returned: the loader reads it again, once),
    and a 5xx answer after botocore's attempts (s3fs hands it on as an OSError): both store failures, never a
    bad shard; any other error passes unchanged."""
    url, calls = "s3://b/k.parquet", []

    def failing(error: Exception, times: int) -> Callable[[], str]:
        def read() -> str:
            calls.append(error)
            if len(calls) <= times:
                raise error
            return "data"

        calls.clear()
        return read

    cut = ClientPayloadError("Response payload is not completed")
    with caplog.at_level(logging.WARNING, logger="data.store"):
        assert store_call(url, "reading row group 0", failing(cut, 1)) == "data" and len(calls) == 2
    assert f"[data] {url}: reading row group 0: the answer was cut short" in caplog.text
    with pytest.raises(StoreError, match=f"^{url}: reading row group 0: the store failed \\(read 2 times"):
        store_call(url, "reading row group 0", failing(cut, 2))
    server = OSError(errno.EIO, "We encountered an internal error. Please try again.")
    server.__cause__ = ClientError(
        {"Error": {"Code": "InternalError"}, "ResponseMetadata": {"HTTPStatusCode": 500}}, "GetObject"
    )
    said = "the store failed \\(read once .* HTTP 500 InternalError on GetObject: .*internal error"
    with pytest.raises(StoreError, match=said) as e:
        store_call(url, "reading row group 0", failing(server, 1))
    assert len(calls) == 1 and e.value.kind == "server"
    with pytest.raises(FileNotFoundError):
        store_call(url, "reading row group 0", failing(FileNotFoundError(url), 1))


# -- a training job ------------------------------------------------------------------------------


def test_a_job_whose_shard_is_deleted_mid_run_exits_naming_it_and_its_checkpoint_verifies(s3, monkeypatch, tmp_path):
    """1 rank on the corpus on S3: once the job has a checkpoint, the next shard it reads is deleted (the
    proxy deletes it as the request passes). The job stops naming the shard, exit 1 (docs/health.md: a failure
    the trainer did not choose), and its checkpoints are complete and match their checksums."""
    fs, endpoint = s3
    root, run = copy_corpus(fs, "job"), tmp_path / "run"
    deleted: list[str] = []

    def delete_once_checkpointed(method: str, path: str) -> None:
        shard = path.split("?")[0].lstrip("/")
        if not deleted and shard.endswith(".parquet") and complete_steps(str(run / "checkpoint")):
            fs.rm(shard)
            deleted.append(f"s3://{shard}")
        return None

    with proxied(endpoint, monkeypatch) as proxy:
        proxy.fault = delete_once_checkpointed
        proc = torchrun(
            run,
            *("--training.steps", "40", "--checkpoint.interval", "2", "--validation.no-enable"),
            *(
                "--data.mixture",
                f"docstrings=1:{root}/corpus",
                "--data.validation_sets",
                "docstrings:heldout=docstrings",
            ),
            nproc=1,
            check=False,
        )
    log = proc.stdout + proc.stderr
    assert deleted and proc.returncode == 1, (deleted, proc.returncode, log[-3000:])
    assert f"BadShardError: {deleted[0]}: row group" in log and "unreadable (FileNotFoundError" in log
    steps = complete_steps(str(run / "checkpoint"))
    assert steps and all(verify_share(str(run / "checkpoint" / f"step-{s}"), 0, 1) == ([], []) for s in steps)


def test_the_loader_and_data_prepare_import_without_the_s3_extra():
    """aiohttp and botocore come with s3fs, an optional extra: a local-files install must not need them."""
    blocked = "import sys; sys.modules.update(aiohttp=None, botocore=None, aiobotocore=None, s3fs=None)"
    code = f"{blocked}; import data.loader, data.prepare, data.store; print(data.store.CLIENT_ERRORS)"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "()", proc.stderr


def test_the_loaders_s3_client_keeps_a_connection_per_footer_thread_and_the_users_fsspec_settings(monkeypatch):
    monkeypatch.setitem(fsspec.config.conf, "s3", {"config_kwargs": {"read_timeout": 3}})
    fs, _ = filesystem("s3://corpora/tiny")
    bounded = {"http_session_cls": BoundedSession}  # each request bounded as a whole
    want = {"max_pool_connections": FOOTER_THREADS, "read_timeout": 3, **bounded}
    assert fs.config_kwargs == want and fs.retries == 1
    monkeypatch.setitem(fsspec.config.conf, "s3", {"config_kwargs": {"max_pool_connections": 8}})
    assert filesystem("s3://corpora/tiny")[0].config_kwargs == {"max_pool_connections": 8, **bounded}  # the user's
