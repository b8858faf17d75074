"""A preflight stage's result, the table of them, and the report that holds the table and the details."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any


@dataclasses.dataclass
class Stage:
    """One row of the table: PASS or FAIL, the headline figure, the time taken; `details` are the report's
    markdown lines for the stage (what was measured, against what bound, and what to do about a FAIL)."""

    key: str  # "a" .. "i", as docs/preflight.md lists them
    name: str
    ok: bool
    figure: str
    seconds: float = 0.0
    details: list[str] = dataclasses.field(default_factory=list)

    @property
    def result(self) -> str:
        return "PASS" if self.ok else "FAIL"


def failed(key: str, name: str, error: str, seconds: float = 0.0, details: list[str] | None = None) -> Stage:
    """A stage that could not produce its figure: the error is the figure."""
    return Stage(key, name, False, error, seconds, details or [])


def read_result(path: Path, key: str, name: str, prog: str, what: str, seconds: float) -> dict[str, Any] | Stage:
    """A stage's JSON result file, or the FAIL row that says it is missing or unreadable."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        message = " ".join(str(e).split())
        error = f"{type(e).__name__}: {message}" if message else type(e).__name__
        return failed(
            key,
            name,
            f"no result from the {what} ({path}: {error})",
            seconds,
            [f"`{prog}` wrote no readable {Path(path).name}: its output above says why."],
        )


def table(stages: list[Stage]) -> str:
    """The console table: one row per stage (result, figure, time)."""
    width = max((len(f"{s.key}. {s.name}") for s in stages), default=10)
    lines = [f"{'stage':<{width}}  result  {'time':>7}  figure"]
    for s in stages:
        lines.append(f"{f'{s.key}. {s.name}':<{width}}  {s.result:<6}  {s.seconds:>6.0f}s  {s.figure}")
    return "\n".join(lines)


def markdown_table(stages: list[Stage]) -> list[str]:
    lines = ["| stage | result | figure | time |", "|---|---|---|---|"]
    for s in stages:
        figure = s.figure.replace("|", "\\|")
        lines.append(f"| {s.key}. {s.name} | **{s.result}** | {figure} | {s.seconds:.0f} s |")
    return lines
