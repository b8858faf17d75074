"""Validation over fixed sets: the same batches at every evaluation, cross-entropy only.

torchtitan's validator keeps one iterator across evaluations (each sees different
batches) and reuses the training loss (z-loss included). Here every evaluation runs
the same first `validation.steps` batches of each rank (all of them with -1) of every
named set (`[data] validation_sets`), every rank runs the same number of batches (FSDP
forwards are collective), and each set's value is the token-weighted cross-entropy over
all ranks.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.components.tokenizer import BaseTokenizer, HuggingFaceTokenizer
from torchtitan.config import JobConfig
from torchtitan.distributed import ParallelDims
from torchtitan.tools.logging import logger

from data.atomic import write_text
from data.loader import Encoder, ValidationLoader, data_config
from data.mixture import parse_mixture, parse_validation_sets
from data.shards import list_shards
from mhar_titan import titan_compat
from mhar_titan.components.checkpoint import testing
from mhar_titan.components.ema import EMA, WeightEMA
from mhar_titan.components.hooks import Hook, Scalar, Step, reduce_scalars
from mhar_titan.components.loss import cross_entropy_sum
from mhar_titan.components.step_metrics import flush, log_scalars
from mhar_titan.components.tensorboard_scalars import PRIMARY_TAGS, set_tags
from mhar_titan.components.val_bands import band_sums, split

Batch = tuple[torch.Tensor, torch.Tensor]


class FixedSetValidator:
    """Cross-entropy of the model on the validation set; `validate` returns it (every rank)."""

    def __init__(
        self,
        job_config: JobConfig,
        loaders: list[ValidationLoader],
        parallel_dims: ParallelDims,
        validation_context: Callable[[], AbstractContextManager[None]],
        maybe_enable_amp: AbstractContextManager[None],
        tokenizer: BaseTokenizer | None = None,
    ):
        """`tokenizer`: its eos marks the documents for the model's attention masks (flex attention's block
        causal masking), as in training."""
        self.tokenizer = tokenizer
        self.freq, self.max_batches = job_config.validation.freq, job_config.validation.steps
        self.loaders, self.parallel_dims = loaders, parallel_dims
        self.context, self.amp = validation_context, maybe_enable_amp
        self._batches: dict[str, list[Batch]] = {}
        self.per_batch: dict[str, list[list[float]]] = {}
        self.per_band: dict[str, list[list[list[float]]]] = {}  # per set, every batch's [2, bands] (val_bands.py)

    @property
    def names(self) -> list[str]:
        """The sets' names, the first set first (the run's `val/ce`)."""
        return [loader.name for loader in self.loaders]

    def should_validate(self, step: int) -> bool:
        return self.freq > 0 and step % self.freq == 0

    def _group(self) -> dist.ProcessGroup | None:
        return self.parallel_dims.get_mesh("batch").get_group() if self.parallel_dims.dp_enabled else None

    def batches(self, loader: ValidationLoader, device: torch.device) -> list[Batch]:
        """This rank's share of one set, read once and kept (token ids on CPU), cut to the count every rank has."""
        if loader.name in self._batches:
            return self._batches[loader.name]
        mine: list[Batch] = []
        for inputs, labels in loader:
            mine.append((inputs["input"], labels))
            if len(mine) == self.max_batches:
                break  # the scan stops here: a held-out set reads no more of the training shards
        common = torch.tensor([len(mine)], device=device)
        if self._group() is not None:
            dist.all_reduce(common, op=dist.ReduceOp.MIN, group=self._group())
        n = int(common.item())
        if n == 0:
            raise ValueError(
                f"validation set {loader.name!r}: a rank has no full batch of {loader.batch} x {loader.seq_len} "
                f"tokens (shards {loader.shards}); add validation data or lower validation.local_batch_size / seq_len"
            )
        if len(mine) > n:
            logger.warning(
                f"validation set {loader.name!r}: this rank has {len(mine)} batches, the smallest share {n}; "
                f"{len(mine) - n} left out so every rank runs the same number"
            )
        self._batches[loader.name] = mine[:n]
        logger.info(f"validation set {loader.name!r}: {n} batches of {loader.batch} x {loader.seq_len} tokens per rank")
        return self._batches[loader.name]

    @torch.no_grad()
    def validate(self, model_parts: list[nn.Module], step: int) -> dict[str, float]:
        """Each set's cross-entropy per valid token; `per_batch` then holds, per set, every batch's
        (CE sum, tokens), rank-major."""
        model = model_parts[0]
        was_training = model.training
        model.eval()
        device = next(model.parameters()).device
        out = {}
        for loader in self.loaders:
            rows, bands = [], []
            for inputs, labels in self.batches(loader, device):
                inputs, labels = inputs.to(device), labels.to(device)
                with self.context(), self.amp:
                    logits = model(inputs, **self._masks(model, inputs))
                    ce = cross_entropy_sum(logits, labels)
                rows.append(torch.stack([ce.double(), (labels != IGNORE_INDEX).sum().double()]))
                if self.tokenizer is not None:
                    bands.append(band_sums(logits, labels, inputs, self.tokenizer.eos_id, IGNORE_INDEX))
            mine = self._gather(torch.stack(rows))  # [batches, 2]
            self.per_batch[loader.name] = mine.tolist()
            if bands:
                self.per_band[loader.name] = self._gather(torch.stack(bands)).tolist()  # [batches, 2, bands]
            total = mine.sum(0)
            out[loader.name] = (total[0] / total[1]).item()
        model.train(was_training)
        return out

    def _gather(self, mine: torch.Tensor) -> torch.Tensor:
        """Every rank's rows, rank-major."""
        if self._group() is None:
            return mine
        everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(self._group()))]
        dist.all_gather(everyone, mine, group=self._group())
        return torch.cat(everyone)

    def _masks(self, model: nn.Module, inputs: torch.Tensor) -> dict[str, Any]:
        """The attention masks the model's attention needs, built as torchtitan's Trainer.post_dataloading_process
        builds them (torchtitan 0.2.2 torchtitan/train.py); none for sdpa."""
        if getattr(model.model_args, "attn_type", "sdpa") not in ("flex", "varlen"):
            return {}
        if self.tokenizer is None:
            raise ValueError("validation with flex attention needs the tokenizer (its eos marks the documents)")
        return {"attention_masks": model.get_attention_masks(input_batch=inputs, tokenizer=self.tokenizer)}


def run_validation(
    validator: FixedSetValidator, model_parts: list[nn.Module], step: int, ema: WeightEMA | None
) -> tuple[dict[str, float], Callable[[str], None]]:
    """Every set's CE with the raw weights and, with an EMA, with the EMA weights swapped in, by TensorBoard tag
    (the first set also as val/ce and val/ce_ema); and what writes every batch's CE to a validation folder's
    step-N.json for the paired comparison (rank 0's record, written last: it says the validation is done)."""
    values = {"raw": validator.validate(model_parts, step)}
    batches, bands = {"raw": dict(validator.per_batch)}, {"raw": dict(validator.per_band)}
    if ema is not None:
        with ema.swapped_in():
            values["ema"] = validator.validate(model_parts, step)
        batches["ema"], bands["ema"] = dict(validator.per_batch), dict(validator.per_band)
    first = validator.names[0]
    metrics = {PRIMARY_TAGS[kind]: v[first] for kind, v in values.items()}
    for name in validator.names:
        metrics.update({set_tags(name)[kind]: v[name] for kind, v in values.items()})
    return metrics, lambda folder: write_validation_batches(folder, step, batches, first, bands)


def write_validation_batches(
    folder: str,
    step: int,
    batches: dict[str, dict[str, list[list[float]]]],
    first: str,
    bands: dict[str, dict[str, list[list[list[float]]]]] | None = None,
) -> None:
    """validation/step-N.json, written atomically: {"step", "raw" and "ema": the first set's batches (CE sum,
    tokens), "sets": {name: {"raw", "ema"}}}, what mhar_titan.compare pairs batch by batch; each set's entry also
    holds its batches by band ("bands": {kind: {band: {"ce_sum", "tokens"}}}, val_bands.py) where measured."""
    os.makedirs(folder, exist_ok=True)
    record: dict[str, Any] = {"step": step, "sets": {}}
    for which, per_set in batches.items():
        for name, rows in per_set.items():
            entry: dict[str, Any] = {"ce_sum": [r[0] for r in rows], "tokens": [int(r[1]) for r in rows]}
            if bands and bands.get(which, {}).get(name):
                entry["bands"] = split(bands[which][name])
            record["sets"].setdefault(name, {})[which] = entry
            if name == first:
                record[which] = entry
    path = os.path.join(folder, f"step-{step:08d}.json")
    write_text(path, json.dumps(record))


def build_fixed_set_validator(
    job_config: JobConfig,
    dp_world_size: int,
    dp_rank: int,
    tokenizer: BaseTokenizer,
    parallel_dims: ParallelDims,
    validation_context: Callable[[], AbstractContextManager[None]],
    maybe_enable_amp: AbstractContextManager[None],
    **_: object,
) -> FixedSetValidator:
    """The `TrainSpec` validator builder: `[data] validation_sets`, validation_paths or the held-out fraction."""
    if not isinstance(tokenizer, HuggingFaceTokenizer):
        raise TypeError("validation needs the HF tokenizer of model.hf_assets_path")
    cfg = data_config(job_config)
    v = job_config.validation
    if v.seq_len > job_config.training.seq_len:
        # The model's RoPE table covers training.seq_len positions (torchtitan sets max_seq_len to it):
        # fail at start-up, not at the first evaluation (step 0 with validation.at_start).
        raise ValueError(
            f"[validation] seq_len = {v.seq_len} exceeds [training] seq_len = {job_config.training.seq_len}, "
            "the longest sequence the model is built for; lower validation.seq_len"
        )
    encode = Encoder(tokenizer, cfg.bos)
    shards = {src.name: list_shards(list(src.paths), src.manifest) for src in parse_mixture(cfg)}
    loaders = []
    for vset in parse_validation_sets(cfg):
        held = [p for name, paths in shards.items() if vset.heldout in ("*", name) for p in paths]
        sizes = {"seq_len": v.seq_len, "batch": v.local_batch_size, "dp_rank": dp_rank, "dp_world": dp_world_size}
        loaders.append(ValidationLoader(cfg, held, encode, **sizes, vset=vset))
    return FixedSetValidator(job_config, loaders, parallel_dims, validation_context, maybe_enable_amp, tokenizer)


class Validation(Hook):
    """Validation in a job: the base at step 0 (`[validation] at_start`, a fresh start only), then every
    `validation.freq` steps after the step's checkpoint; the raw weights and the EMA's (`ema`'s, swapped in). A job
    resumed from a validation step whose validation has no record (the job before ended between the checkpoint and
    the record) validates it first: the values of every validation step are logged, whatever ended a job."""

    name = "validation"

    def __init__(self, ema: EMA):
        self.ema = ema

    def set_up(self, trainer: Any) -> None:
        self.trainer, self.settings = trainer, trainer.job_config.validation

    def start(self, step: int) -> None:
        if not self.settings.enable:
            return
        if self.settings.at_start and step == 0:
            self.validate(0)  # the base, before any update (a resume does not repeat it): each arm's reference
        elif step > 0 and self.trainer.validator.should_validate(step) and self._unrecorded(step):
            logger.info(f"validation at step {step}: no job validated it (the one that checkpointed it ended first)")
            self.validate(step)

    def _record(self, step: int) -> str:
        return os.path.join(self.trainer.job_config.job.dump_folder, "validation", f"step-{step:08d}.json")

    def _unrecorded(self, step: int) -> bool:
        """Rank 0's answer (it writes the records), the same on every rank."""
        missing = dist.get_rank() == 0 and not os.path.exists(self._record(step))
        vote = {"unrecorded": Scalar(torch.full((), float(missing), device=self.trainer.device), "max")}
        return bool(reduce_scalars(vote, None)["unrecorded"].item())

    def after_save(self, step: Step) -> None:
        if self.settings.enable and self.trainer.validator.should_validate(step.number):
            self.validate(step.number)

    def validate(self, step: int) -> None:
        """Every validation set with the raw and EMA weights to TensorBoard and, on rank 0, every batch's CE to
        validation/step-N.json; its time is left out of the training throughput and counted in the ETA."""
        t = self.trainer
        t.optimizers.zero_grad()  # the last step's gradients are not read again: validation gets their memory
        t.checkpointer.maybe_wait_for_staging()  # a background save still copying the weights the EMA swaps
        began = time.perf_counter()
        testing.before_validation(t.job_config.job.dump_folder, step)  # a test's hang; nothing otherwise
        metrics, write_record = run_validation(t.validator, t.model_parts, step, self.ema.ema)
        log_scalars(t.metrics_processor.logger, metrics, step)
        flush(t.metrics_processor)
        if dist.get_rank() == 0:
            write_record(os.path.dirname(self._record(step)))
        spent = time.perf_counter() - began
        titan_compat.leave_out_of_log_window(t.metrics_processor, spent)
        t.clock.pause(spent, "validation", self.settings.freq)
        logger.info(f"validation at step {step}: " + "  ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
