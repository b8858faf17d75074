"""Checkpoints kept in object storage, `[checkpoint] folder = "s3://..."`, against a real S3 server (moto's, through
s3fs): through train_cpt.py on 2 CPU ranks, the copies on the store, the relaunch on an empty run folder that
resumes from them bit for bit, a failed upload, and the prefixes a run refuses (components/checkpoint/remote.py).
"""

import json
import os
from pathlib import Path

import pytest
import torch
from conftest import torchrun
from s3_server import SERVERS, s3_server

from benchmarks.s3_proxy import S3Proxy
from data.store import StoreError
from mhar_titan.components.checkpoint.remote import CLAIM, RemoteCheckpoints
from mhar_titan.components.checkpoint.testing import FAIL_UPLOAD_ENV
from mhar_titan.components.tensorboard_scalars import read_scalars
from mhar_titan.hf.run import load_run_checkpoint

ARGS = (
    *("--training.steps", "7", "--checkpoint.interval", "2", "--checkpoint.keep_latest_k", "2"),
    *("--validation.no-enable", "--lr_scheduler.total_steps", "12", "--lr_scheduler.warmup_steps", "2"),
)


ONE_RANK = ("--training.global_batch_size", "8")  # 2 ranks x 4 windows, as 2 microbatches on 1 rank


def on_store(fs, url: str) -> dict[str, bytes]:
    """{path below url: its bytes}."""
    root = url.removeprefix("s3://")
    return {p[len(root) + 1 :]: fs.cat_file(p) for p in fs.find(root)}


def on_disk(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def weights(run: Path, step: int) -> dict[str, torch.Tensor]:
    return {n: p.detach() for n, p in load_run_checkpoint(str(run), step).named_parameters()}


@pytest.mark.parametrize("server", SERVERS)
def test_checkpoints_on_s3_are_the_ones_on_disk_and_an_empty_run_folder_resumes_from_them_exactly(tmp_path, server):
    url = "s3://ckpt/pair/control"
    with s3_server(server) as fs:
        fs.mkdir("ckpt")
        first = tmp_path / "node-a"
        torchrun(first, *ARGS, "--checkpoint.folder", url, "--checkpoint.async_mode", "async_with_pinned_mem")
        kept = on_store(fs, url)
        steps = sorted({name.split("/")[0] for name in kept if name.startswith("step-")})
        assert steps == ["step-6", "step-7"]  # retention there as in the run folder: step 4 went at step 7
        for step in steps:  # every file and checksum of the checkpoint, the bytes on disk
            local = on_disk(first / "checkpoint" / step)
            assert {n.split("/", 1)[1]: b for n, b in kept.items() if n.startswith(f"{step}/")} == local
        for record in ("fingerprint.json", "model_args.json", "starts.jsonl", "config.resolved.toml"):
            assert kept[record] == (first / record).read_bytes()
        run_id = json.loads(kept[CLAIM])["run_id"]
        assert json.loads((first / "remote.json").read_text()) == {"url": url, "run_id": run_id}

        # A relaunch on another node: an empty run folder, and the store without step 7 (its upload never ended).
        fs.rm_file("ckpt/pair/control/step-7/.metadata")
        second = tmp_path / "node-b"
        proc = torchrun(second, *ARGS, "--checkpoint.folder", url)
        log = proc.stdout + proc.stderr
        assert f"{url}/step-6: copied into {second}/checkpoint/step-6" in log
        assert "checksums verified" in log
        assert sorted(p.name for p in (second / "checkpoint").iterdir()) == ["step-6", "step-7"]
        assert RemoteCheckpoints(url, str(second / "checkpoint"), str(second)).complete_steps() == [6, 7]
        assert json.loads((second / "remote.json").read_text())["run_id"] == run_id
        # --checkpoint.load_step: a step the run folder lacks comes from the store the same way; a store that fails
        # meanwhile (every GET of a shard dropped) stops the job at start-up in one line, leaving no partial copy.
        third = tmp_path / "node-c"
        at_6 = ("--checkpoint.load_step", "6", "--training.steps", "6", "--checkpoint.folder", url, *ONE_RANK)
        drop = lambda method, path: "drop" if method == "GET" and path.endswith(".distcp") else None  # noqa: E731
        with S3Proxy(os.environ["AWS_ENDPOINT_URL"], fault=drop) as proxy:
            proc = torchrun(third, *ARGS, *at_6, nproc=1, env={"AWS_ENDPOINT_URL": proxy.url}, check=False)
        log = proc.stdout + proc.stderr
        assert proc.returncode == 2 and "Traceback" not in log
        assert f"StoreError: {url}/step-6: copying it into {third}/checkpoint/step-6 failed" in log
        assert [p.name for p in (third / "checkpoint").iterdir()] == []
        proc = torchrun(third, *ARGS, *at_6, nproc=1)
        log = proc.stdout + proc.stderr
        assert f"{url}/step-6: copied into {third}/checkpoint/step-6" in log
        assert f"The run resumes from its checkpoint {third}/checkpoint/step-6 (step 6)" in log
    # Resumed from the store's step 6: step 7 as the uninterrupted run had it, bit for bit.
    assert read_scalars(second, "train/loss") == {7: read_scalars(first, "train/loss")[7]}
    ours, theirs = weights(second, 7), weights(first, 7)
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs) and ours.keys() == theirs.keys()
    starts = (second / "starts.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in starts] == [0, 6]  # the run's record, copied, and this start


@pytest.mark.parametrize("server", SERVERS)
def test_a_failed_last_upload_fails_the_job_and_the_relaunch_puts_it_there(tmp_path, server):
    url = "s3://ckpt/failing"
    with s3_server(server) as fs:
        fs.mkdir("ckpt")
        run = tmp_path / "run"
        background = ("--checkpoint.async_mode", "async")
        proc = torchrun(run, *ARGS, "--checkpoint.folder", url, *background, env={FAIL_UPLOAD_ENV: "7:1"}, check=False)
        log = proc.stdout + proc.stderr
        assert proc.returncode != 0
        assert f"{url}/step-7: the upload failed on rank 1 (OSError: the store refused the upload" in log
        assert log.count("the store lacks the run's last checkpoint (the run folder has it)") == 2  # once a rank
        assert "failed on rank 0" not in log  # rank 0 waited for rank 1's share and says why it stopped
        store = RemoteCheckpoints(url, str(run / "checkpoint"), str(run))
        assert store.complete_steps() == [4, 6]  # step 7: rank 0's share there, no .metadata: not complete
        assert fs.exists("ckpt/failing/step-7") and not fs.exists("ckpt/failing/step-7/.metadata")
        assert sorted(p.name for p in (run / "checkpoint").iterdir()) == ["step-6", "step-7"]

        # Nothing left to train: step 7 goes up, all of it from rank 0 on 1 rank (the same global batch).
        proc = torchrun(run, *ARGS, "--checkpoint.folder", url, *ONE_RANK, nproc=1)
        assert f"{run}/checkpoint/step-7 (step 7)" in proc.stdout + proc.stderr
        assert store.complete_steps() == [6, 7]
        assert on_store(fs, url + "/step-7") == on_disk(run / "checkpoint" / "step-7")


@pytest.mark.parametrize("server", SERVERS)
def test_a_prefix_of_another_run_or_of_other_objects_is_refused_before_any_work(tmp_path, server):
    with s3_server(server) as fs:
        fs.mkdir("ckpt")
        fs.pipe_file("ckpt/corpus/shard.parquet", b"not a checkpoint")
        proc = torchrun(tmp_path / "a", *ARGS, "--checkpoint.folder", "s3://ckpt/corpus", nproc=1, check=False)
        assert proc.returncode == 2
        refusal = "s3://ckpt/corpus holds shard.parquet but no _RUN.json: not a run's checkpoints"
        assert refusal in proc.stdout + proc.stderr
        assert fs.find("ckpt/corpus") == ["ckpt/corpus/shard.parquet"]

        mine = RemoteCheckpoints("s3://ckpt/mine", str(tmp_path / "mine" / "checkpoint"), str(tmp_path / "mine"))
        assert mine.attach() == []  # an empty prefix: claimed for this run
        claim = json.loads(fs.cat_file("ckpt/mine/" + CLAIM))
        assert mine.attach() == []  # the same run again: its own claim
        (tmp_path / "mine" / "fingerprint.json").write_text("{}")  # a run of its own
        theirs = RemoteCheckpoints("s3://ckpt/mine", str(tmp_path / "b" / "checkpoint"), str(tmp_path / "b"))
        (tmp_path / "b").mkdir()
        (tmp_path / "b" / "fingerprint.json").write_text("{}")
        with pytest.raises(ValueError, match=rf"holds the checkpoints of a run \(run {claim['run_id']}, .*holds a "):
            theirs.attach()
        (tmp_path / "b" / "remote.json").write_text(json.dumps({"url": "s3://ckpt/mine", "run_id": "other"}))
        with pytest.raises(ValueError, match=r"holds the checkpoints of another run .* \(run other\)"):
            theirs.attach()
        with pytest.raises(StoreError, match=r"^s3://nosuchbucket/run: listing: the bucket .nosuchbucket. does not"):
            RemoteCheckpoints("s3://nosuchbucket/run", str(tmp_path / "c" / "ck"), str(tmp_path / "c")).attach()
