"""What a run folder records at each start: the resolved config, the environment, the architecture.

- `config.resolved.toml`: the whole JobConfig as this job parsed it (the TOML and every command-line
  override); `train_cpt.py --job.config_file RUN/config.resolved.toml` runs the same settings.
- `environment.json`: versions (Python, torch, triton, torchtitan, this project's git commit), the
  devices, the world size, the command line: what a result depends on besides the config.
- `starts.jsonl`: one line per start (time, step, world size, commit, any deliberate changes with their
  old and new values), the run's history.
- `model_args.json`: the architecture and `[mhar]` settings, for the tools (hf export).
Written by rank 0, each file atomically.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # annotations only: the comparison reads the run's records without loading torchtitan
    from torchtitan.config import JobConfig

from data.atomic import write_text

MODEL_ARGS_FILE = "model_args.json"
CONFIG_FILE = "config.resolved.toml"
ENVIRONMENT_FILE = "environment.json"
STARTS_FILE = "starts.jsonl"
REPO = Path(__file__).resolve().parents[2]


def _toml_value(value: Any, where: str) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return ("inf" if value > 0 else "-inf") if math.isinf(value) else repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string: JSON's escapes are TOML's
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v, where) for v in value) + "]"
    raise TypeError(f"{where}: {type(value).__name__} values have no TOML form here")


def to_toml(config: Any) -> str:
    """A dataclass config as TOML: one table per section (nested sections as [a.b]); None values are left
    out, as TOML has no null (their default is None too, or they could not have been set from TOML)."""
    lines: list[str] = []

    def table(obj: Any, name: str) -> None:
        fields = [(f.name, getattr(obj, f.name)) for f in dataclasses.fields(obj)]
        scalars = [(k, v) for k, v in fields if v is not None and not dataclasses.is_dataclass(v)]
        lines.append(f"[{name}]")
        lines.extend(f"{k} = {_toml_value(v, f'{name}.{k}')}" for k, v in scalars)
        lines.append("")
        for k, v in fields:
            if dataclasses.is_dataclass(v):
                table(v, f"{name}.{k}")

    for f in dataclasses.fields(config):
        table(getattr(config, f.name), f.name)
    return "\n".join(lines)


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def git_commit() -> str | None:
    """This project's commit (with '-dirty' when the tracked files differ), or None outside a checkout."""
    try:
        run = {"cwd": REPO, "capture_output": True, "text": True, "timeout": 10}
        commit = subprocess.run(["git", "rev-parse", "HEAD"], check=True, **run).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], check=True, **run).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return commit + ("-dirty" if dirty.strip() else "")


def environment(world_size: int) -> dict[str, Any]:
    cuda = torch.cuda.is_available()
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": _version("triton"),
        "torchtitan": _version("torchtitan"),
        "mhar_titan_commit": git_commit(),
        "host": platform.node(),
        "devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else ["cpu"],
        "world_size": world_size,
        "argv": sys.argv,
    }


def record_start(
    job_config: JobConfig, model_args: Any, step: int, world_size: int, changes: list[str] | None = None
) -> None:
    """Rank 0, once the run's weights are settled: the files above, in the dump folder; `changes`: what this
    start changed on purpose (allow_changes) and applied, old and new values, kept in its starts.jsonl line."""
    folder = job_config.job.dump_folder
    os.makedirs(folder, exist_ok=True)
    write_text(os.path.join(folder, CONFIG_FILE), to_toml(job_config))
    env = environment(world_size)
    write_text(os.path.join(folder, ENVIRONMENT_FILE), json.dumps(env, indent=2) + "\n")
    start = {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "step": step, "world_size": world_size}
    with open(os.path.join(folder, STARTS_FILE), "a") as f:
        f.write(
            json.dumps({**start, "commit": env["mhar_titan_commit"], **({"changes": changes} if changes else {})})
            + "\n"
        )
    write_model_args(job_config, model_args)


def write_model_args(job_config: JobConfig, model_args: Any) -> None:
    """model_args.json alone (also for a seed checkpoint, which is weights to start from, not a run)."""
    base = job_config.model.hf_assets_path
    base = base if "://" in base else os.path.abspath(base)  # tools may run from another directory
    info = {"hf_assets_path": base, "args": dataclasses.asdict(model_args)}
    os.makedirs(job_config.job.dump_folder, exist_ok=True)
    write_text(os.path.join(job_config.job.dump_folder, MODEL_ARGS_FILE), json.dumps(info, indent=2))
