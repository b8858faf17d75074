"""A run's checkpoints: where they lie and when one is complete (layout.py, the standard library only, for the
tools too), torchtitan's checkpoint manager with our load and retention (manager.py), the write path (sealed_save.py,
dcp_io.py, checksums.py; remote.py for a copy on object storage; space.py for the disk's room) and the test-only
seams (testing.py)."""
