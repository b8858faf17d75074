"""The data's progress as the run trains, as a hook (components/hooks.py): the loader's counters and the mixture's
shares in TensorBoard on log steps, a mixture stage's start in the log, and, with `[data] on_source_exhausted =
"stop"`, the stop of a run whose source is read to its end (checkpoint, exit DATA_EXHAUSTED; a relaunch stops
before training any step)."""

from __future__ import annotations

from typing import Any

from torchtitan.tools.logging import logger

from data.counters import mixture_counter, mixture_shares, stage_shares, token_shares
from data.loader import gather_counters
from mhar_titan.components.exit_codes import DATA_EXHAUSTED as DATA_EXHAUSTED_EXIT_CODE
from mhar_titan.components.hooks import Hook, Request, Scalar, Step, Stop, on_device


class SourcesExhausted(SystemExit):
    """`[data] on_source_exhausted = "stop"` and a source was read to its end: the run stops short of
    training.steps, with a checkpoint, and exits with DATA_EXHAUSTED_EXIT_CODE, never 0 ("completed")."""

    def __init__(self, step: int, total: int, sources: list[str], again: bool):
        super().__init__(DATA_EXHAUSTED_EXIT_CODE)
        names = ", ".join(sources)
        when = f"stopped at step {step} of {total}" if again else f"stops at step {step} of {total}, with a checkpoint"
        self.message = (
            f"mixture source(s) {names} read to their end with [data] on_source_exhausted = 'stop': the run {when}"
            + (", before training any step" if again else "")
            + f" (exit {DATA_EXHAUSTED_EXIT_CODE}). To go on: add shards to the source (allow_changes data) or "
            "set on_source_exhausted = 'repeat' (allow_changes data); or export this checkpoint as the result"
        )


class DataProgress(Hook):
    name = "data"

    def set_up(self, trainer: Any) -> None:
        self.loader, self.cfg = trainer.dataloader, trainer.job_config
        self.stops = self.cfg.data.on_source_exhausted == "stop"
        self.exhausted = False

    def start(self, step: int) -> None:
        """A resumed run whose source was read to its end stops before training a step (every rank checks)."""
        if self.stops and 0 < step < self.cfg.training.steps:
            if sources := self._exhausted_sources():
                raise self._exit(step, sources, again=True)

    def scalars(self, step: Step) -> dict[str, Scalar]:
        if not self.stops:
            return {}
        return {"exhausted": Scalar(on_device(bool(self.loader.exhausted()), step.loss), "max")}

    def after_step(self, step: Step) -> None:
        self.exhausted = bool(step.values.get("exhausted", 0.0))
        schedule = self.loader.schedule
        if schedule.staged and step.number > 1 and schedule.at(step.number).start == step.number:
            stage = schedule.describe(self.loader.names)[schedule.at(step.number).number - 1]
            shares = ", ".join(f"{name} {w:.1%}" for name, w in stage["weights"].items())
            logger.info(f"[data] mixture stage {stage['number']} begins at step {step.number}: {shares}")

    def request(self, step: Step) -> Request | None:
        if not self.exhausted or step.last:
            return None
        error = self._exit(step.number, self._exhausted_sources(), again=False, said=False)
        return Stop("a source read to its end", error, after_checkpoint=lambda: logger.error(error.message))

    def metrics(self, step: Step) -> dict[str, float]:
        """On log steps: the counters summed over all ranks, the mixture's shares, the stage and its shares."""
        if not step.log:
            return {}
        counters = gather_counters(self.loader)
        metrics = {f"data/{k}": value for k, value in counters.items()}
        metrics.update({**mixture_shares(counters), **token_shares(counters, top=self.cfg.data.token_share_sources)})
        if self.loader.schedule.staged:  # the stage this step trained in, and the shares delivered in it
            metrics.update({"data/stage": self.loader.schedule.at(step.number).number, **stage_shares(counters)})
        return metrics

    def _exhausted_sources(self) -> list[str]:
        """The mixture sources some rank's stream has read to its end (every rank must call)."""
        return [name for name, n in mixture_counter(gather_counters(self.loader), "epochs").items() if n]

    def _exit(self, step: int, sources: list[str], again: bool, said: bool = True) -> SourcesExhausted:
        exit_ = SourcesExhausted(step, self.cfg.training.steps, sources, again)
        if said:
            logger.error(exit_.message)
        return exit_
