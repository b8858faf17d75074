"""lm-evaluation-harness for the pair (pair.py): the requested tasks are resolved and built, datasets loaded, once
and before anything is exported (an 8B export takes minutes and 16 GB), then every exported arm is evaluated
on those same Task objects.

Offline (HF_DATASETS_OFFLINE), a task whose dataset is not in the local HF datasets cache fails when lm-eval
builds it (datasets.load_dataset raises a ConnectionError): that, and an unknown task name, become a
TaskRefused naming the task and its dataset, before any export. Passing the built Task objects to
`simple_evaluate` (lm-eval's TaskManager.load takes them as they are) loads each dataset once, not once per
arm and weights; simple_evaluate re-applies the same settings and fewshot seed to them on every call and
rebuilds their requests, so every evaluation starts from the same state.

Tasks that run the code the model generates (lm-eval's `unsafe_code`, e.g. humaneval, mbpp) are refused before
anything is built unless the caller confirms it (`--confirm-run-unsafe-code`, passed on to simple_evaluate).
A suite (suites.py) sets each task's own number of shots on the built tasks.
"""

from __future__ import annotations

import argparse
import numbers
import re
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
UNSAFE_FLAG = "--confirm-run-unsafe-code"
OFFLINE_HINT = "run lm-eval once with network, or copy the cache (HF_DATASETS_CACHE), then retry"
MODULE_HINT = "an evaluate module is cached under HF_HOME/modules: copy that too"
# What a sample keeps of lm-eval's log (the prompt, responses and document are dropped): enough to pair documents.
SAMPLE_KEYS = ("doc_id", "filter", "doc_hash")


class TaskRefused(ValueError):
    """A requested task that cannot run here (unknown, or its dataset not loadable): refused before any export."""


@dataclass
class Tasks:
    """The requested tasks, built once: the TaskManager that knows them and the Task/Group objects to evaluate."""

    names: list[str]
    manager: TaskManager
    built: list[Task | Group]  # datasets loaded
    by_name: dict[str, list[Task | Group]] | None = None  # what each requested name built (a tag: its tasks)

    def only(self, name: str) -> Tasks:
        """The one requested task `name`, built as it is here (an evaluation per task, one record each)."""
        return Tasks([name], self.manager, list((self.by_name or {})[name]), {name: (self.by_name or {})[name]})

    def unsafe(self) -> list[str]:
        """The built tasks that run generated code (lm-eval's check, simple_evaluate refuses them unconfirmed)."""
        return [t.task_name for t in leaves(self.built) if getattr(t, "UNSAFE_CODE", False)]


def leaves(built: list[Task | Group]) -> list[Task]:
    """The tasks lm-eval scores: a group's members, recursively; a task itself."""
    return [t for item in built for t in (item.get_all_tasks() if isinstance(item, Group) else [item])]


def one_line(error: BaseException) -> str:
    """An exception as one line: its type and message, whitespace collapsed (CLIs print one line)."""
    message = " ".join(str(error).split())
    return f"{type(error).__name__}: {message}" if message else type(error).__name__


def load_tasks(
    names: list[str], include: Path, num_fewshot: dict[str, int] | None = None, confirm_unsafe: bool = False
) -> Tasks:
    """Every task in `names` resolved by lm-eval (its registry, or `include`) and built, its dataset loaded; each
    task of `num_fewshot` given its number of shots. Tasks that run generated code are refused first unless
    `confirm_unsafe`; every task that cannot be built is named in the one refusal.

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
    code = [u for n in names for u in _unsafe(manager, n, set())]
    if code and not confirm_unsafe:
        raise TaskRefused(_unsafe_refusal(code))
    by_name, refusals = {}, []
    for name in names:
        try:
            loaded = manager.load(name)
        except Exception as e:  # lm-eval, datasets and task code raise many kinds: each becomes one line
            refusals.append(_refusal(name, e, manager))
            continue
        groups = loaded.get("groups", {})
        by_name[name] = [groups[name]] if name in groups else list(loaded["tasks"].values())  # a tag: its tasks
    if refusals:
        hints = [OFFLINE_HINT] if any(r.endswith("(offline)") for r in refusals) else []
        hints += [MODULE_HINT] if any("evaluate module" in r for r in refusals) else []
        raise TaskRefused("; ".join(dict.fromkeys(refusals + hints)))
    built = [item for name in names for item in by_name[name]]
    try:
        manager.load(built)  # lm-eval's check that no task comes twice (arc_easy and its group ai2_arc)
    except ValueError as e:
        raise TaskRefused(f"--tasks: {e}") from e
    tasks = Tasks(names, manager, built, by_name)
    if tasks.unsafe() and not confirm_unsafe:  # a task marked only in its Python code, not its YAML
        raise TaskRefused(_unsafe_refusal(tasks.unsafe()))
    for name, shots in (num_fewshot or {}).items():
        for task in leaves(by_name[name]):
            task.set_config(key="num_fewshot", value=shots)
    return tasks


def _unsafe(manager: TaskManager, name: str, seen: set[str]) -> list[str]:
    """The tasks under `name` (a task, group or tag) whose YAML says `unsafe_code`, from lm-eval's index alone."""
    entry = manager.task_index.get(name)
    if entry is None or name in seen:
        return []
    seen.add(name)
    if entry.kind.name in ("GROUP", "TAG"):
        return [u for m in _members(manager, name) for u in _unsafe(manager, m, seen)]
    return [name] if (entry.cfg or {}).get("unsafe_code") else []


def _unsafe_refusal(code: list[str]) -> str:
    return (
        f"--tasks: {', '.join(dict.fromkeys(code))} run the code the model generates (lm-eval's unsafe_code); "
        f"pass {UNSAFE_FLAG} to allow it (best in a sandbox: a container without network or credentials)"
    )


def _refusal(name: str, error: Exception, manager: TaskManager) -> str:
    """Why task `name` cannot be built, in one line naming the task (the failing one of a group) and its dataset
    (or the HF evaluate module its metric loads); the hint what to do is added once by the caller."""
    task, dataset = _failing_task(error) or (name, _dataset_of(_first_config(manager, name)))
    if task != name:
        task = f"{task} (of {name})"
    module = re.search(r"Module '([^']+)' doesn't exist on the Hugging Face Hub", str(error))
    if module:  # evaluate.load: humaneval and mbpp score with the code_eval module
        return f"task {task} needs the HF evaluate module {module[1]}, which is not in the local HF cache (offline)"
    if _unreachable(error):
        if datasets.config.HF_HUB_OFFLINE:
            return f"task {task} needs the dataset {dataset}, which is not in the local HF datasets cache (offline)"
        return f"task {task} needs the dataset {dataset}, which could not be downloaded ({one_line(error)})"
    return f"task {task} (dataset {dataset}) could not be built: {one_line(error)}"


def _first_config(manager: TaskManager, name: str) -> dict[str, Any] | None:
    """The YAML of task `name`, or of a group's or tag's first member (what names the dataset)."""
    for _ in range(10):  # groups of groups
        members = _members(manager, name)
        if not members:
            return getattr(manager.task_index.get(name), "cfg", None)
        name = members[0]
    return None


def _members(manager: TaskManager, name: str) -> list[str]:
    """A group's or tag's members by name, from lm-eval's index ([] for a task)."""
    entry = manager.task_index.get(name)
    if entry is None:
        return []
    if entry.kind.name == "GROUP":
        found = [m if isinstance(m, str) else m.get("task") for m in (entry.cfg or {}).get("task", [])]
        return [m for m in found if isinstance(m, str)]
    if entry.kind.name == "TAG":
        return sorted(n for n, e in manager.task_index.items() if name in e.tags)
    return []


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
    """lm-eval on one exported folder and the already built tasks: {"results": {task: ...}, "samples": {task:
    [lean samples]}, and lm-eval's "n-shot", "versions", "group_subtasks", "n-samples"} (what a record keeps)."""
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
        confirm_run_unsafe_code=getattr(args, "confirm_run_unsafe_code", False),
    )
    samples = {task: [lean_sample(s) for s in rows] for task, rows in out["samples"].items()}
    extra = {k: out[k] for k in ("n-shot", "versions", "group_subtasks", "n-samples") if k in out}
    return {"results": out["results"], "samples": samples, **extra}


def lean_sample(sample: dict[str, Any]) -> dict[str, Any]:
    """A logged sample less its prompt, responses and document: its ids and its metric values (as JSON numbers)."""
    metrics = sample.get("metrics") or [k for k, v in sample.items() if isinstance(v, numbers.Real) and k != "doc_id"]
    out = {k: sample[k] for k in SAMPLE_KEYS if k in sample}
    for metric in metrics:
        value = sample.get(metric)
        out[metric] = float(value) if isinstance(value, numbers.Real) else value
    return out
