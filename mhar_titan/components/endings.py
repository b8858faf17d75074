"""How each job of a run ended, and whether its launcher starts it again.

Every ending is classified by the job's exit code (components/exit_codes.py) and recorded in
`<dump_folder>/endings.jsonl` (time, host, code, class, step, rank, cause): finished, refused, data_exhausted,
lock_lost, preempted (requeued as before), stopped (a hook's own code), hung (the watchdog's stacks in hangs/) and
crashed (an error, whose rank writes crashes/step-N-rank-R.json as it dies; or a signal). A crashed or hung job is
started again from its last complete checkpoint within a budget (`[job] max_restarts` within
`restart_window_minutes`, after `restart_backoff_s` doubled at each restart in the window); the same failure at the
same step twice in a row is not. Refusals, a lost run folder and the rest are never retried.

The standard library and data.atomic only: the launchers ask through `python -m mhar_titan.restarts`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import time
from typing import Any

from data.atomic import write_text
from mhar_titan.components.exit_codes import DATA_EXHAUSTED, HUNG, LOCK_LOST, REFUSED, REQUEUE

ENDINGS_FILE = "endings.jsonl"
CRASHES = "crashes"  # in the run folder: one file per rank that died of an error
HANGS = "hangs"  # the watchdog's (components/watchdog.py)
RESTARTED = ("crashed", "hung")
CLASSES = {0: "finished", REFUSED: "refused", DATA_EXHAUSTED: "data_exhausted", LOCK_LOST: "lock_lost"}
CLASSES |= {REQUEUE: "preempted", HUNG: "hung", 1: "crashed"}


def classify(code: int) -> str:
    """An exit code's class: the codes above, `stopped` for a hook's own (3 to 125), `crashed` for the rest (an
    uncaught error is 1; a signal reads 128 + N from a shell)."""
    if code in CLASSES:
        return CLASSES[code]
    return "stopped" if 3 <= code <= 125 else "crashed"


def record_crash(dump_folder: str, rank: int, step: int, error: BaseException) -> None:
    """A rank dying of an error says what and where, for its launcher's decision and the run's record."""
    line = str(error).strip().splitlines()
    entry = {
        "time": time.time(),
        "host": socket.gethostname(),
        "rank": rank,
        "pid": os.getpid(),
        "step": step,
        "cause": f"{type(error).__name__}: {line[0] if line else ''}".strip(),
    }
    path = os.path.join(dump_folder, CRASHES, f"step-{step}-rank-{rank}.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    write_text(path, json.dumps(entry))


def _evidence(dump_folder: str, kind: str, since: float) -> dict[str, Any]:
    """The step, rank and cause of a crash or a hang this launch left (the earliest rank's), or nothing."""
    folder = os.path.join(dump_folder, CRASHES if kind == "crashed" else HANGS)
    found = []
    for name in os.listdir(folder) if os.path.isdir(folder) else []:
        path = os.path.join(folder, name)
        if os.path.getmtime(path) < since or not name.startswith("step-"):
            continue
        if name.endswith(".json") and kind == "crashed":
            with open(path) as f:
                found.append(json.load(f))
        elif name.endswith(".txt") and kind == "hung":
            with open(path) as f:
                first = f.readline().strip()
            step, rank = name[len("step-") : -len(".txt")].split("-rank-")
            cause = "hung " + first.rsplit(", ", 1)[-1]  # "after <phase> of step N", the same at every such hang
            found.append({"time": os.path.getmtime(path), "step": int(step), "rank": int(rank), "cause": cause})
    if not found:
        return {}
    first = min(found, key=lambda e: (e["time"], e["rank"]))
    return {"step": first["step"], "rank": first["rank"], "cause": first["cause"]}


def read_endings(dump_folder: str) -> list[dict[str, Any]]:
    path = os.path.join(dump_folder, ENDINGS_FILE)
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _append(dump_folder: str, previous: list[dict[str, Any]], ending: dict[str, Any]) -> None:
    os.makedirs(dump_folder, exist_ok=True)
    text = "".join(json.dumps(e) + "\n" for e in [*previous, ending])
    write_text(os.path.join(dump_folder, ENDINGS_FILE), text)


def record_ending(dump_folder: str, code: int, step: int, cause: str) -> None:
    """Rank 0 of a job that chose its end (finished, preempted, a source run out, a hook's stop), as it ends; a
    crash or a hang is recorded by the launcher (`decide`), a refusal or a lost run folder nowhere (the folder
    is not this job's to write)."""
    ending = {"time": time.time(), "host": socket.gethostname(), "code": code, "class": classify(code)}
    _append(dump_folder, read_endings(dump_folder), ending | {"step": step, "rank": 0, "cause": cause})


@dataclasses.dataclass(frozen=True)
class Decision:
    restart: bool
    delay_s: float
    line: str
    exhausted: bool = False  # a failure that the budget, or its repetition, leaves unrestarted


def decide(
    dump_folder: str,
    code: int,
    launched: float,
    max_restarts: int,
    window_s: float,
    backoff_s: float,
    now: float | None = None,
) -> Decision:
    """The ending of the job launched at `launched` that exited with `code`, recorded; whether to start it again."""
    now = time.time() if now is None else now
    kind = classify(code)
    ending = {"time": now, "host": socket.gethostname(), "code": code, "class": kind, "step": None, "rank": None}
    ending |= {"cause": f"exit code {code}"} | (_evidence(dump_folder, kind, launched) if kind in RESTARTED else {})
    previous = read_endings(dump_folder)
    _append(dump_folder, previous, ending)
    what = f"{kind} (exit {code})"
    if ending["step"] is not None:
        what += f" at step {ending['step']}, rank {ending['rank']}: {ending['cause']}"
    if kind not in RESTARTED:
        return Decision(False, 0.0, f"{what}: not restarted")
    last = previous[-1] if previous else None
    if last and ending["step"] is not None and all(last.get(k) == ending[k] for k in ("class", "step", "cause")):
        return Decision(False, 0.0, f"{what}, twice in a row: not restarted", exhausted=True)
    recent = [e for e in previous if e["class"] in RESTARTED and now - e["time"] <= window_s]
    if len(recent) >= max_restarts:
        return Decision(
            False,
            0.0,
            f"{what}: not restarted, {len(recent)} restarts within {window_s / 60:g} minutes already "
            f"([job] max_restarts = {max_restarts})",
            exhausted=True,
        )
    delay = backoff_s * 2 ** len(recent)
    return Decision(True, delay, f"{what}: restart {len(recent) + 1} of {max_restarts} in {delay:g} s")
