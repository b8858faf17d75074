"""A job's TOML values are checked against their fields' types before torchtitan parses anything: tyro only
warns on a mistyped default and keeps it (`enable = "false"` ran as true), so every mistake is refused at
start, all of a file's at once, each naming the file, section, key and value as written."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO
from torchtitan.config import ConfigManager

from mhar_titan.components.run_record import to_toml
from mhar_titan.config import CONFIG_MODULE, parse_config
from mhar_titan.config_check import check_config_file

TINY = (REPO / "configs" / "tiny_cpu.toml").read_text()


def _variant(tmp_path: Path, old: str, new: str, name: str = "bad.toml") -> Path:
    """tiny_cpu.toml with the one line `old` (under its section header) replaced by `new`."""
    assert TINY.count(old) == 1, old
    path = tmp_path / name
    path.write_text(TINY.replace(old, new))
    return path


def _refused(path: Path, *overrides: str) -> list[str]:
    with pytest.raises(ValueError) as caught:
        parse_config(["--job.config_file", str(path), *overrides])
    return str(caught.value).splitlines()


def test_string_booleans_in_ema_and_validation_are_refused_naming_file_section_and_key(tmp_path):
    bad = _variant(tmp_path, "[ema]\nenable = true", '[ema]\nenable = "false"')
    bad.write_text(bad.read_text().replace("[validation]\nenable = true", '[validation]\nenable = "false"'))
    lines = _refused(bad)
    assert lines == [
        f'{bad}: [ema] enable = "false": expected a boolean (true or false), got a string',
        f'{bad}: [validation] enable = "false": expected a boolean (true or false), got a string',
    ]


def test_a_string_for_steps_is_refused_by_name(tmp_path):
    bad = _variant(tmp_path, "\nsteps = 150\n", '\nsteps = "4"\n')
    assert _refused(bad, "--training.max_norm", "2.0") == [
        f'{bad}: [training] steps = "4": expected an integer, got a string'
    ]


@pytest.mark.parametrize(
    "old, new, message",
    [
        ("\nseed = 0\n", "\nseed = 1.5\n", "[data] seed = 1.5: expected an integer, got a float"),
        ("\nseed = 0\n", "\nseed = true\n", "[data] seed = true: expected an integer, got a boolean"),
        ("beta = 0.98 ", "every = 2.0\nbeta = 0.98 ", "[ema] every = 2.0: expected an integer, got a float"),
    ],
    ids=["float-seed", "bool-seed", "float-every"],
)
def test_a_float_or_a_boolean_for_an_int_is_refused(tmp_path, old, new, message):
    bad = _variant(tmp_path, old, new)
    assert _refused(bad) == [f"{bad}: {message}"]


def test_typod_keys_and_sections_are_refused_naming_the_closest_known_one(tmp_path):
    bad = _variant(tmp_path, "\nfreq = 25 ", "\nfreqq = 25 ")
    bad.write_text(bad.read_text().replace("[lr_scheduler]", "[lr_sheduler]") + "\nema_beta = 0.9\n")
    assert _refused(bad) == [
        f'{bad}: [validation] freqq = 25: unknown key in [validation]; did you mean "freq"?',
        f"{bad}: [lr_sheduler]: unknown section; did you mean [lr_scheduler]?",
        f"{bad}: [mhar] ema_beta = 0.9: unknown key in [mhar]",  # appended under the last header, [mhar]
    ]


def test_arrays_with_elements_of_the_wrong_type_are_refused(tmp_path):
    bad = _variant(tmp_path, '"code:heldout=code"]', '"code:heldout=code", 3]')
    bad.write_text(bad.read_text().replace("max_bad_steps = 5 ", "max_bad_steps = [5] "))
    assert _refused(bad) == [
        f"{bad}: [training] max_bad_steps = [5]: expected an integer, got an array of integers",
        f'{bad}: [data] validation_sets = ["docstrings:heldout=docstrings", "code:heldout=code", 3]: expected an '
        "array of strings, got an array of strings and integers",
    ]


def test_literal_choices_and_scalars_for_sections_are_refused(tmp_path):
    bad = _variant(tmp_path, '\ndtype = "float32"', '\ndtype = "fp32"')
    bad.write_text("ema = 5\n" + bad.read_text().replace("[ema]\nenable = true\nbeta = 0.98", ""))
    assert _refused(bad) == [
        f"{bad}: ema = 5: expected a table [ema], got an integer",
        f'{bad}: [training] dtype = "fp32": expected one of "bfloat16", "float32"',
    ]


def test_a_toml_config_module_that_the_command_line_overrides_is_refused(tmp_path):
    bad = _variant(tmp_path, 'custom_config_module = "mhar_titan.config"', 'custom_config_module = "other.config"')
    (line,) = _refused(bad)
    assert line.startswith(f'{bad}: [job] custom_config_module = "other.config": not used, the sections come')
    # named on the command line, the module overrides the TOML's as any command-line setting does
    explicit = parse_config(["--job.config_file", str(bad), "--job.custom_config_module", CONFIG_MODULE])
    assert explicit.job.custom_config_module == CONFIG_MODULE


@pytest.mark.parametrize("name", sorted(p.name for p in (REPO / "configs").glob("*.toml")))
def test_every_repo_config_and_its_resolved_form_pass(tmp_path, name):
    argv = ["--job.config_file", str(REPO / "configs" / name), f"--job.custom_config_module={CONFIG_MODULE}"]
    check_config_file(argv, ConfigManager())
    config = parse_config(argv[:2])
    resolved = tmp_path / "config.resolved.toml"  # what a run folder records, and a resume may be given
    resolved.write_text(to_toml(config))
    check_config_file(["--job.config_file", str(resolved), argv[2]], ConfigManager())
    assert parse_config(["--job.config_file", str(resolved)]).training.steps == config.training.steps


def test_torchrun_of_train_cpt_exits_naming_the_file_section_and_key(tmp_path):
    """The production entry point (launch/torchrun.sh): the message reaches the job's output, alone, and the job
    exits 2 at once."""
    bad = _variant(tmp_path, "[ema]\nenable = true", '[ema]\nenable = "false"')
    bad.write_text(bad.read_text().replace("\nfreq = 25 ", "\nfreqq = 25 "))  # fails fast before the fix too
    cmd = [str(REPO / "launch" / "torchrun.sh"), "--nproc", "1", str(bad), "--job.dump_folder", str(tmp_path / "run")]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHON": sys.executable}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output[-3000:]
    assert "Traceback" not in output and "ChildFailedError" not in output
    assert f'{bad}: [ema] enable = "false": expected a boolean (true or false), got a string' in output, output[-3000:]
    assert re.search(rf'{re.escape(str(bad))}: \[validation\] freqq = 25: unknown key.*"freq"', output)
    assert not (tmp_path / "run").exists()  # refused before the job wrote anything
