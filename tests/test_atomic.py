"""The one atomic write of small files: whole or not at all, the mode `open` gives, no temporary left."""

import os

import pytest

from data.atomic import write_text


def test_a_write_replaces_the_file_whole_with_opens_mode(tmp_path):
    path = tmp_path / "record.json"
    write_text(path, "old")
    write_text(path, "new")
    assert path.read_text() == "new"
    assert [p.name for p in tmp_path.iterdir()] == ["record.json"]
    probe = tmp_path / "probe"
    probe.write_text("")
    assert path.stat().st_mode & 0o777 == probe.stat().st_mode & 0o777  # not mkstemp's 0600


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "record.json"
    write_text(path, "old")

    def refuse(*_):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(OSError):
        write_text(path, "new")
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["record.json"]
