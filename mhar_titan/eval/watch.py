"""Evaluation while the pair runs: every kept checkpoint of both arms, raw and EMA weights, evaluated once as it
lands, with the same tasks and settings, and the HF base both arms started from evaluated once as step 0.

    python -m mhar_titan.eval runs/<pair> --watch --tasks ...   # poll until both runs have finished
    python -m mhar_titan.eval runs/<pair> --once --tasks ...    # every kept step not yet evaluated, then exit

Each poll (`--poll` seconds) reads both arms' complete, settled checkpoints (steps.py) and evaluates, oldest
step first, every step both arms have that the store (store.py) lacks: per weights and arm one export to a
scratch folder, lm-eval on it task by task, a record written as each task finishes, the export removed.
A step one arm has not reached is waited for; one deleted by retention before it was evaluated is skipped and
said so. After each step the report (progress.py) is redrawn. `--watch` stops by itself once both runs saved
their last step (`[training] steps` in their config.resolved.toml) and all is evaluated; SIGTERM or Ctrl-C
aborts the evaluation in flight, removes its export and exits (143 or 130). A restart, also after SIGKILL,
removes what a killed watcher left (its scratch exports, a record write it interrupted) and goes on from
the store: nothing finished is evaluated again. One watcher per pair: it holds `<pair>/eval/store/run.lock`
(components/run_lock.py, as a run holds its folder).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import shutil
import signal
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from mhar_titan.components.checkpoint.layout import COMPLETE
from mhar_titan.components.run_lock import RunLock
from mhar_titan.eval import steps
from mhar_titan.eval.harness import EXTRA, Tasks, load_tasks, one_line, run_harness
from mhar_titan.eval.pair import EvalFailed, exported, weights_of
from mhar_titan.eval.progress import write_report
from mhar_titan.eval.steps import ARMS, Arm, Plan, View
from mhar_titan.eval.store import Key, Store, StoreError
from mhar_titan.eval.suites import Request, requested
from mhar_titan.eval.tasks import write_task

LOCK_STALE_S = 300.0  # a watcher's lock whose heartbeat is older is taken over (its watcher died on another host)
LOCK_WAIT_S = 600.0  # a requeued SLURM job waits this long for its earlier run's lock


class Stopped(KeyboardInterrupt):
    """SIGTERM or SIGINT: raised where the watcher is, so every scratch export is removed on the way out."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class WatchRefused(ValueError):
    """Another watcher holds the pair's store, or took it over from this one."""


@contextlib.contextmanager
def stop_signals() -> Iterator[None]:
    """SIGTERM and SIGINT raise Stopped once; a second signal is ignored while the watcher cleans up."""

    def stop(signum: int, frame: Any) -> None:
        for s in (signal.SIGTERM, signal.SIGINT):
            signal.signal(s, signal.SIG_IGN)
        raise Stopped(signum)

    old = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


def settings_of(request: Request, weights: list[str], args: argparse.Namespace, base: Path | None) -> dict[str, Any]:
    """What every result of the store must share: a watcher with other settings is refused (store.py)."""
    try:
        versions = {"lm_eval": version("lm_eval"), "transformers": version("transformers")}
    except PackageNotFoundError as e:
        raise ValueError(EXTRA) from e
    shots = request.shots or {task: args.num_fewshot for task in request.names}
    return {
        "tasks": request.names,
        "suite": request.suite,
        "num_fewshot": shots,
        "metrics": request.metrics,
        "limit": args.limit,
        "batch_size": str(args.batch_size),
        "dtype": args.dtype,
        "device": args.device.split(":")[0],  # cuda:1 computes what cuda:0 does
        "weights": weights,
        "base": steps.base_identity(base) if base else None,
        **versions,
    }


def hold(folder: Path, log: Callable[[str], None]) -> RunLock:
    """The pair's store, held by this watcher; refused while another live watcher holds it."""
    lock = RunLock(str(folder), LOCK_STALE_S, LOCK_WAIT_S)
    deadline = time.time() + LOCK_WAIT_S
    while True:
        kind, why = lock.try_acquire()
        if kind == "acquired":
            taken = why.split("; took over", 1)
            log(f"[eval] {lock.path}: held by this watcher" + (f"; took over{taken[1]}" if len(taken) > 1 else ""))
            return lock
        if kind == "wait" and time.time() < deadline:
            time.sleep(5)
            continue
        raise WatchRefused(
            f"{lock.path}: another watcher is evaluating this pair ({why}); two would evaluate the same checkpoints "
            f"twice: stop it first (the lock of a watcher that died on another host is taken over once its heartbeat "
            f"is {LOCK_STALE_S:g} s old)"
        )


def scratch_folder(pair: Path, parent: str | None) -> Path:
    """The folder the watcher owns for its exports: `<pair>/eval/scratch`, or one named after the pair under
    `--scratch` (node-local disk), so that two pairs never share one."""
    if not parent:
        return pair / "eval" / "scratch"
    where = str(pair.resolve())
    return (
        Path(parent) / f"mhar-eval-{pair.resolve().name}-{hashlib.blake2b(where.encode(), digest_size=4).hexdigest()}"
    )


@dataclass
class Watch:
    """One watcher's state: the pair, its settings and store, and what it has seen, told and skipped."""

    pair: Path
    arms: dict[str, Arm]
    request: Request
    weights: list[str]
    args: argparse.Namespace
    store: Store
    lock: RunLock
    scratch: Path
    base: Path | None
    base_note: str
    tasks: Tasks | None = None
    seen: dict[str, set[int]] = field(default_factory=lambda: {a: set() for a in ARMS})
    skipped: dict[int, str] = field(default_factory=dict)
    told: set[str] = field(default_factory=set)
    identities: dict[tuple[str, int], tuple[tuple[int, int, int], dict[str, Any]]] = field(default_factory=dict)
    evaluations: int = 0
    in_flight: str = ""

    def say(self, line: str, once: bool = False) -> None:
        if once and line in self.told:
            return
        self.told.add(line)
        print(line, flush=True)

    def run(self) -> None:
        """Poll, evaluate and report until --once is done, both runs have finished, or a signal stops it."""
        self.report()
        while True:
            self.store.refresh()
            self.check_identities()
            if self.base is not None and self.evaluate_base():
                self.report()
            views, now = self.poll()
            for step in now.work:
                self.evaluate_step(step)
                self.report()
            if self.args.once:
                for step, why in now.waiting.items():
                    self.say(f"[eval] step {step} not evaluated yet: {why}; run again later")
                return
            if steps.finished(views, now):
                self.say(f"[eval] both runs finished (step {views['control'].latest}) and every kept step is evaluated")
                return
            time.sleep(self.args.poll)

    def poll(self) -> tuple[dict[str, View], Plan]:
        """Both arms as they are now, and what to do with each step (logged once per step and reason)."""
        views = {}
        for name, arm in self.arms.items():
            complete = set(arm.complete())
            ready = {s for s in complete if steps.settled(arm.step_dir(s), self.args.settle)}
            self.seen[name] |= complete
            candidates = complete | self.seen[name] | {k.step for k in self.store.records if k.arm == name}
            done = {s for s in candidates if not self.missing(name, s, self.weights)}
            views[name] = View(arm, complete, ready, done, set(self.seen[name]))
        now = steps.plan(views)
        for step, why in now.skipped.items():
            self.skipped.setdefault(step, why)
            self.say(f"[eval] step {step} skipped: {why}", once=True)
        for step, why in now.waiting.items():
            self.say(f"[eval] step {step}: waiting, {why}", once=True)
        return views, now

    def missing(self, arm: str, step: int, every_weights: list[str]) -> list[tuple[str, str]]:
        """The (weights, task) pairs of `arm` at `step` without a record."""
        records = self.store.records
        return [(w, t) for w in every_weights for t in self.request.names if Key(arm, step, w, t) not in records]

    def check_identities(self) -> None:
        """Every record of a step still on disk was evaluated from the checkpoint there now: a step saved again
        (a resume from an earlier checkpoint) is refused, naming it, rather than reported with the old results."""
        for key, record in self.store.records.items():
            if key.arm not in self.arms:
                continue
            step_dir = self.arms[key.arm].step_dir(key.step)
            try:
                stat = (step_dir / COMPLETE).stat()
            except FileNotFoundError:
                continue  # deleted by retention: its records stay valid
            signature = (stat.st_mtime_ns, stat.st_size, stat.st_ino)
            cached = self.identities.get((key.arm, key.step))
            if cached is None or cached[0] != signature:
                self.identities[(key.arm, key.step)] = cached = (signature, steps.checkpoint_identity(step_dir))
            if cached[1] != record["checkpoint"]:
                raise StoreError(
                    f"{self.store.folder / key.file_name()}: evaluated from another checkpoint of {key.arm} step "
                    f"{key.step} than {step_dir} now ({record['checkpoint']} then, {cached[1]} now: saved again, e.g. "
                    f"after a resume from an earlier checkpoint); move that step's records (step-{key.step:08d}."
                    f"{key.arm}.*) aside to evaluate the new one"
                )

    def evaluate_base(self) -> bool:
        """The base as step 0, once: lm-eval on its own folder (nothing to export). True if anything ran."""
        todo = [task for _, task in self.missing("base", 0, ["raw"])]
        if todo:
            self.say(f"[eval] base {self.base}, as step 0: {', '.join(todo)}")
        for task in todo:
            self.score(Key("base", 0, "raw", task), self.base, self.store.settings["base"])
        return bool(todo)

    def evaluate_step(self, step: int) -> None:
        """Both arms at `step`, per weights the control then MHAR, each exported once for its missing tasks."""
        for weights in self.weights:
            for arm in ARMS:
                todo = [task for _, task in self.missing(arm, step, [weights])]
                if todo and not self.evaluate_model(arm, step, weights, todo):
                    return

    def evaluate_model(self, arm: str, step: int, weights: str, todo: list[str]) -> bool:
        """One export and lm-eval on each task of `todo`; False when retention deleted the step meanwhile."""
        run = self.arms[arm]
        folder = self.scratch / f"{arm}-{weights}-step-{step}"
        self.say(f"[eval] {arm}, {weights} weights, step {step}: export and {', '.join(todo)}")
        try:
            identity = steps.checkpoint_identity(run.step_dir(step))
            with exported(self.pair, arm, step, weights, folder, self.args.dtype):
                for task in todo:
                    self.score(Key(arm, step, weights, task), folder, identity)
        except (EvalFailed, StoreError, WatchRefused):
            raise
        except Exception as e:
            if step not in run.complete():
                self.skipped[step] = f"{arm}'s checkpoint was deleted (retention, keep_latest_k) while it was evaluated"
                self.say(f"[eval] step {step} skipped: {self.skipped[step]}")
                return False
            where = f"{arm} arm, {weights} weights, step {step}, tasks {','.join(todo)}"
            raise EvalFailed(f"{where}: {one_line(e)} (scratch export removed)") from e
        return True

    def score(self, key: Key, folder: Path, checkpoint: dict[str, Any]) -> None:
        """lm-eval on one task of an exported folder, recorded once it has finished."""
        if self.lock.lost:
            raise WatchRefused(f"{self.lock.path}: taken over by another watcher; this one stops without writing")
        self.in_flight = str(key)
        began = time.perf_counter()
        try:
            scores = run_harness(folder, self.tasks.only(key.task), self.args)
        except Exception as e:
            if key.arm != "base":
                raise
            raise EvalFailed(f"base {folder}, as step 0, task {key.task}: {one_line(e)}") from e
        seconds = time.perf_counter() - began
        self.store.add(key, checkpoint, scores, seconds)
        self.evaluations += 1
        self.in_flight = ""
        values = scores["results"].get(key.task, {})
        shown = ", ".join(f"{k.removesuffix(',none')} {v:.4f}" for k, v in values.items() if _metric(k, v))
        self.say(f"[eval] {key}: {shown or 'done'} ({seconds:.1f} s)")

    def report(self) -> None:
        write_report(self.pair, self.out(), self.store, self.skipped, self.base_note)

    def out(self) -> Path:
        return Path(self.args.out) if self.args.out else self.pair / "compare"


def _metric(key: str, value: Any) -> bool:
    return "," in key and "_stderr" not in key and isinstance(value, (int, float))


def watch(pair: Path, args: argparse.Namespace) -> Watch:
    """Check everything that can be checked before the first export (the arms, tasks, weights, base, the tasks'
    datasets, the lock, the store's settings), then run the watcher; scratch and lock are released whatever
    happens. Returns the watcher (its `evaluations`: what lm-eval ran)."""
    arms = steps.read_pair(pair)
    confirm = args.confirm_run_unsafe_code
    request = requested(args.tasks, args.suite, args.num_fewshot, confirm)
    weights = weights_of(args.weights)
    base, why = (None, "not evaluated (--no-base)") if args.no_base else steps.base_folder(arms)
    settings = settings_of(request, weights, args, base)
    note = f"the HF base both arms started from ({base}), evaluated once as step 0" if base else f"empty: {why}"
    if base is None:
        print(f"[eval] no base column: {why}", flush=True)
    with tempfile.TemporaryDirectory(prefix="mhar_titan_eval_tasks_") as task_dir:
        tasks = load_tasks(request.names, write_task(Path(task_dir)), request.shots, confirm)  # datasets loaded
        store = Store(pair / "eval" / "store")
        store.folder.mkdir(parents=True, exist_ok=True)
        lock = hold(store.folder, print)
        w = Watch(
            pair, arms, request, weights, args, store, lock, scratch_folder(pair, args.scratch), base, note, tasks
        )
        try:
            with stop_signals():
                store.check_settings(settings)
                if w.scratch.exists():
                    w.say(f"[eval] {w.scratch}: removed, the scratch exports of a watcher that was killed")
                    shutil.rmtree(w.scratch)
                store.refresh()
                w.check_identities()
                w.run()
            records = f"{len(store.records)} records in {store.folder}"
            w.say(f"[eval] {w.evaluations} evaluations by this watcher, {records}; report: {w.out() / 'eval.md'}")
        except Stopped as e:
            e.in_flight, e.records = w.in_flight, len(store.records)  # for the command's one line
            raise
        finally:
            shutil.rmtree(w.scratch, ignore_errors=True)
            lock.release()
    return w
