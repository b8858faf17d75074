"""Every command line's `--help`: it exits 0, describes the command in whole sentences and every argument (each
option, positional and subcommand has a help text), and says so where it passes `--section.key value` on to
the config; `python -m` of the commands prints no Python warning (issue 23).

The parsers are built in-process: each command's main() is called with ArgumentParser's parse methods
replaced by one that hands back the parser it was called on, so what is checked is the parser main() builds.
"""

import argparse
import importlib
import inspect
import subprocess
import sys
from types import ModuleType

import pytest
from conftest import REPO

PACKAGES = ("mhar_titan", "data", "benchmarks", "chaos")
# `python -m NAME` -> the module whose main() builds its parser (a package's __main__.py calls it)
CLIS = {
    "mhar_titan.hf": "mhar_titan.hf.__main__",
    "mhar_titan.compare": "mhar_titan.compare.pair",
    "mhar_titan.eval": "mhar_titan.eval.cli",
    "mhar_titan.plan": "mhar_titan.plan",
    "mhar_titan.config_reference": "mhar_titan.config_reference",
    "mhar_titan.preflight": "mhar_titan.preflight.cli",
    "mhar_titan.preflight.probe": "mhar_titan.preflight.probe",
    "mhar_titan.preflight.exports": "mhar_titan.preflight.exports",
    "mhar_titan.preflight.evaluate": "mhar_titan.preflight.evaluate",
    "mhar_titan.components.tensorboard_scalars": "mhar_titan.components.tensorboard_scalars",
    "mhar_titan.preview": "mhar_titan.preview",
    "data.prepare": "data.prepare",
    "data.index": "data.index",
    "data.demo_corpus": "data.demo_corpus",
    "chaos.soak": "chaos.soak",
    **{
        f"benchmarks.{name}": f"benchmarks.{name}"
        for name in (
            "bench_checkpoint_io",
            "bench_checkpoint_s3",
            "bench_checkpoint_stall",
            "bench_checksums",
            "bench_data",
            "bench_routing",
            "bench_startup",
            "bench_step",
            "bpe128k",
            "compile_report",
            "float8_parity",
            "hf_export_check",
            "hf_smoke",
            "resume_spread",
            "sdpa_determinism",
            "step_floor",
            "trace_summary",
        )
    },
}
# a few commands run for real, the one issue 23 saw warn among them (seconds each)
RUN = ("mhar_titan.hf", "data.demo_corpus", "mhar_titan.components.tensorboard_scalars")


class Parsed(Exception):
    def __init__(self, parser: argparse.ArgumentParser, known: bool):
        super().__init__(parser.prog)
        self.parser, self.known = parser, known


def call_main(module: ModuleType, argv: list[str], monkeypatch) -> None:
    """module.main(argv), or with sys.argv set for a main() that takes no arguments."""
    if inspect.signature(module.main).parameters:
        module.main(argv)
    else:
        monkeypatch.setattr(sys, "argv", [module.__name__, *argv])
        module.main()


def built_parser(name: str, monkeypatch) -> tuple[argparse.ArgumentParser, bool]:
    """The parser `name`'s main() builds, and whether it takes unknown arguments (config overrides)."""
    module = importlib.import_module(CLIS[name])

    def capture(known: bool):
        def parse(self, *args, **kwargs):
            raise Parsed(self, known)

        return parse

    with monkeypatch.context() as m:
        m.setattr(argparse.ArgumentParser, "parse_args", capture(False))
        m.setattr(argparse.ArgumentParser, "parse_known_args", capture(True))
        with pytest.raises(Parsed) as got:
            call_main(module, [], m)
    return got.value.parser, got.value.known


def undocumented(parser: argparse.ArgumentParser, where: str) -> list[str]:
    """What `parser` (and its subcommands) leaves without a description or a help text."""
    bad = []
    description = (parser.description or "").strip()
    if not description.endswith((".", ")")):  # empty, or a first docstring line cut mid-sentence
        bad.append(f"{where}: description {description!r}")
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        if isinstance(action, argparse._SubParsersAction):
            bad += [f"{where} {c.dest}: no help" for c in action._choices_actions if not c.help]
            for command, sub in action.choices.items():
                bad += undocumented(sub, f"{where} {command}")
            continue
        if not action.help or action.help == argparse.SUPPRESS:
            bad.append(f"{where} {'/'.join(action.option_strings) or action.dest}: no help")
    return bad


def subcommands(parser: argparse.ArgumentParser) -> list[str]:
    return [c for a in parser._actions if isinstance(a, argparse._SubParsersAction) for c in a.choices]


def test_every_cli_is_listed_and_runs_with_python_m():
    found = set()
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            if "add_argument" in path.read_text():
                parts = path.relative_to(REPO).with_suffix("").parts
                found.add(".".join(parts))
    assert found == set(CLIS.values())
    for name in CLIS:
        path = REPO.joinpath(*name.split("."))
        entry = path / "__main__.py" if path.is_dir() else path.with_suffix(".py")
        assert 'if __name__ == "__main__":' in entry.read_text(), entry


@pytest.mark.parametrize("name", CLIS)
def test_help_describes_every_argument(name, monkeypatch, capsys):
    parser, known = built_parser(name, monkeypatch)
    assert undocumented(parser, name) == []
    if known:  # further arguments are the job's overrides: the help says so
        assert "--section.key" in parser.format_help()
    module = importlib.import_module(CLIS[name])
    for argv in (["--help"], *([c, "--help"] for c in subcommands(parser))):
        with pytest.raises(SystemExit) as done:
            call_main(module, argv, monkeypatch)
        assert done.value.code == 0, argv
        assert capsys.readouterr().out.startswith("usage: "), argv


def test_python_m_prints_no_warning():
    """runpy warns ("found in sys.modules after import of package ... but prior to execution") when a
    package's __init__ imports the module `python -m` is about to run: importing every command's packages
    must load none of the commands. Then a few commands run for real, RuntimeWarnings made errors."""
    runs = {n: f"{n}.__main__" if REPO.joinpath(*n.split(".")).is_dir() else n for n in CLIS}
    packages = sorted({run.rsplit(".", 1)[0] for run in runs.values()})
    code = f"import importlib, sys\nfor p in {packages!r}: importlib.import_module(p)\nprint(' '.join(sys.modules))"
    loaded = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert not set(runs.values()) & set(loaded.stdout.split())

    procs = {
        name: subprocess.Popen(
            [sys.executable, "-W", "error::RuntimeWarning", "-m", name, "--help"],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name in RUN
    }
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0 and out.startswith("usage: "), (name, err)
        assert "Warning" not in err, (name, err)
