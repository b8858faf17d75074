"""The log line's pace and ETA (mhar_titan/components/step_metrics.py, StepClock) on a fake clock, and the step's
scalars read back by name (StepScalars)."""

import pytest
import torch

import mhar_titan.components.step_metrics as step_metrics
from mhar_titan.components.step_metrics import StepClock, StepScalars


def test_the_eta_counts_the_periodic_work_still_to_come(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(step_metrics.time, "perf_counter", lambda: now[0])
    clock = StepClock()
    clock.start(0, 100)
    clock.tick(1)  # the first step (compile) is left out
    assert clock.eta() == "?" and clock.pace(4096) == "? s/step  tokens 4,096 (1.0%)"
    for step in range(2, 11):
        now[0] += 2.0  # 2 s a step
        clock.tick(step)
    now[0] += 30.0
    clock.pause(30.0, "validation", 10)  # validation at step 10 took 30 s; it runs every 10 steps
    now[0] += 6.0
    clock.pause(6.0, "checkpoint", 50)  # a checkpoint took 6 s; every 50 steps
    assert clock.seconds_per_step() == 2.0
    # 90 steps x 2 s + 9 validations (20, ..., 100) x 30 s + 2 checkpoints (50, 100) x 6 s
    assert clock.eta_seconds() == 90 * 2.0 + 9 * 30.0 + 2 * 6.0
    assert clock.eta() == "7m42s"
    assert clock.pace(40960) == "2.00 s/step  tokens 40,960 (10.0%)"


def test_log_scalars_writes_what_the_logger_writes_one_event_per_step(tmp_path):
    """One event holding every value reads back, tag by tag and step by step, as torchtitan's
    logger's one event per value (prefixed tags included); other loggers get their own log call."""
    from torchtitan.components.metrics import BaseLogger, LoggerContainer, TensorBoardLogger

    from mhar_titan.components.step_metrics import log_scalars
    from mhar_titan.components.tensorboard_scalars import load_scalars

    class Seen(BaseLogger):
        def __init__(self):
            self.calls = []

        def log(self, metrics, step):
            self.calls.append((dict(metrics), step))

        def close(self):
            pass

    metrics = [{f"mhar_attn_gate/layer{i:02d}": 0.1 * i + step for i in range(40)} | {"loss": 2.5} for step in (0, 1)]
    for tag in (None, "x"):
        plain, ours, other = TensorBoardLogger(str(tmp_path / f"plain{tag}"), tag), LoggerContainer(), Seen()
        ours.add_logger(TensorBoardLogger(str(tmp_path / f"ours{tag}"), tag))
        ours.add_logger(other)
        for step, m in enumerate(metrics, start=1):
            plain.log(m, step)
            log_scalars(ours, m, step)
        plain.close()
        ours.close()
        assert load_scalars(tmp_path / f"ours{tag}") == load_scalars(tmp_path / f"plain{tag}")
        assert len(load_scalars(tmp_path / f"ours{tag}")) == 41
        assert other.calls == [(metrics[0], 1), (metrics[1], 2)]


def test_step_scalars_come_back_by_name_on_every_kind_of_step():
    scalars = StepScalars()
    like = torch.zeros(())
    flags = StepScalars.flags(
        like, bad=torch.tensor(False), stop=1.0, loss_max=torch.tensor(2.5), lock_lost=False, exhausted=True
    )
    # a log step with loss parts and routing statistics
    packed = scalars.pack(flags, torch.tensor(0.75), torch.tensor([3.0, 2.0, 0.5, 8.0]), torch.arange(6.0))
    v = scalars.unpack(packed.tolist())
    assert (v.bad, v.stop, v.loss_max, v.lock_lost, v.exhausted) == (False, True, 2.5, False, True)
    assert v.grad_norm == 0.75 and v.loss == 3.0 and v.parts == (2.0, 0.5, 8.0) and v.stats == list(range(6))
    # a step that logs nothing, and a log step whose loss has no parts
    assert scalars.unpack(scalars.pack(flags, torch.tensor(1.0), None, None).tolist()).loss is None
    v = scalars.unpack(scalars.pack(flags, torch.tensor(1.0), torch.tensor([4.0]), None).tolist())
    assert v.loss == 4.0 and v.parts is None and v.stats == []
    with pytest.raises(ValueError, match="the layout has 7"):
        scalars.unpack([0.0] * 8)
    with pytest.raises(ValueError, match="step flags"):
        StepScalars.flags(like, bad=0.0)
