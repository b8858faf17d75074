"""lm-evaluation-harness for the pair (pair.py): the requested tasks are resolved and built, datasets loaded, once
and before anything is exported (an 8B export takes minutes and 16 GB), then every exported arm is evaluated
on those same Task objects.

Offline (HF_DATASETS_OFFLINE), a task whose dataset is not in the local HF datasets cache fails when lm-eval
builds it (datasets.load_dataset raises a ConnectionError): that, and an unknown task name, become a
TaskRefused naming the task and its dataset, before any export. Passing the built Task objects to
`simple_evaluate` (lm-eval's TaskManager.load takes them as they are) loads each dataset once, not once per
arm and weights; simple_evaluate re-applies the same settings and fewshot seed to them on every call and
rebuilds their requests, so every evaluation starts from the same state.
"""

from __future__ import annotations

import argparse
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
from huggingface_hub.errors import LocalEntryNotFoundError

from mhar_titan.eval.tasks import TASK

try:  # the optional `eval` extra (pip install -e '.[eval]')
    import lm_eval
    from lm_eval.api.group import Group
    from lm_eval.api.task import Task
    from lm_eval.tasks import TaskManager
except ImportError:  # the command refuses to run (load_tasks); the rest of the package imports without it
    lm_eval = None

EXTRA = "needs the eval extra: pip install -e '.[eval]' (lm-eval 0.4.13 and transformers)"


class TaskRefused(ValueError):
    """A requested task that cannot run here (unknown, or its dataset not loadable): refused before any export."""


@dataclass
class Tasks:
    """The requested tasks, built once: the TaskManager that knows them and the Task/Group objects to evaluate."""

    names: list[str]
    manager: TaskManager
    built: list[Task | Group]  # datasets loaded


def one_line(error: BaseException) -> str:
    """An exception as one line: its type and message, whitespace collapsed (CLIs print one line)."""
    message = " ".join(str(error).split())
    return f"{type(error).__name__}: {message}" if message else type(error).__name__


def load_tasks(names: list[str], include: Path) -> Tasks:
    """Every task in `names` resolved by lm-eval (its registry, or `include`) and built, its dataset loaded.

    Only lm-eval's own index of several thousand YAML files takes seconds to build: when every name is one of
    ours (`include`), it is not built.
    """
    if lm_eval is None:
        raise ValueError(EXTRA)
    if not names:
        raise TaskRefused("--tasks names no task")
    manager = TaskManager(include_path=str(include), include_defaults=False)
    if not set(names) <= set(manager.all_tasks):
        manager = TaskManager(include_path=str(include))
    unknown = [n for n in names if n not in manager.all_tasks]
    if unknown:
        raise TaskRefused(f"--tasks: {', '.join(unknown)} not known to lm-eval (nor among this project's: {TASK})")
    built: list[Task | Group] = []
    for name in names:
        try:
            loaded = manager.load(name)
        except Exception as e:  # lm-eval, datasets and task code raise many kinds: each becomes one line
            raise TaskRefused(_refusal(name, e, manager)) from e
        groups = loaded.get("groups", {})
        built += [groups[name]] if name in groups else list(loaded["tasks"].values())  # a tag: its tasks
    try:
        manager.load(built)  # lm-eval's check that no task comes twice (arc_easy and its group ai2_arc)
    except ValueError as e:
        raise TaskRefused(f"--tasks: {e}") from e
    return Tasks(names, manager, built)


def _refusal(name: str, error: Exception, manager: TaskManager) -> str:
    """Why task `name` cannot be built, in one line naming the task (the failing one of a group) and its dataset."""
    task, dataset = _failing_task(error) or (name, _dataset_of(getattr(manager.task_index.get(name), "cfg", None)))
    if task != name:
        task = f"{task} (of {name})"
    if _unreachable(error):
        if datasets.config.HF_HUB_OFFLINE:
            return (
                f"task {task} needs the dataset {dataset}, which is not in the local HF datasets cache (offline); "
                "run lm-eval once with network, or copy the cache (HF_DATASETS_CACHE), then retry"
            )
        return f"task {task} needs the dataset {dataset}, which could not be downloaded ({one_line(error)})"
    return f"task {task} (dataset {dataset}) could not be built: {one_line(error)}"


def _failing_task(error: BaseException) -> tuple[str, str] | None:
    """The task being built when `error` was raised, and its dataset: lm-eval builds a group's tasks in one call,
    so the task is the innermost Task on the traceback (its __init__ or download)."""
    for frame, _ in reversed(list(traceback.walk_tb(error.__traceback__))):
        owner = frame.f_locals.get("self")
        config = getattr(owner, "_config", None) if isinstance(owner, Task) else None
        if config is not None and getattr(config, "task", None):
            return str(config.task), _dataset_of(vars(config))
    return None


def _dataset_of(config: dict[str, Any] | None) -> str:
    path, name = (config or {}).get("dataset_path"), (config or {}).get("dataset_name")
    if not path:
        return "(none named in its config)"
    return f"{path} ({name})" if name else str(path)


def _unreachable(error: BaseException | None) -> bool:
    """Whether `error`, or what it was raised from, is datasets or huggingface_hub failing to reach the Hub:
    a ConnectionError (offline mode raises OfflineModeIsEnabled, one of them) or a file not in the local cache."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, (ConnectionError, TimeoutError, LocalEntryNotFoundError)):
            return True
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return False


def run_harness(folder: Path, tasks: Tasks, args: argparse.Namespace) -> dict[str, Any]:
    """lm-eval on one exported folder and the already built tasks: {"results": {task: ...}, "samples": {...}}."""
    dtype = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[args.dtype]
    out = lm_eval.simple_evaluate(
        model="hf",
        model_args=f"pretrained={folder},trust_remote_code=True,dtype={dtype}",
        tasks=tasks.built,
        num_fewshot=args.num_fewshot,
        batch_size=args.batch_size,
        device=args.device,
        limit=args.limit,
        log_samples=True,
        task_manager=tasks.manager,
    )
    return {"results": out["results"], "samples": out["samples"]}
