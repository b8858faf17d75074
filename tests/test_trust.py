"""What a resume trusts, in one process: checkpoint checksums, the run fingerprint, data-only reads of
non-tensor checkpoint entries, and a stop request with checkpointing off."""

import json
import os
from types import SimpleNamespace

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from mhar_titan.components import fingerprint
from mhar_titan.components.checkpoint import checksums
from mhar_titan.components.checkpoint.checksums import verify_share, without_torch_crc32, write_manifest
from mhar_titan.components.checkpoint.layout import MANIFEST_DIR
from mhar_titan.components.checkpoint.manager import DamagedCheckpoint, DataOnlyLoadPlanner, verify_checkpoint
from mhar_titan.components.hooks import Step
from mhar_titan.components.preemption import Preemption
from mhar_titan.config import parse_config
from mhar_titan.model.args import FLAVORS
from mhar_titan.trainer import CPTTrainer


def fake_checkpoint(folder, ranks: int = 2):
    """A DCP-like step folder: rank r's shards `__r_0.distcp`, and rank 0's `.metadata`."""
    folder.mkdir()
    (folder / ".metadata").write_bytes(b"metadata")
    for r in range(ranks):
        (folder / f"__{r}_0.distcp").write_bytes(bytes(range(256)) * (r + 3))
    return folder


def test_checksums_find_a_flipped_bit_and_a_changed_size_in_any_rank_share(tmp_path):
    step = fake_checkpoint(tmp_path / "step-4")
    for rank in range(2):
        write_manifest(str(step), rank)
    assert sorted(os.listdir(step / MANIFEST_DIR)) == ["rank-00000.json", "rank-00001.json"]
    for world in (1, 2, 3):  # each file is checked by exactly one rank, whatever the rank count
        shares = [verify_share(str(step), r, world) for r in range(world)]
        assert all(share == ([], []) for share in shares)

    data = bytearray((step / "__1_0.distcp").read_bytes())
    data[100] ^= 0x01
    (step / "__1_0.distcp").write_bytes(bytes(data))
    problems = [p for r in range(3) for p in verify_share(str(step), r, 3)[0]]
    assert len(problems) == 1 and "__1_0.distcp: xxh3_128" in problems[0]
    with pytest.raises(DamagedCheckpoint, match="__1_0.distcp"):
        verify_checkpoint(str(step))

    (step / "__1_0.distcp").write_bytes(bytes(data[:-1]))
    assert "1023 bytes, 1024 when saved" in verify_share(str(step), 0, 1)[0][0]
    (step / "__1_0.distcp").unlink()
    assert "recorded in the checksums but missing" in verify_share(str(step), 0, 1)[0][0]


def test_files_without_checksums_are_reported_unverified_and_bad_manifests_are_problems(tmp_path):
    step = fake_checkpoint(tmp_path / "step-2")
    assert verify_share(str(step), 0, 1) == ([], [".metadata", "__0_0.distcp", "__1_0.distcp"])
    verify_checkpoint(str(step))  # loads, with a warning
    write_manifest(str(step), 1)  # rank 0 was stopped before writing its manifest
    assert verify_share(str(step), 0, 1) == ([], [".metadata", "__0_0.distcp"])
    (step / MANIFEST_DIR / "rank-00001.json").write_text('{"rank": 1, "files": []}')
    problems, _ = verify_share(str(step), 0, 1)
    assert "rank-00001.json: not a checksum manifest (KeyError" in problems[0]


def test_chunked_checksums_name_the_damaged_bytes_and_older_whole_file_manifests_still_verify(tmp_path, monkeypatch):
    monkeypatch.setattr(checksums, "CHUNK_BYTES", 300)  # rank 1's 1024-byte file: 4 chunks, the last short
    step = fake_checkpoint(tmp_path / "step-6")
    for rank in range(2):
        write_manifest(str(step), rank)
    entry = json.loads((step / MANIFEST_DIR / "rank-00001.json").read_text())["files"]["__1_0.distcp"]
    assert entry["chunk_bytes"] == 300 and len(entry["xxh3_128_chunks"]) == 4
    assert verify_share(str(step), 0, 1) == ([], [])
    data = bytearray((step / "__1_0.distcp").read_bytes())
    data[1000] ^= 0x80  # in the last chunk, bytes 900-1024
    (step / "__1_0.distcp").write_bytes(bytes(data))
    problems, _ = verify_share(str(step), 0, 1)
    assert len(problems) == 1 and "__1_0.distcp: xxh3_128 of bytes 900-1024" in problems[0]

    # A manifest from before the chunks: one digest of the whole file, as written then.
    old = {"rank": 1, "algorithm": "xxh3_128", "files": {"__1_0.distcp": {"bytes": 1024, "xxh3_128": "0" * 32}}}
    (step / MANIFEST_DIR / "rank-00001.json").write_text(json.dumps(old))
    problems, _ = verify_share(str(step), 0, 1)
    assert len(problems) == 1 and "__1_0.distcp: xxh3_128 " in problems[0] and "0" * 32 in problems[0]
    old["files"]["__1_0.distcp"]["xxh3_128"] = checksums.file_digest(str(step / "__1_0.distcp"))
    (step / MANIFEST_DIR / "rank-00001.json").write_text(json.dumps(old))
    assert verify_share(str(step), 0, 1) == ([], [])
    old["files"]["__1_0.distcp"] = {"bytes": 1024, "chunk_bytes": 300, "xxh3_128_chunks": ["0" * 32]}
    (step / MANIFEST_DIR / "rank-00001.json").write_text(json.dumps(old))
    assert "1 chunk digests for 1024 bytes in chunks of 300" in verify_share(str(step), 0, 1)[0][0]


def test_saves_write_without_torch_crc32_and_load_back_exactly(tmp_path):
    state = {"w": torch.arange(1000.0), "step": 3}
    before = torch.serialization.get_crc32_options()
    with without_torch_crc32():
        assert torch.serialization.get_crc32_options() is False
        dcp.save(state, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    assert torch.serialization.get_crc32_options() == before
    back = {"w": torch.zeros(1000), "step": 0}
    dcp.load(back, checkpoint_id=str(tmp_path / "ckpt"), planner=DataOnlyLoadPlanner(), no_dist=True)
    assert torch.equal(back["w"], state["w"]) and back["step"] == 3


class Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_non_tensor_checkpoint_entries_are_read_as_data_only(tmp_path):
    marker = tmp_path / "ran"
    state = {"step": 7, "lr": {"base_lrs": [0.1], "betas": (0.9, 0.95)}, "w": torch.arange(4.0), "bad": Payload(marker)}
    dcp.save(state, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    assert not marker.exists()

    plain = {"step": 0, "lr": {"base_lrs": [0.0], "betas": (0.0, 0.0)}, "w": torch.zeros(4)}
    dcp.load(plain, checkpoint_id=str(tmp_path / "ckpt"), planner=DataOnlyLoadPlanner(), no_dist=True)
    assert plain["step"] == 7 and plain["lr"] == {"base_lrs": [0.1], "betas": (0.9, 0.95)}
    assert torch.equal(plain["w"], torch.arange(4.0))

    with pytest.raises(CheckpointException, match="'bad' is not plain data"):  # DCP's is a BaseException
        dcp.load({"bad": None}, checkpoint_id=str(tmp_path / "ckpt"), planner=DataOnlyLoadPlanner(), no_dist=True)
    assert not marker.exists()
    dcp.load({"bad": None}, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)  # DCP's default planner runs it
    assert marker.exists()


def job(*overrides: str):
    return parse_config(["--job.config_file", "configs/tiny_cpu_mhar.toml", *overrides])


def print_of(*overrides: str, shards=("a/x.parquet", "a/y.parquet"), batch: int = 8) -> dict:
    config = job(*overrides)
    args = FLAVORS["tiny"]
    args = type(args)(**{**args.__dict__, "mhar": config.mhar})
    return json.loads(json.dumps(fingerprint.fingerprint(config, args, list(shards), batch)))


def test_fingerprint_names_every_differing_setting_and_allows_only_what_is_asked():
    run = print_of("--mhar.num_blocks", "2", "--mhar.num_heads", "8")
    assert fingerprint.check(run, print_of("--mhar.backend", "torch", "--mhar.stats_freq", "1"), [], "run") == []
    assert fingerprint.check(run, print_of(shards=("b/x.parquet", "b/y.parquet")), [], "run") == []  # moved corpus

    with pytest.raises(ValueError) as refused:
        fingerprint.check(run, print_of("--mhar.num_blocks", "4", "--mhar.num_heads", "4"), [], "The run in R")
    lines = str(refused.value).splitlines()
    assert lines[1:3] == ["  model.mhar.num_blocks: 2 in the run, 4 now", "  model.mhar.num_heads: 8 in the run, 4 now"]
    assert "of a run cannot change" in lines[-1] and "allow_changes" not in lines[-1]
    with pytest.raises(ValueError, match="model cannot be allowed"):
        fingerprint.check(run, run, ["model"], "run")

    changed = print_of("--optimizer.lr", "1e-3", "--data.seed", "1", batch=16, shards=("a/x.parquet",))
    with pytest.raises(ValueError) as refused:
        fingerprint.check(run, changed, ["schedule"], "run")
    message = str(refused.value)
    assert "data.seed: 0 in the run, 1 now" in message and "data.num_shards: 2 in the run, 1 now" in message
    assert "schedule.global_batch_size: 8 in the run, 16 now" in message
    assert message.endswith("--checkpoint.allow_changes data")
    allowed = fingerprint.check(run, changed, ["data", "schedule"], "run")
    assert "schedule.lr: 0.003 in the run, 0.001 now" in allowed and len(allowed) == 5

    longer = print_of("--training.steps", "300")  # the decay end follows training.steps without total_steps
    with pytest.raises(ValueError, match="schedule.decay_end: 150 in the run, 300 now\n  .decay_end is"):
        fingerprint.check(run, longer, [], "run")


def test_the_control_fingerprint_ignores_unused_routing_settings_and_records_history(tmp_path):
    control = print_of("--mhar.no-enable")
    assert control["model"]["mhar"] == {"enable": False}
    assert fingerprint.check(control, print_of("--mhar.no-enable", "--mhar.num_blocks", "4"), [], "run") == []
    fingerprint.record(str(tmp_path), control, 0, [])
    fingerprint.record(str(tmp_path), control, 40, ["data.seed: 0 in the run, 1 now"])
    recorded = fingerprint.read(str(tmp_path))
    assert [h["step"] for h in recorded["history"]] == [40]
    (tmp_path / fingerprint.FILE).write_text("[]")
    with pytest.raises(ValueError, match="not a run fingerprint"):
        fingerprint.read(str(tmp_path))


def test_a_stop_request_with_checkpointing_off_is_not_a_requeue():
    trainer, preemption = CPTTrainer.__new__(CPTTrainer), Preemption()
    preemption.checkpointing = job("--checkpoint.no-enable").checkpoint.enable
    trainer.checkpointer = SimpleNamespace(save_now=lambda step: pytest.fail("nothing can be saved"))
    with pytest.raises(RuntimeError, match="checkpointing is off, so nothing was saved and the job is not requeued"):
        trainer._carry_out([preemption.stop(12, "SIGTERM")], Step(12, last=False, log=False))


@pytest.mark.parametrize("max_norm", ["0", "-1", "nan"])
def test_a_clipping_norm_that_zeroes_every_gradient_is_refused(max_norm):
    with pytest.raises(ValueError, match=r"\[training\] max_norm = .* must be > 0"):
        job("--training.max_norm", max_norm)


def test_last_save_in_hf_is_refused_pointing_to_hf_export():
    with pytest.raises(ValueError, match=r"last_save_in_hf is not supported.*python -m mhar_titan.hf export RUN_DIR"):
        job("--checkpoint.last_save_in_hf", "--checkpoint.last_save_model_only")


@pytest.mark.parametrize("groups", ["model", "data,shedule"])
def test_allow_changes_names_only_groups_that_may_change(groups):
    with pytest.raises(ValueError, match=r"allow_changes = .* cannot be allowed \(choose from base, data, schedule"):
        job("--checkpoint.allow_changes", groups)
