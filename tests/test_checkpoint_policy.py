"""Which checkpoints are loaded and which are purged: only complete ones count."""

import queue
import signal
from types import SimpleNamespace

import pytest

from mhar_titan.components.checkpoint.layout import TEMPORARY, complete_steps, temporary_steps
from mhar_titan.components.checkpoint.manager import CPTCheckpointManager


def make_folder(root, complete, partial):
    for step in complete:
        (root / f"step-{step}").mkdir()
        (root / f"step-{step}" / ".metadata").write_bytes(b"x")
        (root / f"step-{step}" / "__0_0.distcp").write_bytes(b"x")
    for step in partial:  # a write that never finished: data, no .metadata
        (root / f"step-{step}").mkdir()
        (root / f"step-{step}" / "__0_0.distcp").write_bytes(b"x")


def test_purge_keeps_the_last_k_complete_and_every_mth_and_drops_unfinished_writes(tmp_path, monkeypatch):
    make_folder(tmp_path, complete=range(2, 22, 2), partial=[7, 23])
    assert complete_steps(str(tmp_path)) == list(range(2, 22, 2))
    manager = CPTCheckpointManager.__new__(CPTCheckpointManager)
    manager.folder, manager.keep_latest_k, manager.keep_every = str(tmp_path), 3, 8
    manager.kept_steps = {4}  # the checkpoint before a spike ([spikes] keep_checkpoint_before)
    manager.temporary = set()
    manager.purge_queue = queue.Queue()
    monkeypatch.setattr("mhar_titan.components.checkpoint.manager.dist", SimpleNamespace(get_rank=lambda: 0))
    manager._purge_stale_checkpoints()
    purged = []
    while not manager.purge_queue.empty():
        purged.append(int(manager.purge_queue.get().rsplit("step-", 1)[1]))
    # kept: 16, 18, 20 (last 3), 8 and 16 (every 8th), 4 (before a spike), and 23 (newer than any complete one:
    # maybe being written)
    assert sorted(purged) == [2, 6, 7, 10, 12, 14]


def test_a_stop_file_from_an_earlier_job_is_removed_and_a_new_one_kept(tmp_path, own_signal_handlers):
    import os
    import time

    from mhar_titan.components.preemption import MARKER_FILE, STOP_FILE, PreemptionWatch

    watch = PreemptionWatch(str(tmp_path))
    (tmp_path / MARKER_FILE).write_text("{}")
    (tmp_path / STOP_FILE).touch()
    old = time.time() - 3600
    os.utime(tmp_path / STOP_FILE, (old, old))
    watch.clear_stale_marker()
    assert not (tmp_path / MARKER_FILE).exists() and not (tmp_path / STOP_FILE).exists()
    (tmp_path / STOP_FILE).touch()  # written by the launcher while this job starts: a real request
    watch.clear_stale_marker()
    assert (tmp_path / STOP_FILE).exists()
    assert watch.local_request() == "stop file"
    watch.mark(12, "stop file")
    assert not (tmp_path / STOP_FILE).exists()
    assert '"step": 12' in (tmp_path / MARKER_FILE).read_text()


def test_sigusr1_to_a_worker_is_a_stop_request(tmp_path, own_signal_handlers):
    import os

    from mhar_titan.components.preemption import PreemptionWatch

    watch = PreemptionWatch(str(tmp_path))
    assert watch.local_request() is None
    os.kill(os.getpid(), signal.SIGUSR1)
    assert watch.local_request() == "SIGUSR1"


@pytest.mark.parametrize("keep_latest_k", [2, 0])
def test_only_the_newest_temporary_checkpoint_stays_until_a_regular_one_is_newer(tmp_path, monkeypatch, keep_latest_k):
    """The clock's checkpoints ([checkpoint] interval_minutes) count apart from keep_latest_k (0: every regular one
    kept): the newest stays while it is the newest checkpoint, the others go, and the folder's list forgets them."""
    make_folder(tmp_path, complete=[2, 3, 4, 6, 7, 8, 9], partial=[10])
    (tmp_path / TEMPORARY).write_text('{"steps": [3, 7, 9, 10]}')  # 10: a temporary one still being written
    manager = CPTCheckpointManager.__new__(CPTCheckpointManager)
    manager.folder, manager.keep_latest_k, manager.keep_every = str(tmp_path), keep_latest_k, 0
    manager.kept_steps, manager.temporary = set(), temporary_steps(str(tmp_path))
    manager.purge_queue, manager._told_links = queue.Queue(), set()
    monkeypatch.setattr("mhar_titan.components.checkpoint.manager.dist", SimpleNamespace(get_rank=lambda: 0))
    manager._purge_stale_checkpoints()
    purged = sorted(int(manager.purge_queue.get().rsplit("step-", 1)[1]) for _ in range(manager.purge_queue.qsize()))
    # regular 2, 4, 6, 8: the last 2 (or all); temporary 9 is newer than any regular one, 10 may be being written
    assert purged == ([2, 3, 4, 7] if keep_latest_k == 2 else [3, 7])
    assert temporary_steps(str(tmp_path)) == manager.temporary == {9, 10}
    # once a regular checkpoint is newer, the temporary ones go too
    make_folder(tmp_path, complete=[12], partial=[])
    manager._purge_stale_checkpoints()
    purged = sorted(int(manager.purge_queue.get().rsplit("step-", 1)[1]) for _ in range(manager.purge_queue.qsize()))
    assert 9 in purged and 10 in purged and temporary_steps(str(tmp_path)) == set()


def test_purge_leaves_a_symlinked_step_folder_and_its_target_alone_and_says_so(tmp_path, monkeypatch, caplog):
    folder, archive = tmp_path / "checkpoint", tmp_path / "archive"
    folder.mkdir()
    archive.mkdir()
    make_folder(folder, complete=[4, 6, 8], partial=[])
    make_folder(archive, complete=[2], partial=[])
    (folder / "step-2").symlink_to(archive / "step-2")  # moved to other storage by hand
    manager = CPTCheckpointManager.__new__(CPTCheckpointManager)
    manager.folder, manager.keep_latest_k, manager.keep_every = str(folder), 2, 0
    manager.kept_steps, manager.temporary = set(), set()
    manager.purge_queue, manager._told_links = queue.Queue(), set()
    monkeypatch.setattr("mhar_titan.components.checkpoint.manager.dist", SimpleNamespace(get_rank=lambda: 0))
    with caplog.at_level("INFO"):
        manager._purge_stale_checkpoints()
        manager._purge_stale_checkpoints()
    purged = [manager.purge_queue.get() for _ in range(manager.purge_queue.qsize())]
    assert purged == [str(folder / "step-4")] * 2  # never step-2, which torchtitan would log as deleted
    told = [r.message for r in caplog.records if "symbolic link" in r.message]
    assert told == [f"{folder / 'step-2'} is a symbolic link (to {archive / 'step-2'}): retention leaves it alone"]
