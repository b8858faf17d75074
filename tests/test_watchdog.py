"""The watchdog (components/watchdog.py): a job whose rank stops for good, in a collective, in the loader or in a
checkpoint write, ends with exit 124 and every rank's stacks in <dump_folder>/hangs, the stuck rank's naming where it
stopped; the timeout sized from the steps' time."""

import pytest
from conftest import torchrun
from webhook_server import Webhook

from mhar_titan.components.checkpoint.testing import HANG_ENV
from mhar_titan.components.exit_codes import HUNG
from mhar_titan.components.watchdog import timeout_s


def test_the_timeout_is_the_first_steps_until_a_step_time_is_known_then_the_floor_or_a_multiple_of_the_median():
    assert timeout_s(600, 20, 1800, []) == 1800
    assert timeout_s(600, 20, 1800, [4.0, 5.0, 100.0]) == 600  # 20 x the median 5 s is under the floor
    assert timeout_s(60, 20, 1800, [4.0, 5.0, 100.0]) == 100  # one long step (a validation) moves the median little


# (site, the stuck rank, the step whose phase each rank saw last)
SITES = [("collective", 1), ("loader", 0), ("save", 1)]


@pytest.fixture(scope="module")
def webhook():
    server = Webhook()
    yield server
    server.close()


@pytest.mark.parametrize(("site", "stuck"), SITES, ids=[s for s, _ in SITES])
def test_a_rank_stuck_for_good_ends_the_job_as_hung_with_every_ranks_stacks(tmp_path, webhook, site, stuck):
    run, before = tmp_path / "run", len(webhook.posts)
    proc = torchrun(
        run,
        *("--training.steps", "5", "--checkpoint.interval", "3"),
        *("--watchdog.floor_s", "10", "--watchdog.factor", "2", "--alerts.webhook", webhook.url),
        env={HANG_ENV: f"3:{site}"},
        check=False,
        timeout=300,
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == HUNG, log[-4000:]
    stacks = {p.name: p.read_text() for p in (run / "hangs").glob("*.txt")}
    assert sorted(stacks) == ["step-3-rank-0.txt", "step-3-rank-1.txt"], log[-4000:]
    for rank in (0, 1):
        text = stacks[f"step-3-rank-{rank}.txt"]
        assert text.splitlines()[0].split(" hung: ")[1].startswith("no progress for "), text[:300]
        assert f"on rank {rank}, host " in text and "Thread" in text  # every thread's stack
        assert ("hang_forever" in text) == (rank == stuck), text
    assert "hung: no progress for" in log and f"exiting {HUNG}" in log
    assert "step 2/5" in log and "step 4/5" not in log
    # rank 0's alert, posted before its exit (rank 1 posts none)
    (alert,) = webhook.texts()[before:]
    assert alert.startswith(f"[hang] tiny CPU demo ({run}, ") and ": no progress for " in alert, alert
    assert alert.endswith(f"stacks in {run / 'hangs' / 'step-3-rank-0.txt'}"), alert
