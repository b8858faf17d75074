"""A run's checkpoint layout (components/checkpoint/layout.py): names that round-trip, and only step folders with
DCP's `.metadata` counting as complete."""

from mhar_titan.components.checkpoint import layout


def test_step_folder_names_round_trip_and_look_alikes_are_no_steps():
    for step in (0, 3, 120000):
        assert layout.step_of(layout.step_folder(step)) == step
    assert layout.step_dir("run/checkpoint", 7) == "run/checkpoint/step-7"
    for name in ("step-3.waiting-12", "step-3.download", "step-x", "step-", "xstep-3", "step-3.json", "checkpoint"):
        assert layout.step_of(name) is None, name


def test_complete_steps_counts_only_folders_with_the_marker(tmp_path):
    assert layout.complete_steps(str(tmp_path / "absent")) == []
    for step in (2, 10, 4):
        (tmp_path / layout.step_folder(step)).mkdir()
        (tmp_path / layout.step_folder(step) / layout.COMPLETE).write_bytes(b"x")
    (tmp_path / "step-6").mkdir()  # a write that never finished: data, no .metadata
    (tmp_path / "step-6" / layout.shard_name(0)).write_bytes(b"x")
    (tmp_path / "step-3.waiting-12").mkdir()  # look-alikes, each holding a marker
    (tmp_path / "step-x").mkdir()
    for name in ("step-3.waiting-12", "step-x"):
        (tmp_path / name / layout.COMPLETE).write_bytes(b"x")
    (tmp_path / "step-8").write_bytes(b"x")  # a file, not a folder
    assert layout.complete_steps(str(tmp_path)) == [2, 4, 10]
    assert layout.step_folders(str(tmp_path)) == [2, 4, 6, 8, 10]
    assert layout.is_complete(str(tmp_path / "step-2")) and not layout.is_complete(str(tmp_path / "step-6"))


def test_a_step_folders_files_and_manifests(tmp_path):
    for name in (".metadata", "__0_0.distcp", "__0_1.distcp", "__1_0.distcp", "__10_0.distcp", "notes.txt"):
        (tmp_path / name).write_bytes(b"x")
    assert layout.shard_name(1) == "__1_0.distcp"
    assert layout.saved_by(str(tmp_path), 0) == [".metadata", "__0_0.distcp", "__0_1.distcp"]
    assert layout.saved_by(str(tmp_path), 1) == ["__1_0.distcp"]
    assert layout.checkpoint_files(str(tmp_path)) == [
        ".metadata",
        "__0_0.distcp",
        "__0_1.distcp",
        "__10_0.distcp",
        "__1_0.distcp",
    ]
    assert layout.manifest_path("step-4", 1) == "step-4/checksums/rank-00001.json"
