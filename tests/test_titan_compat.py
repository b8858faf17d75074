"""Every reach into torchtitan's internals is in mhar_titan/titan_compat.py and still there in the torchtitan
installed: a missing one fails here, naming it and its torchtitan file, rather than somewhere in a run."""

import torchtitan.train as titan_train

from mhar_titan import titan_compat


def test_every_torchtitan_internal_the_project_reaches_is_there():
    assert titan_compat.missing() == []


def test_a_missing_internal_is_named_with_its_torchtitan_file(monkeypatch):
    monkeypatch.delattr(titan_train, "CheckpointManager")
    problems = titan_compat.missing()
    assert len(problems) == 1 and "torchtitan.train.CheckpointManager" in problems[0]
    assert "torchtitan/train.py" in problems[0]
