"""Which checkpoints are loaded and which are purged: only complete ones count."""

import queue
from types import SimpleNamespace

from mhar_titan import checkpoint
from mhar_titan.checkpoint import CPTCheckpointManager, complete_steps


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
    manager.purge_queue = queue.Queue()
    monkeypatch.setattr(checkpoint, "dist", SimpleNamespace(get_rank=lambda: 0))
    manager._purge_stale_checkpoints()
    purged = []
    while not manager.purge_queue.empty():
        purged.append(int(manager.purge_queue.get().rsplit("step-", 1)[1]))
    # kept: 16, 18, 20 (last 3), 8 and 16 (every 8th), and 23 (newer than any complete one: maybe being written)
    assert sorted(purged) == [2, 4, 6, 7, 10, 12, 14]
