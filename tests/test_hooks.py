"""The hook protocol's own machinery (mhar_titan/components/hooks.py): the phases in the
job's order, a name two hooks give refused, the stops carried out in order, hooks closed last first, and a step's
values combined over two real ranks as their `reduce` says. (A hook added from a test file, run by the trainer:
tests/test_hook_extension.py.)"""

import json
from types import SimpleNamespace

import pytest
import torch
import torch.multiprocessing as mp
from reduce_on_ranks import reduce_on_rank

from mhar_titan.components.hooks import Hook, Hooks, SaveNow, Scalar, Step, Stop
from mhar_titan.trainer import CPTTrainer


class Named(Hook):
    def __init__(self, name: str, said: list[str], metrics: dict | None = None, request=None, fails: bool = False):
        self.name, self.said, self._metrics, self._request, self.fails = name, said, metrics or {}, request, fails

    def before_step(self, step: Step) -> None:
        self.said.append(f"{self.name}.before_step")

    def metrics(self, step: Step) -> dict[str, float]:
        return self._metrics

    def line(self, step: Step, metrics: dict[str, float]) -> str:
        return f"{self.name} {metrics[next(iter(self._metrics))]:g}" if self._metrics else ""

    def request(self, step: Step):
        return self._request

    def close(self) -> None:
        self.said.append(f"{self.name}.close")
        if self.fails:
            raise OSError(f"{self.name} could not close")


class GivesLoss(Named):
    def scalars(self, step: Step) -> dict[str, Scalar]:
        return {"loss": Scalar(torch.zeros(()))}  # the trainer's own value's name


def test_phases_run_in_the_jobs_order_and_close_in_reverse_every_hook_even_after_a_failure():
    said: list[str] = []
    hooks = Hooks([Named("a", said, {"x/a": 1.0}), Named("b", said, fails=True), Named("c", said, {"x/c": 2.5})])
    hooks.each("before_step", Step(1, last=False, log=True))
    assert said == ["a.before_step", "b.before_step", "c.before_step"]
    metrics = hooks.metrics(Step(1, last=False, log=True))
    assert metrics == {"x/a": 1.0, "x/c": 2.5} and hooks.line(Step(1, False, True), metrics) == "a 1  c 2.5"
    with pytest.raises(OSError, match="b could not close"):
        hooks.close()
    assert said[3:] == ["c.close", "b.close", "a.close"]


def test_a_name_two_hooks_give_is_refused_naming_the_hook():
    said: list[str] = []
    with pytest.raises(ValueError, match="each needs a name of its own"):
        Hooks([Named("a", said), Named("a", said)])
    hooks = Hooks([Named("a", said, {"x/same": 1.0}), Named("b", said, {"x/same": 2.0})])
    with pytest.raises(ValueError, match="hook 'b': the TensorBoard scalar 'x/same' is already given by another"):
        hooks.metrics(Step(1, last=False, log=True))
    with pytest.raises(ValueError, match="hook 'a': the step value 'loss' is already given by another"):
        Hooks([GivesLoss("a", said)]).scalars(Step(1, False, False), {"loss": Scalar(torch.ones(()), "sum")})
    with pytest.raises(ValueError, match="reduce = 'avg'"):
        Scalar(torch.zeros(()), "avg")


def test_requests_are_carried_out_in_order_the_first_stop_ends_the_job_after_its_checkpoint():
    saved, after = [], []
    trainer = CPTTrainer.__new__(CPTTrainer)
    trainer.checkpointer = SimpleNamespace(save_now=saved.append)
    first = Stop("first", SystemExit(3), after_checkpoint=lambda: after.append("first"))
    second = Stop("second", RuntimeError("never raised"))
    with pytest.raises(SystemExit) as stopped:
        trainer._carry_out([SaveNow("clock"), first, second], Step(7, last=False, log=False))
    assert stopped.value.code == 3 and saved == [7, 7] and after == ["first"]
    with pytest.raises(RuntimeError, match="no checkpoint"):
        trainer._carry_out([Stop("x", RuntimeError("no checkpoint"), checkpoint=False)], Step(8, False, False))
    assert saved == [7, 7]


def test_a_steps_values_are_combined_over_the_ranks_as_their_reduce_says(tmp_path):
    mp.spawn(reduce_on_rank, args=(2, f"file://{tmp_path / 'store'}", str(tmp_path / "out")), nprocs=2)
    seen = [json.loads((tmp_path / f"out.{rank}").read_text()) for rank in range(2)]
    assert seen[0] == seen[1]  # every rank reads the same values, in the order given
    assert seen[0]["order"] == ["flag", "largest", "total", "average", "global"]
    values = seen[0]["values"]
    assert values["flag"] == [False, [], [1.0]] and values["largest"] == [False, [], [1.5]]  # float32, the max
    assert values["total"] == [True, [2], [3.0, 6.0]]  # float64, the sum over the ranks
    assert values["average"] == [False, [1, 2], [3.0, 6.0]]  # float32, the mean, in the value's shape
    assert values["global"] == [True, [], [3.25]]
