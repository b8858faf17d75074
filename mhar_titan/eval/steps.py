"""The pair's checkpoints as the watcher sees them while the two runs train: which steps both arms have, which
one arm has and the other has not reached yet (waited for), which were deleted by retention (keep_latest_k)
before they could be evaluated (skipped, and said so), and when both runs are finished.

Only complete checkpoints count (DCP's `.metadata` written: components/checkpoint/layout.complete_steps), and only
once settled: every file covered by the checksums the trainer writes right after the save (the export
verifies them), or, for a checkpoint without checksums, `.metadata` older than `settle` seconds. What a run
will save comes from its records (`config.resolved.toml`: `[training] steps`, `[checkpoint] interval`);
a run folder without them is still evaluated, only its end is then unknown.
"""

from __future__ import annotations

import os
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mhar_titan.components.checkpoint.checksums import file_digest, read_manifests
from mhar_titan.components.checkpoint.layout import COMPLETE, FOLDER, checkpoint_files, complete_steps, step_folder
from mhar_titan.hf.ledger import read_json

ARMS = ("control", "mhar")


@dataclass(frozen=True)
class Arm:
    """One arm's run folder and what its records say: the base it started from and its schedule's end."""

    name: str
    folder: Path
    base: str | None  # model_args.json's hf_assets_path
    final_step: int | None  # [training] steps of its latest start
    interval: int | None  # [checkpoint] interval

    def step_dir(self, step: int) -> Path:
        return self.folder / FOLDER / step_folder(step)

    def complete(self) -> list[int]:
        return complete_steps(str(self.folder / FOLDER))

    def expected(self, latest: int | None) -> set[int]:
        """The steps it saved up to `latest` by its interval, and its last step once reached."""
        if latest is None:
            return set()
        steps = set(range(self.interval, latest + 1, self.interval)) if self.interval else set()
        return steps | ({self.final_step} if self.final_step and self.final_step <= latest else set())


def read_arm(pair: Path, name: str) -> Arm:
    """The arm's run folder, refused in one line when it is not a train_cpt.py run."""
    folder = pair / name
    if not (folder / "model_args.json").is_file():
        raise ValueError(f"{folder}: not a run of train_cpt.py (no model_args.json); expected {pair}/{{control,mhar}}")
    base = read_json(str(folder / "model_args.json")).get("hf_assets_path")
    config: dict[str, Any] = {}
    resolved = folder / "config.resolved.toml"
    if resolved.is_file():
        try:
            config = tomllib.loads(resolved.read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"{resolved}: unreadable ({type(e).__name__}: {e})") from e
    final, interval = config.get("training", {}).get("steps"), config.get("checkpoint", {}).get("interval")
    return Arm(
        name, folder, base, final if isinstance(final, int) else None, interval if isinstance(interval, int) else None
    )


def read_pair(pair: Path) -> dict[str, Arm]:
    """Both arms, refused when they name different bases or schedules of different lengths (not a matched pair)."""
    if not pair.is_dir():
        raise ValueError(f"{pair}: no such pair folder (expected runs/NAME with control/ and mhar/)")
    arms = {name: read_arm(pair, name) for name in ARMS}
    control, mhar = arms["control"], arms["mhar"]
    if _where(control.base) != _where(mhar.base):
        raise ValueError(
            f"{control.folder}/model_args.json: hf_assets_path {control.base!r}, {mhar.folder}/model_args.json: "
            f"{mhar.base!r}: the arms must start from the same base to be compared (and to give one base column)"
        )
    if None not in (control.final_step, mhar.final_step) and control.final_step != mhar.final_step:
        raise ValueError(
            f"[training] steps: {control.final_step} in {control.folder}/config.resolved.toml, {mhar.final_step} in "
            f"{mhar.folder}/config.resolved.toml: the watcher pairs the arms step by step, their schedules must match"
        )
    return arms


def _where(path: str | None) -> str | None:
    return os.path.realpath(path) if path and "://" not in path else path


def base_folder(arms: dict[str, Arm]) -> tuple[Path | None, str]:
    """The HF base both arms started from, as a local folder lm-eval can read, or None and why there is none."""
    base = arms["control"].base
    if not base:
        return None, "the runs record no hf_assets_path"
    if "://" in base:
        return None, f"the base {base} is not a local folder (copy it to local disk to evaluate it, or --no-base)"
    folder = Path(base)
    if not (folder / "config.json").is_file() or not list(folder.glob("*.safetensors")):
        return None, f"the runs' hf_assets_path {base} holds no HF model (config.json and safetensors): random init"
    return folder, ""


def base_identity(folder: Path) -> dict[str, Any]:
    """What makes the base the same one on a restart: its config.json, weight index and each weight file's size
    and header (a safetensors header names every tensor with its offsets)."""
    out: dict[str, Any] = {"path": str(folder.resolve()), "config.json": file_digest(str(folder / "config.json"))}
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        out["index"] = file_digest(str(index))
    out["weights"] = {p.name: p.stat().st_size for p in sorted(folder.glob("*.safetensors"))}
    return out


def checkpoint_identity(step_dir: Path) -> dict[str, Any]:
    """The checkpoint a record was evaluated from: its `.metadata` (DCP gives every save its own save_id, so a
    step saved again, e.g. after a resume from an earlier checkpoint, differs; a copy of the folder does not)."""
    path = step_dir / COMPLETE
    return {"metadata_xxh3": file_digest(str(path)), "metadata_bytes": path.stat().st_size}


def settled(step_dir: Path, settle: float, now: float | None = None) -> bool:
    """Whether a complete checkpoint can be read now: its checksums cover every file (written right after the
    save), or, without checksums, its `.metadata` is `settle` seconds old."""
    try:
        if set(checkpoint_files(str(step_dir))) <= set(read_manifests(str(step_dir))):
            return True
        return (now if now is not None else time.time()) - (step_dir / COMPLETE).stat().st_mtime >= settle
    except ValueError:
        return True  # a damaged manifest: the export's verification names it
    except OSError:
        return False  # deleted meanwhile


@dataclass
class Plan:
    """What to do with each step now: evaluate it, wait for an arm, or skip it (and why)."""

    work: list[int] = field(default_factory=list)
    waiting: dict[int, str] = field(default_factory=dict)
    skipped: dict[int, str] = field(default_factory=dict)


@dataclass
class View:
    """One arm at one poll: its complete steps, those settled, the steps whose every record is in the store, and
    the steps this watcher has seen on disk."""

    arm: Arm
    complete: set[int]
    ready: set[int]
    done: set[int]
    seen: set[int]

    @property
    def latest(self) -> int | None:
        return max(self.complete, default=None)


def plan(views: dict[str, View]) -> Plan:
    """Each step some arm has, had, was seen with or should have saved, sorted into work, waiting and skipped.
    A step is evaluated only where both arms have it (or already evaluated it): the arms are compared at the same
    step, so a step one arm has not reached yet is waited for and one it passed without keeping is skipped."""
    out = Plan()
    candidates = set().union(*(v.ready | v.done | v.seen | v.arm.expected(v.latest) for v in views.values()))
    for step in sorted(candidates):
        status = {name: _status(v, step) for name, v in views.items()}
        if all(s == "done" for s in status.values()):
            continue
        gone = [name for name, s in status.items() if s == "gone"]
        coming = [name for name, s in status.items() if s == "coming"]
        if gone:
            out.skipped[step] = "; ".join(_why_gone(views[name], step) for name in gone)
        elif coming:
            out.waiting[step] = "; ".join(_why_coming(views[name], step) for name in coming)
        else:
            out.work.append(step)
    return out


def _status(view: View, step: int) -> str:
    if step in view.done:
        return "done"
    if step in view.ready:
        return "ready"
    if step in view.complete or view.latest is None or step > view.latest:
        return "coming"  # not settled yet, or not reached yet
    return "gone"


def _why_gone(view: View, step: int) -> str:
    name = view.arm.name
    if step in view.seen or step in view.arm.expected(view.latest):
        return f"{name}'s checkpoint was deleted (retention, keep_latest_k) before it was evaluated"
    return f"{name} kept no checkpoint at step {step} (e.g. a preemption save of the other arm only)"


def _why_coming(view: View, step: int) -> str:
    if step in view.complete:
        return f"{view.arm.name}'s step {step} is complete, its checksums not yet written"
    return f"{view.arm.name} has not reached step {step} (its newest checkpoint: {view.latest})"


def finished(views: dict[str, View], now: Plan) -> bool:
    """Both runs saved their last step ([training] steps) and nothing is left to evaluate or wait for."""
    ends = [v.arm.final_step for v in views.values()]
    reached = all(end is not None and v.latest == end for end, v in zip(ends, views.values(), strict=True))
    return reached and not now.work and not now.waiting
