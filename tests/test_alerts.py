"""Alerts (components/alerts.py) against a local webhook: Slack's JSON form, posted from a thread that training never
waits for, a failing webhook logged only; spikes, a crash and the finish as the hook sees them (a hang: in
tests/test_watchdog.py, from real runs)."""

import logging
import time
from types import SimpleNamespace

import pytest
from webhook_server import Webhook

from mhar_titan.components import alerts
from mhar_titan.components.hooks import Step


@pytest.fixture
def webhook():
    server = Webhook()
    yield server
    server.close()


def test_an_alert_is_slacks_json_and_sending_never_waits_for_the_webhook(webhook):
    sender = alerts.Sender(webhook.url)
    webhook.release.clear()  # the webhook answers only once the test lets it
    sender.send("first")
    sender.send("second")  # queued while the first is still unanswered: send returned at once
    deadline = time.monotonic() + 30
    while not webhook.posts and time.monotonic() < deadline:
        time.sleep(0.01)
    assert webhook.texts() == ["first"]
    webhook.release.set()
    sender.close()
    assert webhook.texts() == ["first", "second"]


def test_a_failing_webhook_is_logged_not_raised(caplog):
    with caplog.at_level(logging.WARNING, logger="mhar_titan.components.alerts"):
        assert not alerts.post("http://127.0.0.1:9/nothing-listens", "lost", timeout_s=5)
        assert not alerts.post("not a url", "lost")
    assert [r.message.split(" (")[0] for r in caplog.records] == ["alert not sent to the webhook"] * 2
    assert all(r.message.endswith(": lost") for r in caplog.records)


def test_unknown_events_are_refused_naming_them():
    with pytest.raises(ValueError, match=r"\[alerts\] events = \['finish', 'crashed'\]: crashed unknown"):
        alerts.Alerts("http://x", ["finish", "crashed"], None)


def test_spikes_a_crash_and_the_finish_as_the_hook_sees_them(webhook, monkeypatch):
    monkeypatch.setattr(alerts.dist, "get_rank", lambda: 0)
    trainer = SimpleNamespace(job_config=SimpleNamespace(job=SimpleNamespace(description="pair a", dump_folder="r")))
    spikes = SimpleNamespace(marks={})
    hook = alerts.Alerts(webhook.url, ["crash", "spike", "finish"], spikes)
    hook.set_up(trainer)
    hook.after_step(Step(11, last=False, log=False))
    spikes.marks = {"spikes/loss": 7.25, "spikes/loss_spike_score": 9.1}
    hook.after_step(Step(12, last=False, log=False))
    try:
        raise RuntimeError("NCCL error: unhandled system error")
    except RuntimeError:
        hook.close()  # as the trainer closes while the error propagates
    where = f"pair a (r, {alerts.socket.gethostname()})"
    assert webhook.texts() == [
        f"[spike] {where} step 12: loss 7.25",
        f"[crash] {where} step 12: RuntimeError: NCCL error: unhandled system error",
    ]
    finished = alerts.Alerts(webhook.url, ["finish"], spikes)
    finished.set_up(trainer)
    finished.close()
    preempted = alerts.Alerts(webhook.url, ["crash", "finish"], spikes)
    preempted.set_up(trainer)
    try:
        raise SystemExit(75)  # a preemption (or a refusal, a hook's stop): the job chose its end, no alert
    except SystemExit:
        preempted.close()
    assert webhook.texts()[2:] == [f"[finish] {where} step 0: the job finished its steps"]
