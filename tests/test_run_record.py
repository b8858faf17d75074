"""The run folder's record of a start: the resolved config reproduces the job's settings."""

import dataclasses
import json

from conftest import REPO

from mhar_titan.components.run_record import environment, to_toml
from mhar_titan.config import parse_config

OVERRIDES = [
    "--data.mixture",
    "docstrings=0.6:assets/tiny/corpus,code=0.4:assets/tiny/code",
    "--training.steps",
    "17",
    "--optimizer.lr",
    "1.5e-3",
    "--training.max_norm",
    "inf",
    "--mhar.enable",
    "--compile.components",
    "model,loss",
    "--job.description",
    'quotes " and \\ and ü',
]


def test_the_resolved_config_passed_back_gives_the_same_settings(tmp_path):
    first = parse_config(["--job.config_file", str(REPO / "configs" / "tiny_cpu.toml"), *OVERRIDES])
    path = tmp_path / "config.resolved.toml"
    path.write_text(to_toml(first))
    again = parse_config(["--job.config_file", str(path)])
    want, got = dataclasses.asdict(first), dataclasses.asdict(again)
    want["job"].pop("config_file"), got["job"].pop("config_file")
    assert got == want
    assert again.data.mixture == ["docstrings=0.6:assets/tiny/corpus", "code=0.4:assets/tiny/code"]
    assert again.training.max_norm == float("inf") and again.mhar.enable and again.training.steps == 17


def test_the_environment_names_versions_devices_and_commit():
    env = environment(world_size=2)
    assert env["torch"] and env["torchtitan"] == "0.2.2" and env["world_size"] == 2 and env["devices"]
    assert env["mhar_titan_commit"] is None or len(env["mhar_titan_commit"].split("-")[0]) == 40
    json.dumps(env)  # plain data
