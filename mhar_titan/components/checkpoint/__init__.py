"""A run's checkpoints: their layout on disk (layout.py, which the tools import alone), torchtitan's checkpoint
manager with our load and retention (manager.py), the write path (sealed_save.py, dcp_io.py, checksums.py, remote.py
for a copy on object storage, space.py for the disk's room) and the test-only seams (testing.py)."""
