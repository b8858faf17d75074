"""`python -m mhar_titan.restarts CODE LAUNCHED CONFIG [--section.key value ...]`: the launchers' question after a job
exited with CODE (launched at the Unix time LAUNCHED): its ending recorded in the run folder, and on stdout `restart
SECONDS` (a crashed or hung job within its budget: start it again after that wait) or `stop`; the reason on stderr
as one line, and to the webhook where `[alerts]` names one (components/endings.py)."""

from __future__ import annotations

import sys

from mhar_titan.components import alerts, endings
from mhar_titan.config import parse_config

ME = "python -m mhar_titan.restarts"


def main(argv: list[str]) -> int:
    if len(argv) < 3 or not argv[0].lstrip("-").isdigit():
        print(f"usage: {ME} CODE LAUNCHED CONFIG [--section.key value ...]", file=sys.stderr)
        return 2
    code, launched, config = int(argv[0]), float(argv[1]), argv[2]
    try:
        cfg = parse_config(["--job.config_file", config, *argv[3:]])
    except (ValueError, OSError) as e:
        print(f"{ME}: {e}", file=sys.stderr)
        return 2
    job = cfg.job
    decision = endings.decide(
        job.dump_folder, code, launched, job.max_restarts, job.restart_window_minutes * 60, job.restart_backoff_s
    )
    print(f"{ME}: {job.dump_folder}: {decision.line}", file=sys.stderr)
    event = "restart" if decision.restart else "restarts_exhausted" if decision.exhausted else None
    if cfg.alerts.webhook and event in cfg.alerts.events:
        where = f"{job.description or 'mhar-titan'} ({job.dump_folder})"
        alerts.post(cfg.alerts.webhook, f"[{event}] {where}: {decision.line}")
    print(f"restart {decision.delay_s:g}" if decision.restart else "stop")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
