"""A new training concern added from this file alone, as docs/extending.md tells a user to add one: a hook with a
device metric (the output layer's weight norm, combined over the ranks and read back with the step's other values),
a value the spike monitor scores, a stop condition with an exit code of its own, and state in the checkpoint. The
trainer is not edited: this file is the script torchrun runs (`run(argv, hooks=[...])`, at the bottom), and the tests
read what the job left: its log lines, TensorBoard, spikes.jsonl, the checkpoint and the exit code, and a resume that
reproduces the uninterrupted job bit for bit."""

import json
import os
import shutil
import sys
from typing import Any

import pytest
import torch
from conftest import torchrun
from torch.distributed.tensor import DTensor

from mhar_titan.components import spikes
from mhar_titan.components.hooks import Hook, Request, Scalar, Step, Stop, on_device
from mhar_titan.components.tensorboard_scalars import load_scalars
from mhar_titan.main import run

STOP_EXIT = 3  # the stop condition's exit code
PROBE_SPIKE_AT = 5  # the step whose probe value jumps
STOP_AT_ENV = "EXTENSION_STOP_AT"  # the step at which rank 0 asks the job to stop
STOP_AT = 6  # of the job's 8 steps; its checkpoints: step 4 (the interval) and step 6 (the stop's)


class OutputWatch(Hook):
    """The output layer's weight norm every step and its mean over the run so far (the checkpointed state); a probe
    value that jumps once, scored for spikes; and a stop that rank 0 alone decides and every rank agrees on."""

    name = "output_watch"
    spike_scored = ("probe",)

    def __init__(self, stop_at: int):
        self.stop_at = stop_at
        self.total, self.steps = 0.0, 0  # the checkpointed state: the mean needs both from the start of the run
        self.stopping = False

    def set_up(self, trainer: Any) -> None:
        self.weight = trainer.model_parts[0].output.weight
        self.rank0 = torch.distributed.get_rank() == 0

    def scalars(self, step: Step) -> dict[str, Scalar]:
        local = self.weight.to_local() if isinstance(self.weight, DTensor) else self.weight
        wiggle = 0.01 * ((step.number * 7) % 5 - 2)
        probe = (30.0 if step.number == PROBE_SPIKE_AT else 1.0) + wiggle
        return {
            "output_sq": Scalar(local.detach().float().square().sum(), "sum"),  # each rank's shard: the norm's square
            "probe": Scalar(on_device(probe, step.loss)),
            "stop_asked": Scalar(on_device(self.rank0 and step.number == self.stop_at, step.loss), "max"),
        }

    def after_step(self, step: Step) -> None:
        self.norm = step.values["output_sq"] ** 0.5
        self.total, self.steps = self.total + self.norm, self.steps + 1
        self.stopping = bool(step.values["stop_asked"])

    def metrics(self, step: Step) -> dict[str, float]:
        return {"watch/output_norm": self.norm, "watch/output_norm_mean": self.total / self.steps}

    def line(self, step: Step, metrics: dict[str, float]) -> str:
        return f"out_norm {metrics['watch/output_norm']:.5f}"

    def request(self, step: Step) -> Request | None:
        if not self.stopping:
            return None
        return Stop("asked by the watch", SystemExit(STOP_EXIT), after_checkpoint=lambda: print("watch: stopped"))

    def state_dict(self) -> dict[str, Any]:
        return {"output_watch": json.dumps({"total": self.total, "steps": self.steps})}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = json.loads(state["output_watch"])
        self.total, self.steps = saved["total"], saved["steps"]


# -- the tests: this file under torchrun on 2 CPU ranks ------------------------------------------------------

SCRIPT = "tests/test_hook_extension.py"
ARGS = (
    *("--training.steps", "8", "--checkpoint.interval", "4", "--metrics.log_freq", "1", "--validation.no-enable"),
    *("--spikes.window", "4", "--spikes.min_history", "3", "--lr_scheduler.total_steps", "8"),
)
WATCHED = ("watch/output_norm", "watch/output_norm_mean", "spikes/probe_score", "spikes/loss_score", "train/loss")


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    """The job, stopped by the watch after step STOP_AT of 8."""
    run_dir = tmp_path_factory.mktemp("stopped") / "run"
    proc = torchrun(run_dir, *ARGS, script=SCRIPT, env={STOP_AT_ENV: str(STOP_AT)}, check=False)
    return run_dir, proc.returncode, proc.stdout + proc.stderr


def test_the_hooks_stop_exits_with_its_code_after_a_checkpoint(stopped):
    run_dir, returncode, log = stopped
    assert returncode == STOP_EXIT, log[-3000:]
    assert "watch: stopped" in log and f"step {STOP_AT + 1}/8" not in log and "Training completed" not in log
    assert sorted(p.name for p in (run_dir / "checkpoint").iterdir()) == ["step-4", f"step-{STOP_AT}"]


def test_the_hooks_metric_is_in_the_log_line_and_tensorboard(stopped):
    run_dir, _, log = stopped
    scalars = load_scalars(run_dir)
    norms = scalars["watch/output_norm"]
    assert list(norms) == list(range(1, STOP_AT + 1)) and all(v > 0 for v in norms.values())
    assert scalars["watch/output_norm_mean"][STOP_AT] == pytest.approx(sum(norms.values()) / STOP_AT, rel=1e-6)
    for step in (1, STOP_AT):  # the hook's part ends the line, after the time shares
        line = next(x for x in log.splitlines() if f"step {step}/8  loss " in x)
        assert line.endswith(f"out_norm {norms[step]:.5f}") and " time data " in line


def test_the_hooks_value_is_scored_for_spikes_beside_the_loss(stopped):
    run_dir, _, log = stopped
    recorded = [s for s in spikes.read(str(run_dir)) if s.tag == "probe"]
    assert [s.step for s in recorded] == [PROBE_SPIKE_AT] and recorded[0].value == pytest.approx(30.0 - 0.02)
    assert f"step {PROBE_SPIKE_AT}: probe spike, " in log
    scalars = load_scalars(run_dir)
    assert list(scalars["spikes/probe"]) == [PROBE_SPIKE_AT]
    assert list(scalars["spikes/probe_score"]) == list(range(4, STOP_AT + 1))  # from the 4th step, as the loss's
    assert list(scalars["spikes/loss_score"]) == list(range(4, STOP_AT + 1))


def test_a_resume_from_the_checkpoint_before_the_stop_repeats_the_job_bit_for_bit(stopped, tmp_path):
    reference, _, _ = stopped
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    shutil.rmtree(run_dir / "checkpoint" / f"step-{STOP_AT}")  # as if the job had died after step 4's checkpoint
    resumed = torchrun(run_dir, *ARGS, script=SCRIPT, env={STOP_AT_ENV: str(STOP_AT)}, check=False)
    log = resumed.stdout + resumed.stderr
    assert resumed.returncode == STOP_EXIT and "Training starts at step 5" in log, log[-3000:]
    want, got = load_scalars(reference), load_scalars(run_dir)
    for tag in WATCHED:  # the mean's state and the probe's window came back from the step-4 checkpoint
        assert list(got[tag]) == list(want[tag]) and got[tag] == want[tag], tag
    assert spikes.read(str(run_dir)) == spikes.read(str(reference))


if __name__ == "__main__":  # the job torchrun starts: the trainer with the watch after the job's own hooks
    run(sys.argv[1:], hooks=[OutputWatch(int(os.environ.get(STOP_AT_ENV, "0")))])
