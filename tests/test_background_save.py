"""Background checkpoint saves (`[checkpoint] async_mode`), in one process: a checkpoint is complete only once every
rank's checksums are on disk, retention never counts or removes one being written, a stop and the job's end wait
for it, a checkpoint process whose job is gone stops, and the test-only hold. The 2-rank jobs, a preemption during
a background write and the resume, are in tests/test_train_resume.py."""

import json
import os
import pickle
import queue
import signal
import threading
import time
from concurrent.futures import Future
from types import SimpleNamespace

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import REPO
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystem, _StoragePrefix
from torch.distributed.checkpoint.staging import DefaultStager
from torchtitan.components.checkpoint import MODEL, AsyncMode, ModelWrapper

from mhar_titan.components.checkpoint import sealed_save, testing
from mhar_titan.components.checkpoint.checksums import missing_manifests, verify_share, write_manifest
from mhar_titan.components.checkpoint.dcp_io import PinnedStaging
from mhar_titan.components.checkpoint.layout import MANIFEST_DIR, complete_steps
from mhar_titan.components.checkpoint.manager import CPTCheckpointManager, DamagedCheckpoint, verify_checkpoint
from mhar_titan.components.checkpoint.sealed_save import SealedBackgroundWriter, SealedStreamingWriter
from mhar_titan.components.preemption import PreemptionWatch
from mhar_titan.config import parse_config


def _state() -> dict:
    gen = torch.Generator().manual_seed(0)
    return {"model": {f"w{i}": torch.randn(300 + i, 200, generator=gen) for i in range(3)}, "step": 7}


def _manifest(step_dir, rank: int) -> dict:
    return json.loads((step_dir / MANIFEST_DIR / f"rank-{rank:05d}.json").read_text())


WRITERS = {
    "disabled": lambda path: SealedStreamingWriter(path, PinnedStaging(pin=False)),
    "background": SealedBackgroundWriter,
}


@pytest.mark.parametrize("writer", WRITERS)
def test_metadata_appears_only_after_every_file_and_checksum_and_is_itself_checksummed(writer, tmp_path, monkeypatch):
    step_dir = tmp_path / "step-3"
    seen = {}
    rename = FileSystem.rename

    def watched(fs, path, new_path):  # DCP's last act: the temporary .metadata renamed into place
        if str(new_path).endswith(".metadata"):
            seen["complete"] = complete_steps(str(tmp_path))
            seen["manifest"] = _manifest(step_dir, 0)
        rename(fs, path, new_path)

    monkeypatch.setattr(FileSystem, "rename", watched)
    state = _state()
    dcp.save(state, storage_writer=WRITERS[writer](str(step_dir)), checkpoint_id=str(step_dir), no_dist=True)
    assert seen["complete"] == []  # not yet complete, and already every checksum there, .metadata's included
    assert sorted(seen["manifest"]["files"]) == [".metadata", "__0_0.distcp"] and seen["manifest"]["ranks"] == 1
    assert complete_steps(str(tmp_path)) == [3]
    assert verify_share(str(step_dir), 0, 1) == ([], [])  # .metadata's checksum taken from its temporary: the same
    loaded = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}, "step": 0}
    dcp.load(loaded, checkpoint_id=str(step_dir), no_dist=True)
    assert all(torch.equal(loaded["model"][k], v) for k, v in state["model"].items()) and loaded["step"] == 7


def test_every_other_rank_writes_its_checksums_inside_its_write_before_the_gather(tmp_path, monkeypatch):
    """Rank 1 of 2: its manifest is on disk when its write_data returns (what DCP gathers before .metadata)."""
    monkeypatch.setattr(sealed_save, "_world", lambda: 2)
    step_dir = tmp_path / "step-5"
    planner, writer = DefaultSavePlanner(), SealedBackgroundWriter(str(step_dir))
    planner.set_up_planner(_state(), storage_meta=writer.storage_meta(), is_coordinator=False)
    writer.set_up_storage_writer(False, rank=1)
    plan = writer.prepare_local_plan(planner.create_local_plan())
    plan = planner.finish_plan(SimpleNamespace(**{**vars(plan), "storage_data": _StoragePrefix("__1_")}))
    writer.write_data(plan, planner).wait()
    manifest = _manifest(step_dir, 1)
    assert sorted(manifest["files"]) == ["__1_0.distcp"] and manifest["ranks"] == 2
    assert sorted(os.listdir(step_dir)) == ["__1_0.distcp", MANIFEST_DIR]  # no .metadata: rank 0 seals it


def test_a_sealed_checkpoint_missing_a_rank_checksums_is_damaged_an_older_one_unverified(tmp_path):
    sealed, older = tmp_path / "step-4", tmp_path / "step-2"
    for folder in (sealed, older):
        folder.mkdir()
        for name in (".metadata", "__0_0.distcp", "__1_0.distcp"):
            (folder / name).write_bytes(name.encode() * 100)
    write_manifest(str(sealed), 0, ranks=2)  # rank 1's is not there: deleted, or lost with its disk
    assert missing_manifests(str(sealed)) == [str(sealed / MANIFEST_DIR / "rank-00001.json")]
    problems, _ = verify_share(str(sealed), 0, 1)
    assert problems == [
        f"{sealed / MANIFEST_DIR / 'rank-00001.json'}: missing (every rank wrote its checksums "
        "before the checkpoint was complete)"
    ]
    with pytest.raises(DamagedCheckpoint, match="rank-00001.json: missing"):
        verify_checkpoint(str(sealed))
    write_manifest(str(older), 0)  # an older version's: no rank count, the same gap is only unverified
    assert missing_manifests(str(older)) == [] and verify_share(str(older), 0, 1) == ([], ["__1_0.distcp"])


def _manager(folder, keep: int = 2) -> CPTCheckpointManager:
    manager = CPTCheckpointManager.__new__(CPTCheckpointManager)
    manager.folder, manager.keep_latest_k, manager.keep_every, manager.kept_steps = str(folder), keep, 0, set()
    manager.purge_queue, manager._told_links = queue.Queue(), set()
    manager.temporary, manager._forced_step = set(), None  # no checkpoints by the clock
    manager.enable, manager.load_only, manager.async_mode = True, False, AsyncMode.ASYNC
    manager.mp = manager.purge_thread = manager.stager = None
    manager.save_future, manager.pending, manager.states = None, None, {MODEL: ModelWrapper(torch.nn.Linear(1, 1))}
    return manager


def _purged(manager) -> list[int]:
    manager._purge_stale_checkpoints()
    return sorted(int(manager.purge_queue.get().rsplit("-", 1)[1]) for _ in range(manager.purge_queue.qsize()))


def test_retention_neither_counts_nor_removes_a_checkpoint_still_being_written(tmp_path, monkeypatch):
    monkeypatch.setattr("mhar_titan.components.checkpoint.manager.dist", SimpleNamespace(get_rank=lambda: 0))
    for step in (2, 4):
        dcp.save(_state(), storage_writer=SealedBackgroundWriter(str(tmp_path / f"step-{step}")), no_dist=True)
    written = tmp_path / "step-6"  # every file and checksum written, .metadata not yet
    dcp.save(_state(), storage_writer=SealedBackgroundWriter(str(written)), no_dist=True)
    metadata = (written / ".metadata").read_bytes()
    (written / ".metadata").unlink()
    manager = _manager(tmp_path)
    assert complete_steps(str(tmp_path)) == [2, 4] and _purged(manager) == []  # 2 complete kept, 6 left alone
    (written / ".metadata").write_bytes(metadata)
    assert complete_steps(str(tmp_path)) == [2, 4, 6] and _purged(manager) == [2]


class StillWriting(Future):
    """A background save's future that records whether it was still running when the job waited on it."""

    def __init__(self, waits: list):
        super().__init__()
        self.waits = waits

    def result(self, timeout=None):
        self.waits.append("still writing" if not self.done() else "done")
        if not self.done():
            self.set_result(None)
        return super().result(timeout)


def test_a_stop_waits_for_the_background_save_then_saves_its_own_step(tmp_path):
    manager, events = _manager(tmp_path), []
    manager.save_future, manager.pending = StillWriting(events), str(tmp_path / "step-4")
    manager._flattened_model_states_sd = dict
    manager._purge_stale_checkpoints = lambda: events.append("retention")
    manager.dcp_save = lambda state, checkpoint_id, async_mode, enable_garbage_collection: events.append(
        f"saved {os.path.basename(checkpoint_id)} {async_mode.value}"
    )
    manager.save_now(5)
    assert events == ["still writing", "saved step-5 disabled", "retention"]
    # the stop at the step whose interval save is in the background: that save is the stop's checkpoint
    events.clear()
    dcp.save(_state(), storage_writer=SealedBackgroundWriter(str(tmp_path / "step-6")), no_dist=True)
    manager.save_future, manager.pending = StillWriting(events), str(tmp_path / "step-6")
    manager.save_now(6)
    assert events == ["still writing"]


def test_the_job_ends_after_its_background_save_and_fails_if_that_failed(tmp_path, caplog):
    manager, waits = _manager(tmp_path), []
    manager.save_future, manager.pending = StillWriting(waits), str(tmp_path / "step-4")
    manager.close()
    assert waits == ["still writing"] and manager.save_future is None

    failed = Future()
    failed.set_exception(OSError(28, "No space left on device"))
    manager.save_future, manager.pending = failed, str(tmp_path / "step-8")
    with pytest.raises(OSError, match="No space left"):  # the job was ending well: it fails now
        manager.close()
    manager.save_future = failed
    with caplog.at_level("ERROR"), pytest.raises(SystemExit) as exiting:
        try:
            raise SystemExit(75)  # a preempted job's exit stands; the failed save is said
        finally:
            manager.close()
    assert exiting.value.code == 75
    assert f"the background save of {tmp_path / 'step-8'} failed (OSError" in caplog.text


def test_a_checkpoint_process_whose_job_is_gone_writes_nothing_and_completes_nothing(tmp_path):
    writer = SealedBackgroundWriter(str(tmp_path / "step-9"))
    copy = pickle.loads(pickle.dumps(writer))  # as torch's checkpoint process receives it
    assert copy.owner == os.getpid()
    copy.owner = max(os.getpid(), os.getppid()) + 1  # the training process that asked for it: not our parent
    with pytest.raises(RuntimeError, match="that asked for this save is gone; stopped writing"):
        copy.write_data(None, None)
    with pytest.raises(RuntimeError, match="stopped completing"):
        copy.finish(None, [])
    assert not (tmp_path / "step-9").exists()


def _wait_for(path: str) -> None:
    deadline = time.monotonic() + 60
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.01)


def test_the_test_hold_preempts_its_job_and_holds_the_writer_until_the_job_waits(
    tmp_path, monkeypatch, own_signal_handlers
):
    checkpoint_id = str(tmp_path / "checkpoint" / "step-4")
    monkeypatch.delenv(testing.HOLD_SAVE_ENV, raising=False)
    testing.before_write(checkpoint_id, os.getpid())  # unset: nothing held
    monkeypatch.setenv(testing.HOLD_SAVE_ENV, "four")
    with pytest.raises(ValueError, match="MHAR_TEST_HOLD_SAVE='four': a step number"):
        testing.held_step()
    monkeypatch.setenv(testing.HOLD_SAVE_ENV, "4:cluster")  # held until a SIGTERM from outside
    watch = PreemptionWatch(str(tmp_path))
    os.makedirs(os.path.dirname(checkpoint_id))
    flag = f"{checkpoint_id}.signal-{os.getpid()}"
    cluster = threading.Thread(target=lambda: (_wait_for(flag), os.kill(os.getpid(), signal.SIGTERM)))
    cluster.start()
    testing.after_launch(checkpoint_id)  # returns once the SIGTERM came, which the job's handler saw too
    cluster.join()
    assert testing.held_step() == 4 and watch.local_request(check_file=False) == "SIGTERM"
    assert os.listdir(os.path.dirname(checkpoint_id)) == []
    watch = PreemptionWatch(str(tmp_path))
    monkeypatch.setenv(testing.HOLD_SAVE_ENV, "4")
    testing.after_launch(checkpoint_id.replace("step-4", "step-2"))
    assert watch.local_request(check_file=False) is None
    testing.after_launch(checkpoint_id)
    assert watch.local_request(check_file=False) == "SIGTERM"  # as a scheduler's, while the write is held

    writer = threading.Thread(target=testing.before_write, args=(checkpoint_id, os.getpid()))
    writer.start()
    assert writer.is_alive()  # it returns only once the job announces its wait (or fails after 300 s)
    testing.announce(checkpoint_id)
    writer.join(timeout=60)
    assert not writer.is_alive()
    testing.release(checkpoint_id)
    assert os.listdir(os.path.dirname(checkpoint_id)) == []


def test_the_mode_is_set_in_a_config_and_a_wrong_one_refused_in_one_line(tmp_path):
    tiny = (REPO / "configs" / "tiny_cpu.toml").read_text()
    config = tmp_path / "job.toml"
    config.write_text(tiny.replace("[checkpoint]\n", '[checkpoint]\nasync_mode = "pinned"\n'))
    with pytest.raises(ValueError) as refused:
        parse_config(["--job.config_file", str(config)])
    assert str(refused.value) == (
        f'{config}: [checkpoint] async_mode = "pinned": expected one of "disabled", "async", "async_with_pinned_mem"'
    )
    config.write_text(tiny.replace("[checkpoint]\n", '[checkpoint]\nasync_mode = "async_with_pinned_mem"\n'))
    assert parse_config(["--job.config_file", str(config)]).checkpoint.async_mode == "async_with_pinned_mem"


def test_the_pinned_stager_keeps_its_copy_where_torch_2_11_emptied_it_after_each_save(monkeypatch):
    """torch 2.11's DefaultStager._stage closes its StateDictStager after staging (simulated here on torch's own
    class): a second save then fails. Ours stages again into the same copy."""
    stage = DefaultStager._stage

    def as_in_torch_2_11(self, state_dict, **kwargs):
        staged = stage(self, state_dict, **kwargs)
        self._state_dict_stager.close()
        return staged

    monkeypatch.setattr(DefaultStager, "_stage", as_in_torch_2_11)
    state = {"w": torch.arange(6.0), "lr": 0.1}
    torchs = DefaultStager(sealed_save.pinned_stager()._config)
    torchs.stage(state).result()
    with pytest.raises(KeyError):  # KeyError: <class 'type'>, as on the H100
        torchs.stage(state).result()
    ours = sealed_save.pinned_stager()
    first = ours.stage(state).result()
    state["w"] += 1
    second = ours.stage(state).result()
    assert torch.equal(second["w"], state["w"]) and second["lr"] == 0.1
    assert first["w"].untyped_storage().data_ptr() == second["w"].untyped_storage().data_ptr()  # one copy, reused
    ours.close()
    torchs.close()
