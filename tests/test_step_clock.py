"""The log line's pace and ETA (mhar_titan/components/step_metrics.py, StepClock) on a fake clock, and the step's
scalars read back by name (StepScalars)."""

import pytest
import torch

import mhar_titan.components.step_metrics as step_metrics
from mhar_titan.components.hooks import SKIP_STEP, Scalar, reduce_scalars
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
    # a step with loss parts and routing statistics (one process: reduced as given)
    named = {
        SKIP_STEP: Scalar(torch.tensor(False), "max"),
        "stop": Scalar(torch.tensor(1.0), "max"),
        "loss_max": Scalar(torch.tensor(2.5), "max"),
        "grad_norm": Scalar(torch.tensor(0.75)),
        "loss": Scalar(torch.tensor(3.0), "sum"),
        "loss_parts": Scalar(torch.tensor([2.0, 0.5, 8.0]), "sum"),
        "routing_stats": Scalar(torch.arange(6.0).reshape(3, 2), "mean"),
    }
    reduced = reduce_scalars(named, None)
    assert list(reduced) == list(named) and reduced["routing_stats"].shape == (3, 2)
    assert reduced[SKIP_STEP].dtype == torch.float32 and reduced["loss"].dtype == torch.float64
    v = scalars.unpack(scalars.pack(reduced).tolist())
    assert (v[SKIP_STEP], v["stop"], v["loss_max"]) == (0.0, 1.0, 2.5)
    assert v["grad_norm"] == 0.75 and v["loss"] == 3.0 and v["loss_parts"] == (2.0, 0.5, 8.0)
    assert v["routing_stats"] == tuple(range(6))
    # a step with fewer values: the layout is the one packed last
    v = scalars.unpack(scalars.pack(reduce_scalars({"grad_norm": Scalar(torch.tensor(1.0))}, None)).tolist())
    assert v == {"grad_norm": 1.0}
    with pytest.raises(ValueError, match="the layout has 1"):
        scalars.unpack([0.0] * 2)
    with pytest.raises(ValueError, match="reduce = 'avg'"):
        Scalar(torch.zeros(()), "avg")
