"""Alerts to a webhook (`[alerts] webhook`): a JSON POST in Slack's incoming-webhook form, `{"text": ...}`, when a
job crashes, hangs, spikes or finishes, so that a pair left running over a weekend is not watched by hand.

Rank 0 alone posts, from a thread of its own: training never waits for the webhook, and a webhook that fails or is
slow is logged, never raised. A hang posts from the watchdog before its exit, waiting a few seconds at most.
`python -m mhar_titan.components.alerts URL TEXT` posts one alert (the launchers' restarts).
"""

from __future__ import annotations

import json
import logging
import queue
import socket
import sys
import threading
import urllib.request
from typing import Any

import torch.distributed as dist

from mhar_titan.components.hooks import Hook, Step

logger = logging.getLogger("mhar_titan.components.alerts")
EVENTS = ("crash", "hang", "spike", "finish", "restart", "restarts_exhausted")
TIMEOUT_S = 10.0


def post(url: str, text: str, timeout_s: float = TIMEOUT_S) -> bool:
    """One alert; whether the webhook took it (a failure is logged, never raised)."""
    body, headers = json.dumps({"text": text}).encode(), {"Content-Type": "application/json"}
    try:
        request = urllib.request.Request(url, data=body, headers=headers, method="POST")
        with urllib.request.urlopen(request, timeout=timeout_s) as answer:
            answer.read()
        return True
    except (OSError, ValueError) as e:  # URLError, HTTPError, a timeout, a malformed URL
        logger.warning(f"alert not sent to the webhook ({e}): {text}")
        return False


class Sender:
    """Posts in a daemon thread, in order; `send` never blocks."""

    def __init__(self, url: str):
        self.url, self.queue = url, queue.Queue()
        self.thread = threading.Thread(target=self._run, name="mhar-alerts", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while (text := self.queue.get()) is not None:
            post(self.url, text)
            self.queue.task_done()
        self.queue.task_done()

    def send(self, text: str) -> None:
        self.queue.put(text)

    def close(self, wait_s: float = TIMEOUT_S) -> None:
        """The alerts queued so far are sent (or given up after `wait_s`), then the thread ends."""
        self.queue.put(None)
        self.thread.join(timeout=wait_s)


class Alerts(Hook):
    """The job's alerts; `spikes` is the job's RunSpikes hook, whose marks after each step name the spikes."""

    name = "alerts"

    def __init__(self, url: str, events: list[str], spikes: Any):
        unknown = sorted(set(events) - set(EVENTS))
        if unknown:
            raise ValueError(f"[alerts] events = {events}: {', '.join(unknown)} unknown; known: {', '.join(EVENTS)}")
        self.url, self.events, self.spikes = url, set(events), spikes
        self.sender: Sender | None = None

    def set_up(self, trainer: Any) -> None:
        cfg = trainer.job_config
        self.where = f"{cfg.job.description or 'mhar-titan'} ({cfg.job.dump_folder}, {socket.gethostname()})"
        self.step = 0
        if dist.get_rank() == 0:
            self.sender = Sender(self.url)

    def alert(self, event: str, text: str) -> None:
        if self.sender is not None and event in self.events:
            self.sender.send(f"[{event}] {self.where} step {self.step}: {text}")

    def hung(self, cause: str) -> None:
        """From the watchdog, about to end the process: sent now, within the webhook's timeout."""
        if self.sender is not None and "hang" in self.events:
            post(self.url, f"[hang] {self.where} step {self.step}: {cause}", timeout_s=5.0)

    def after_step(self, step: Step) -> None:
        self.step = step.number
        marks = getattr(self.spikes, "marks", {})
        spiked = {tag[len("spikes/") :]: v for tag, v in marks.items() if not tag.endswith("_spike_score")}
        if spiked:
            self.alert("spike", ", ".join(f"{tag} {value:.4g}" for tag, value in sorted(spiked.items())))

    def close(self) -> None:
        if self.sender is None:
            return
        error = sys.exc_info()[1]
        if error is None:
            self.alert("finish", "the job finished its steps")
        elif not isinstance(error, SystemExit):
            self.alert("crash", f"{type(error).__name__}: {error}")
        self.sender.close()


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m mhar_titan.components.alerts URL TEXT")
    logging.basicConfig(level=logging.INFO)
    sys.exit(0 if post(sys.argv[1], sys.argv[2]) else 1)
