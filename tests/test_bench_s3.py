"""The benchmarks' S3 paths on tiny inputs: the loader through the latency proxy reads the tokens it reads from
disk and waits the latency once per request; `make bench-data`'s S3 rows and `bench_startup --s3` run and
check themselves (S3 delivering the local tokens, the index giving the footers' answer)."""

import os
import re
import subprocess
import sys
import time

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from conftest import REPO
from s3_server import s3_server
from test_data import ENCODE

from benchmarks import bench_checkpoint_s3, bench_data
from benchmarks.s3_proxy import S3Proxy
from benchmarks.s3_store import environment, upload
from data.config import DataConfig
from data.loader import ParquetDataLoader, source_infos
from data.shards import list_shards

TEXTS = [f"def f{i}(x):\n    return x + {i}  # the {i}th function, says the docstring\n" * 20 for i in range(24)]
LATENCY = 0.02


def shards(tmp_path):
    out = tmp_path / "shards"
    out.mkdir()
    for i in range(2):
        pq.write_table(pa.table({"text": TEXTS[i::2]}), out / f"{i}.parquet", row_group_size=4)
    return out


def batches(paths, n, proxy=None):
    """n batches of a job's loader over `paths` (start-up as a job's, 0 workers), the seconds they took after
    start-up and the requests the proxy served meanwhile."""
    cfg = DataConfig(paths=paths, num_streams=2)
    found, infos = source_infos(cfg)
    it = iter(ParquetDataLoader(cfg, found, ENCODE, 64, 1, 0, 1, infos=infos))
    requests, start = proxy.requests if proxy else 0, time.perf_counter()
    out = [next(it)[0]["input"] for _ in range(n)]
    return out, time.perf_counter() - start, (proxy.requests if proxy else 0) - requests


def test_through_the_proxy_the_loader_reads_the_local_tokens_and_waits_per_request(tmp_path, monkeypatch):
    local = list_shards([str(shards(tmp_path))])
    want, _, _ = batches(local, 120)  # 2 streams of 12 documents, about 30 windows a row group: several refills
    with s3_server("moto"), S3Proxy(os.environ["AWS_ENDPOINT_URL"], latency_s=LATENCY) as proxy:
        urls = upload(os.environ["AWS_ENDPOINT_URL"], {p.rsplit("/", 1)[1]: p for p in local}, "s3://bench/tiny")
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        got, seconds, requests = batches(urls, 120, proxy)
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
    # 6 row groups read (each an open and its reads), one at a time: each request waited the latency
    assert requests >= 6 and seconds >= requests * LATENCY


def rows(output):
    return [[c.strip() for c in line.split("|")[1:-1]] for line in output.splitlines() if re.match(r"\| \S", line)]


def test_bench_data_prints_local_and_s3_rows_side_by_side(tmp_path, capsys):
    argv = ["--shards", str(shards(tmp_path)), "--seq-len", "64", "--batch", "1", "--batches", "2"]
    bench_data.main(
        [*argv, "--tokenizer", str(bench_data.DEMO), "--workers", "0", "2"]
        + ["--store", "local,s3", "--latency-ms", "0,5"]
    )
    out = capsys.readouterr().out
    table = rows(out)[1:]
    assert [(r[2], r[4], r[5]) for r in table] == [
        (w, store, latency) for w in ("0", "2") for store, latency in (("local", "-"), ("s3", "0"), ("s3", "5"))
    ]
    for r in table:
        assert float(r[6].replace(",", "")) > 0 and float(r[7]) > 0
        assert (r[9] == "-") == (r[4] == "local") and (r[4] == "local" or int(r[9].replace(",", "")) > 0)


def test_bench_startup_on_s3_reads_the_index_or_every_footer():
    cmd = [sys.executable, "-m", "benchmarks.bench_startup", "--s3", "--shards", "64", "--s3-latency-ms", "0,5"]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120, check=True).stdout
    table = {(r[0], r[1].split(":")[0]): int(r[3].replace(",", "")) for r in rows(out)[1:]}
    assert sorted(table) == [(ms, kind) for ms in ("0", "5") for kind in ("_index.json", "none")]
    for ms in ("0", "5"):  # the index: a listing and one file; without it, a read of every footer
        assert table[ms, "_index.json"] < 10 and table[ms, "none"] >= 64
    assert "every start-up found the same 64 shards, row groups and footer digests" in out


def test_bench_checkpoint_s3_puts_a_step_there_complete_and_copies_the_same_bytes_down(capsys, monkeypatch):
    for key in environment("http://unused"):  # the benchmark points this process at its server: restored after
        monkeypatch.delenv(key, raising=False)
    bench_checkpoint_s3.main(["--gib", "0.002", "--files", "2", "--repeat", "1"])  # fails itself on a differing copy
    table = rows(capsys.readouterr().out)[1:]
    # GB/s to 3 significant digits: positive however slow the machine (the seconds, to 0.1 s, may read 0.0)
    assert [r[0] for r in table] == ["1"] and all(float(r[2]) > 0 and float(r[4]) > 0 for r in table)
