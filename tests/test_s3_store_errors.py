"""What a user meets when a real store refuses or stops (issue 66): credentials refused, a write not permitted, a
missing bucket, throttling, prefixes left with folder entries, a conditional create lost, a server stopped mid-put
and mid-read. Against SeaweedFS where only a server that checks signatures or runs as its own process can show it
(a wrong secret, a stopped process), against both servers (tests/s3_server.py) everywhere else."""

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import fsspec.config
import pytest
from botocore.exceptions import ClientError, NoCredentialsError
from conftest import REPO, torchrun
from s3_server import SERVERS, s3_server

from benchmarks.s3_proxy import S3Proxy
from benchmarks.s3_store import READER
from data.atomic import RemoteFolder
from data.config import DataConfig
from data.loader import source_infos
from data.shards import PREPARING, read_row_group
from data.store import MIN_RATE_ENV, StoreError, classify, filesystem, objects, remove_prefix, store_call
from mhar_titan.components.checkpoint.remote import CLAIM, RemoteCheckpoints
from mhar_titan.main import refusals

ATTEMPTS = 2  # AWS_MAX_ATTEMPTS here
TIMEOUT_S = 1  # connect and read timeouts here (FSSPEC_S3)
MIN_MB_S = 20  # MHAR_STORE_MIN_MB_S here


def answer(status: int, code: str, operation: str = "GetObject") -> OSError:
    """An OSError caused by botocore's ClientError, as s3fs hands the store's answer on."""
    error = OSError(f"{code or status}")
    body = {"Code": code} if code else {}
    error.__cause__ = ClientError({"Error": body, "ResponseMetadata": {"HTTPStatusCode": status}}, operation)
    return error


def test_each_kind_of_store_failure_is_told_apart_and_the_datas_own_errors_are_not_the_stores():
    cases = [
        (NoCredentialsError(), "credentials"),
        (answer(403, "SignatureDoesNotMatch"), "credentials"),
        (answer(403, "InvalidAccessKeyId"), "credentials"),
        (answer(403, "AccessDenied"), "permission"),
        (answer(403, "", "HeadObject"), "permission"),  # a HEAD answer has no body, so no code
        (answer(404, "NoSuchBucket", "ListObjectsV2"), "missing bucket"),
        (answer(404, "", "HeadBucket"), "missing bucket"),
        (answer(503, "SlowDown"), "throttled"),
        (answer(429, ""), "throttled"),
        (answer(500, "InternalError"), "server"),
        (TimeoutError(), "unreachable"),
        (answer(404, "NoSuchKey"), None),  # a missing object: the data's (a bad shard), not the store's
        (answer(404, "", "HeadObject"), None),
        (FileNotFoundError("s3://b/k"), None),
        (ValueError("bad parquet"), None),
    ]
    for error, kind in cases:
        assert classify(error) == kind, (error, error.__cause__)
    url = "s3://bucket/corpus/shard-00001.parquet"
    said = {
        "credentials": "the store refused the credentials (HTTP 403 SignatureDoesNotMatch on GetObject",
        "permission": "access denied (HTTP 403 AccessDenied on GetObject",
        "missing bucket": "the bucket 'bucket' does not exist on this store (HTTP 404 NoSuchBucket on GetObject",
        "throttled": "the store throttled the requests (read once in",
        "server": "the store failed (read once in",
    }
    codes = {
        "credentials": (403, "SignatureDoesNotMatch"),
        "permission": (403, "AccessDenied"),
        "missing bucket": (404, "NoSuchBucket"),
        "throttled": (503, "SlowDown"),
        "server": (500, "InternalError"),
    }

    def failing(status: int, code: str):
        def read():
            raise answer(status, code)

        return read

    for kind, (status, code) in codes.items():
        with pytest.raises(StoreError) as e:
            store_call(url, "reading its footer", failing(status, code))
        assert e.value.kind == kind and str(e.value).startswith(f"{url}: reading its footer: {said[kind]}")
        assert "\n" not in str(e.value)


@contextmanager
def bounded(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Small bounds, set as a user sets them (the environment; FSSPEC_S3 as fsspec parses it)."""
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", str(ATTEMPTS))
    monkeypatch.setenv(MIN_RATE_ENV, str(MIN_MB_S))
    parsed: dict = {}
    options = {"config_kwargs": {"connect_timeout": TIMEOUT_S, "read_timeout": TIMEOUT_S}}
    fsspec.config.set_conf_env(parsed, {"FSSPEC_S3": json.dumps(options)})
    monkeypatch.setitem(fsspec.config.conf, "s3", parsed["s3"])
    yield


@pytest.fixture(scope="module")
def weed():
    """SeaweedFS with the demo corpus at s3://corpora/tiny/corpus/."""
    with s3_server("seaweedfs") as fs:
        fs.mkdir("corpora")
        fs.put(f"{REPO}/assets/tiny/corpus/", "corpora/tiny/corpus/", recursive=True)
        yield fs


def test_a_wrong_secret_stops_the_start_up_in_one_line_naming_the_url_and_the_credentials(weed, monkeypatch, caplog):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    url = "s3://corpora/tiny/corpus"
    with pytest.raises(StoreError, match=f"^{url}: listing \\[data\\] paths: the store refused the credentials") as e:
        source_infos(DataConfig(paths=[url], num_streams=2))
    assert e.value.kind == "credentials" and "AWS_SECRET_ACCESS_KEY" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(SystemExit) as stop, refusals():
        source_infos(DataConfig(paths=[url], num_streams=2))
    assert stop.value.code == 2


def test_a_wrong_secret_ends_a_two_rank_job_in_one_line_with_exit_2(weed, tmp_path):
    proc = torchrun(
        tmp_path / "run",
        *("--training.steps", "2", "--validation.no-enable"),
        *("--data.mixture", "docstrings=0.7:s3://corpora/tiny/corpus,code=0.3:assets/tiny/code"),
        env={"AWS_SECRET_ACCESS_KEY": "not-the-secret"},
        check=False,
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 2, log[-3000:]
    assert "Traceback" not in log and "ChildFailedError" not in log
    refused = [line for line in log.splitlines() if "the store refused the credentials" in line]
    assert refused and all("s3://corpora/tiny/corpus" in line for line in refused)


def test_a_write_the_credentials_may_not_make_is_named_as_a_permission(weed, monkeypatch, tmp_path):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", READER["accessKey"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", READER["secretKey"])
    assert source_infos(DataConfig(paths=["s3://corpora/tiny/corpus"], num_streams=2))[0]  # reading: allowed
    store = RemoteCheckpoints("s3://corpora/runs/a", str(tmp_path / "run" / "checkpoint"), str(tmp_path / "run"))
    with pytest.raises(StoreError, match=f"^s3://corpora/runs/a: creating {CLAIM} there: access denied") as e:
        store.attach()
    assert e.value.kind == "permission"


@pytest.mark.parametrize("server", SERVERS)
def test_a_missing_bucket_and_throttling_are_named(server, monkeypatch, tmp_path):
    with s3_server(server) as fs, bounded(monkeypatch):
        fs.mkdir("corpora")
        run = str(tmp_path / "run")
        with pytest.raises(StoreError, match="^s3://no-such-bucket/run: .*the bucket 'no-such-bucket' does not exist"):
            RemoteCheckpoints("s3://no-such-bucket/run", f"{run}/checkpoint", run).attach()
        with pytest.raises(StoreError, match="^s3://no-such-bucket/out: .*the bucket 'no-such-bucket' does not exist"):
            RemoteFolder("s3://no-such-bucket/out", PREPARING, "data.prepare").listing()
        fs.put(f"{REPO}/assets/tiny/corpus/", "corpora/tiny/corpus/", recursive=True)
        slow = S3Proxy(os.environ["AWS_ENDPOINT_URL"], fault=lambda method, path: "slowdown")
        with slow as proxy, pytest.MonkeyPatch.context() as env:  # undone before the server's own environment
            env.setenv("AWS_ENDPOINT_URL", proxy.url)
            with pytest.raises(StoreError, match="^s3://corpora/tiny/corpus: listing .*: the store throttled") as e:
                source_infos(DataConfig(paths=["s3://corpora/tiny/corpus"], num_streams=2))
            assert e.value.kind == "throttled" and "HTTP 503" in str(e.value)
            assert proxy.faults == ATTEMPTS  # botocore retried it, as it retries throttling, and no more


@pytest.mark.parametrize("server", SERVERS)
def test_a_prefix_emptied_object_by_object_is_empty_and_the_project_leaves_no_folder_entries(server, tmp_path):
    with s3_server(server) as fs:
        fs.mkdir("ckpt")
        for name in ("step-10/.metadata", "step-10/__0_0.distcp", "step-20/a/b.bin", CLAIM):
            fs.pipe(f"ckpt/deleted/{name}", b"x")
        for name in fs.find("ckpt/deleted"):  # as a user deletes a prefix: object by object
            fs.rm_file(name)
        fs.invalidate_cache()
        bare = filesystem("s3://ckpt/deleted")
        assert objects(*bare) == []
        run = str(tmp_path / "run")
        assert RemoteCheckpoints("s3://ckpt/deleted", f"{run}/checkpoint", run).attach() == []  # claimed, not refused
        assert objects(*bare) == [CLAIM]
        folder = RemoteFolder("s3://ckpt/export", "_EXPORTING.json", "hf export")
        assert folder.check(replace=False, log=print) == []
        folder.claim()
        (tmp_path / "w.bin").write_bytes(b"w")
        folder.upload(str(tmp_path / "w.bin"), "sub/w.bin")
        folder.abandon(print)  # a failed writer: its objects, its marker and the folder entries go
        fs.invalidate_cache()
        assert not fs.exists("ckpt/export") and "ckpt/export" not in fs.ls("ckpt", refresh=True)
        fs.pipe("ckpt/leftover/x/y.bin", b"y")
        remove_prefix(*filesystem("s3://ckpt/leftover"))
        assert "ckpt/leftover" not in fs.ls("ckpt", refresh=True)


# -- a server that stops: every operation ends within its bound ---------------------------------------------------


def weed_pid() -> int:
    port = os.environ["AWS_ENDPOINT_URL"].rsplit(":", 1)[1]
    found = subprocess.run(["pgrep", "-f", f"weed server .*-s3.port={port} "], capture_output=True, text=True)
    return int(found.stdout.split()[0])


@contextmanager
def stopped(pid: int) -> Iterator[None]:
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def attempt_bound(body_bytes: int) -> float:
    """What data/store.py allows one request: connect + read timeout + its body at the minimum rate."""
    return 2 * TIMEOUT_S + body_bytes / (MIN_MB_S * 1e6)


BACKOFF_S = 1.0  # botocore's waits between attempts (legacy mode: at most 1 s before the second)
SLACK_S = 5.0  # thread start, s3fs's multipart calls before and after the parts, a loaded 2-core machine


def test_a_put_to_a_server_stopped_midway_ends_within_its_bound_naming_the_url(weed, monkeypatch, tmp_path):
    big = tmp_path / "big.bin"
    big.write_bytes(os.urandom(64 << 20))  # two multipart parts of s3fs's 50 MiB
    folder = RemoteFolder("s3://corpora/stalled", PREPARING, "data.prepare")
    with bounded(monkeypatch):
        folder.fs, folder.root = filesystem(folder.url)
        folder.claim()
        began = time.monotonic()
        with stopped(weed_pid()):
            with pytest.raises(StoreError, match="^s3://corpora/stalled/big.bin: uploading it: the store failed") as e:
                folder.upload(str(big), keep=True)
            took = time.monotonic() - began
    bound = ATTEMPTS * attempt_bound(50 << 20) + BACKOFF_S + SLACK_S
    assert took < bound, f"{took:.1f} s, bound {bound:.1f} s: {e.value}"
    assert e.value.kind == "unreachable" and "ReadTimeoutError" in str(e.value)


def test_a_read_from_a_server_stopped_midway_ends_within_its_bound_naming_the_shard(weed, monkeypatch):
    url = "s3://corpora/tiny/corpus/shard-00000.parquet"
    with bounded(monkeypatch):
        read_row_group(url, 0, "text")  # the footer read and cached; the connection pool warm
        began = time.monotonic()
        with stopped(weed_pid()):
            with pytest.raises(StoreError, match=f"^{url}: reading row group 1: the store failed"):
                read_row_group(url, 1, "text")
            took = time.monotonic() - began
    bound = ATTEMPTS * attempt_bound(0) + BACKOFF_S + SLACK_S
    assert took < bound, f"{took:.1f} s, bound {bound:.1f} s"


def test_a_job_whose_store_stops_fails_within_its_bound_saying_its_own_error_before_the_wait(weed, tmp_path):
    """Checkpoints on the store, the server stopped after the first one is up, and the job crashing two steps later
    while the next upload hangs: its error is said first, the upload fails within its bound, the job ends."""
    run = tmp_path / "run"
    env = {
        "AWS_MAX_ATTEMPTS": str(ATTEMPTS),
        MIN_RATE_ENV: str(MIN_MB_S),
        "FSSPEC_S3": json.dumps({"config_kwargs": {"connect_timeout": TIMEOUT_S, "read_timeout": TIMEOUT_S}}),
        "MHAR_TEST_CRASH": "5:always",
    }
    args = ("--training.steps", "8", "--checkpoint.interval", "2", "--validation.no-enable")
    cmd_env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", **env}
    cmd = [
        *(sys.executable, "-m", "mhar_titan.launch", "--standalone", "--nproc-per-node=2", str(REPO / "train_cpt.py")),
        *("--job.config_file", "configs/tiny_cpu.toml", "--job.dump_folder", str(run), *args),
        *("--checkpoint.folder", "s3://corpora/runs/stalled"),
    ]
    job = subprocess.Popen(cmd, cwd=REPO, env=cmd_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines, pid = [], weed_pid()
    try:
        for line in job.stdout:
            lines.append(line)
            if "step-2: complete on the store" in line:
                os.kill(pid, signal.SIGSTOP)
                began = time.monotonic()
                break
        else:
            pytest.fail("".join(lines)[-4000:])
        lines += job.stdout.readlines()
        job.wait(timeout=600)
        took = time.monotonic() - began
    finally:
        os.kill(pid, signal.SIGCONT)
        if job.poll() is None:
            job.kill()
    log = "".join(lines)
    assert job.returncode != 0
    failed = log.index("the job failed (")
    assert failed < log.index("waiting for the upload of"), log[-4000:]
    assert "the store lacks the run's last checkpoint" in log
    # the steps from the stop to the crash (about 1 s each here), then the last upload's attempts
    bound = 30 + ATTEMPTS * attempt_bound(8 << 20) + BACKOFF_S + SLACK_S
    assert took < bound, f"{took:.1f} s, bound {bound:.1f} s\n{log[-3000:]}"


def test_a_bad_minimum_rate_is_named_before_any_request(monkeypatch):
    monkeypatch.setenv(MIN_RATE_ENV, "abc")
    with pytest.raises(StoreError, match="^s3://b/x: MHAR_STORE_MIN_MB_S='abc': not a number of MB/s$") as e:
        filesystem("s3://b/x")
    assert e.value.kind == "settings"
