"""The training and validation loaders over sharded parquet, for torchtitan's trainer.

Each data-parallel rank owns the logical streams s with s % dp_world == dp_rank
and takes its k-th batch from its (k mod n)-th stream, k counting batches from
the start of the run, batch k of training step k // accumulation + 1. A stream reads every source of the
mixture (data/mixture.py; `[data] paths` is a mixture of one source), with the weights of that step's
stage (data/stages.py). Loader workers split a rank's streams, and every batch
carries a copy of its stream's state, so the main process always knows the exact
state of each stream after the last batch it delivered: the checkpointed state is
the same with 0 or 8 workers, and a run may resume on another number of ranks (each
stream, keyed by its id, continues exactly).

The checkpointed states are JSON strings, one per stream, checked key by key on
loading: a checkpoint holds data, never code to run.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Iterator
from typing import Any

import torch
from tokenizers import Tokenizer
from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from torchtitan.components.dataloader import BaseDataLoader
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.components.tokenizer import BaseTokenizer, HuggingFaceTokenizer
from torchtitan.config import JobConfig

from data.collectives import gather_objects
from data.config import DataConfig
from data.contents import contents_digest
from data.index import startup_shards
from data.mixture import (
    MixedStream,
    Source,
    ValidationSet,
    mixed_state_from_json,
    mixed_state_to_json,
    new_mixed_state,
    parse_mixture,
    parse_validation_sets,
)
from data.shards import NoDataError, Scan, ShardInfo, held_out, list_shards, name_paths
from data.stages import StageSchedule, parse_stages, step_of_batch, stream_batches_before
from data.stream import COUNTERS, PackedStream

logger = logging.getLogger(__name__)


class Encoder:
    """Batched tokenisation with the base checkpoint's tokenizer.json; picklable for workers.

    Documents are [bos] text (the stream appends eos): with `bos='auto'` the bos token goes first
    where the tokenizer's own template puts one (Llama-3's, so Marin-8B's, does). A special token's text inside a
    document (`<|end_of_text|>` quoted in a web page) is text: only the stream inserts the special ids, so a
    document cannot fake a document boundary."""

    def __init__(self, tokenizer: HuggingFaceTokenizer, bos: str = "auto"):
        self.tokenizer = text_only(tokenizer.tokenizer)
        if tokenizer.eos_id is None:
            raise ValueError("the tokenizer has no end-of-text token (tokenizer_config.json eos_token)")
        self.eos_id = tokenizer.eos_id
        self.bos_id = _bos_id(tokenizer, bos)

    def __call__(self, texts: list[str]) -> list[list[int]]:
        self.tokenizer.encode_special_tokens = True  # pickling (to a loader worker) does not keep it
        encoded = self.tokenizer.encode_batch(texts, add_special_tokens=False)
        if self.bos_id is None:
            return [e.ids for e in encoded]
        return [[self.bos_id, *e.ids] for e in encoded]


def text_only(tokenizer: Tokenizer) -> Tokenizer:
    """A copy of `tokenizer` that encodes its special tokens' text as text, leaving the original as it was."""
    copy_ = Tokenizer.from_str(tokenizer.to_str())
    copy_.encode_special_tokens = True
    return copy_


def _bos_id(tokenizer: HuggingFaceTokenizer, bos: str) -> int | None:
    if bos == "never":
        return None
    if bos == "always":
        if tokenizer.bos_id is None:
            raise ValueError("[data] bos = 'always', but the tokenizer has no bos token (tokenizer_config.json)")
        return tokenizer.bos_id
    if bos != "auto":
        raise ValueError(f"[data] bos = {bos!r} must be 'auto', 'always' or 'never'")
    first = tokenizer.tokenizer.encode("a", add_special_tokens=True).ids[:1]
    return tokenizer.bos_id if tokenizer.bos_id is not None and first == [tokenizer.bos_id] else None


class _TrainingKeep:
    def __init__(self, fraction: float):
        self.fraction = fraction

    def __call__(self, text: str) -> bool:
        return not held_out(text, self.fraction)


class _HeldOutKeep(_TrainingKeep):
    def __call__(self, text: str) -> bool:
        return held_out(text, self.fraction)


def drop_document_starts(inputs: torch.Tensor, labels: torch.Tensor, eos_id: int) -> torch.Tensor:
    """`labels` with each document's first token (the label after an eos) ignored by the loss and the token
    counts: nothing of its own document precedes it."""
    return labels.masked_fill(inputs == eos_id, IGNORE_INDEX)


class _RankStreams(IterableDataset):
    """Batches of one rank, from batch `start` on; each worker serves a fixed subset of the streams."""

    def __init__(self, loader: ParquetDataLoader, states: dict[int, dict[str, Any]], start: int):
        self.cfg, self.sources, self.shards, self.encode = loader.cfg, loader.sources, loader.shards, loader.encode
        self.infos, self.schedule, self.accumulation = loader.infos, loader.schedule, loader.accumulation
        self.local, self.batch, self.seq_len = loader.local, loader.batch, loader.seq_len
        self.states, self.start = states, start

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info else (1, 0)
        n = len(self.local)
        keep = _TrainingKeep(self.cfg.validation_fraction)
        mine = [i for i in range(n) if i % workers == (self.start + worker) % workers]
        streams = {
            self.local[i]: MixedStream(
                self.local[i],
                self.sources,
                self.shards,
                self.cfg,
                self.encode,
                self.encode.eos_id,
                self.states[self.local[i]],
                keep,
                self.infos,
                self.schedule,
            )
            for i in mine
        }
        k = self.start + worker
        while True:
            sid = self.local[k % n]
            stream = streams[sid]
            inputs, labels = stream.next_batch(self.batch, self.seq_len, step_of_batch(k, self.accumulation))
            if not self.cfg.loss_on_document_start:
                labels = drop_document_starts(inputs, labels, self.encode.eos_id)
            yield {"input": inputs, "labels": labels, "stream": sid, "state": stream.snapshot()}
            k += workers


class ParquetDataLoader(BaseDataLoader):
    """Infinite packed batches [local_batch_size, seq_len] for one data-parallel rank."""

    def __init__(
        self,
        cfg: DataConfig,
        shards: list[str] | dict[str, list[str]],
        encode: Encoder,
        seq_len: int,
        batch: int,
        dp_rank: int,
        dp_world: int,
        num_workers: int = 0,
        infos: dict[str, ShardInfo] | None = None,
        accumulation: int = 1,
        workers: dict[str, Any] | None = None,
    ):
        """`shards`: each mixture source's usable shards by name (a list: the one source of `paths`);
        `infos`: their row groups from the start-up check (`source_shards`), so no stream reads a footer;
        `accumulation`: the microbatches a rank takes a training step (the step, and so the mixture stage, of
        each batch); `workers`: torchtitan's other `[training.dataloader]` settings (`prefetch_factor`, the
        batches each worker keeps ready, 2 unless set; `pin_memory`; `persistent_workers`)."""
        cfg.validate()
        self.workers = {"prefetch_factor": None, "pin_memory": False, "persistent_workers": False, **(workers or {})}
        if not num_workers and (self.workers["prefetch_factor"] is not None or self.workers["persistent_workers"]):
            raise ValueError(
                "[training.dataloader] prefetch_factor and persistent_workers act on loader workers: set num_workers "
                f"(a divisor of the streams per rank) or leave them unset ({self.workers})"
            )
        if self.workers["prefetch_factor"] is not None and self.workers["prefetch_factor"] < 1:
            raise ValueError(f"[training.dataloader] prefetch_factor = {self.workers['prefetch_factor']}: at least 1")
        if cfg.num_streams % dp_world:
            raise ValueError(f"[data] num_streams = {cfg.num_streams} must be a multiple of the {dp_world} DP ranks")
        per_rank = cfg.num_streams // dp_world
        if num_workers and per_rank % num_workers:
            raise ValueError(
                f"[data] num_streams = {cfg.num_streams}: each of the {dp_world} ranks gets {per_rank} streams, "
                f"which its {num_workers} loader workers must divide"
            )
        self.sources: list[Source] = parse_mixture(cfg)
        self.shards = _source_shards(self.sources, shards, cfg.num_streams)
        self.cfg, self.encode, self.infos = cfg, encode, infos or {}
        self.seq_len, self.batch, self.num_workers = seq_len, batch, num_workers
        self.local = [s for s in range(cfg.num_streams) if s % dp_world == dp_rank]
        self.names = [src.name for src in self.sources]
        self.schedule = StageSchedule(parse_stages(cfg, self.names, [src.weight for src in self.sources], None))
        self.accumulation, self.dp_world = accumulation, dp_world
        self.states = {s: new_mixed_state(self.names) for s in self.local}
        self.batches = 0

    def step(self) -> int:
        """The training step of the last batch delivered (1 before any)."""
        return step_of_batch(max(0, self.batches - 1), self.accumulation)

    def start_at(self, step: int) -> None:
        """Place every stream's window counter where training step `step` begins and start there (the preview:
        each source's documents from their start, the mixture's picks exactly those of `step` on)."""
        per_step = self.accumulation * self.dp_world
        for s in self.local:
            self.states[s]["windows"] = self.batch * stream_batches_before(step, s, self.cfg.num_streams, per_step)
        self.batches = (step - 1) * self.accumulation

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        dataset = _RankStreams(self, copy.deepcopy(self.states), self.batches)
        loader = DataLoader(
            dataset,
            batch_size=None,
            num_workers=self.num_workers,
            prefetch_factor=(self.workers["prefetch_factor"] or 2) if self.num_workers else None,
            pin_memory=self.workers["pin_memory"],
            persistent_workers=self.workers["persistent_workers"],
        )
        for item in loader:
            self.states[item["stream"]] = item["state"]
            self.batches += 1
            yield {"input": item["input"]}, item["labels"]

    def state_dict(self) -> dict[str, Any]:
        """{"batches": int, "stream_00000": JSON str, ...}: one entry per stream, keyed by its id, so
        any number of ranks can load them back; each a few hundred bytes whatever the documents."""
        state: dict[str, Any] = {"batches": self.batches}
        state.update({f"stream_{s:05d}": mixed_state_to_json(self.states[s]) for s in self.local})
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Only JSON states are accepted (never unpickled); a ValueError names the key that is wrong."""
        batches = state_dict.get("batches")
        if type(batches) is not int or batches < 0:
            raise ValueError(f"dataloader.batches: {batches!r} is not a non-negative integer")
        states = {}
        for s in self.local:
            key = f"stream_{s:05d}"
            if key not in state_dict:
                raise ValueError(f"dataloader.{key}: missing from the checkpoint (was num_streams changed?)")
            states[s] = mixed_state_from_json(f"dataloader.{key}", state_dict[key], self.names)
        self.batches, self.states = batches, states

    def contents(self) -> dict[str, str] | None:
        """Each source's content digest (shard sizes and footers: data/contents.py), from the start-up
        check; None without it (`check_shards = false` reads no shard at start-up)."""
        if not all(path in self.infos for paths in self.shards.values() for path in paths):
            return None
        return {name: contents_digest(self.infos[path] for path in paths) for name, paths in self.shards.items()}

    def exhausted(self) -> list[str]:
        """The mixture sources that one of this rank's streams has read to its end (begun a next epoch)."""
        return [name for name in self.names if any(st["sources"][name]["epoch"] for st in self.states.values())]

    def counters(self) -> dict[str, int]:
        """This rank's cumulative counters: documents, tokens per source-column tag (`tokens/<tag>`), and per
        mixture source the tokens delivered and the epochs its streams have begun after their first
        (`mixture/<name>/tokens`, `mixture/<name>/epochs`)."""
        subs = [sub for st in self.states.values() for sub in st["sources"].values()]
        out = {name: sum(sub[name] for sub in subs) for name in COUNTERS}
        for sub in subs:
            for source, n in sub["source_tokens"].items():
                out[f"tokens/{source}"] = out.get(f"tokens/{source}", 0) + n
        stage = self.schedule.at(self.step()).number
        for name in self.names:
            out[f"mixture/{name}/tokens"] = sum(st["tokens"][name] for st in self.states.values())
            out[f"mixture/{name}/epochs"] = sum(st["sources"][name]["epoch"] for st in self.states.values())
            if self.schedule.staged:  # this stage's tokens (a stream not read in it yet delivered none)
                in_stage = (st["stage"] for st in self.states.values())
                out[f"mixture/{name}/stage_tokens"] = sum(t["tokens"][name] for t in in_stage if t["number"] == stage)
        return out


class ValidationLoader:
    """A fixed, finite validation set: named shards, or the documents held out by hash.

    Every iteration starts over and yields the same batches; the last partial window of
    each rank is left out. Ranks split the shards round-robin.
    """

    def __init__(
        self,
        cfg: DataConfig,
        shards: list[str],
        encode: Encoder,
        seq_len: int,
        batch: int,
        dp_rank: int,
        dp_world: int,
        vset: ValidationSet | None = None,
    ):
        """`vset`: the set (default: the first of `[data] validation_sets`, or 'val'); `shards`: the training
        shards its documents are held out of, when it is a held-out set."""
        vset = vset or parse_validation_sets(cfg)[0]
        self.name = vset.name
        self.source = shards if vset.heldout is not None else list_shards(list(vset.paths), vset.manifest)
        self.shards = self.source[dp_rank::dp_world]
        self.keep = (lambda text: True) if vset.heldout is None else _HeldOutKeep(cfg.validation_fraction)
        self.cfg, self.encode, self.seq_len, self.batch = cfg, encode, seq_len, batch

    def _stream(self, shards: list[str]) -> PackedStream:
        return PackedStream(0, shards, self.cfg, self.encode, self.encode.eos_id, keep=self.keep, validation=True)

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        """The set's batches, read lazily: a caller that stops (the validator, once it has its
        validation.steps batches) stops the scan. A held-out scan reads every row of the training
        shards to find its documents, so its progress is logged every 10 s."""
        stream = self._stream(self.shards)
        yielded, began, told = 0, time.monotonic(), time.monotonic()
        while (batch := stream.next_batch(self.batch, self.seq_len)) is not None:
            yielded += 1
            if time.monotonic() - told > 10:
                told = time.monotonic()
                logger.info(
                    f"[data] validation set {self.name!r}: {yielded} batches after {told - began:.0f} s, "
                    f"{stream.seen.rows:,} rows read, {stream.seen.documents:,} of them in the set"
                )
            labels = batch[1] if self.cfg.loss_on_document_start else drop_document_starts(*batch, self.encode.eos_id)
            yield {"input": batch[0]}, labels
        if not yielded:
            self._no_window(stream.seen)

    def _no_window(self, seen: Scan) -> None:
        """This rank's share yields no complete window. If the whole set yields none either (the same
        answer on every rank, so every rank raises), a NoDataError names it; else this rank has
        nothing, which the validator reports on every rank at once."""
        if self.shards != self.source:
            whole = self._stream(self.source)
            if whole.next_batch(self.batch, self.seq_len) is not None:
                logger.warning(f"[data] validation: {name_paths(self.shards)} yield no window on this rank")
                return
            seen = whole.seen  # no window: the whole set was read
        raise NoDataError(
            f"[data] no validation data: {name_paths(self.source)} yield no complete window of "
            f"{self.batch} x {self.seq_len + 1} tokens ({seen.describe('left to training')})"
        )


def _source_shards(
    sources: list[Source], shards: list[str] | dict[str, list[str]], streams: int
) -> dict[str, list[str]]:
    names = [src.name for src in sources]
    if isinstance(shards, list):
        if len(names) != 1:
            raise ValueError(f"[data] a mixture of {len(names)} sources needs shards by source name ({names})")
        shards = {names[0]: shards}
    if sorted(shards) != sorted(names):
        raise ValueError(f"[data] shards given for sources {sorted(shards)}, the mixture has {sorted(names)}")
    for name in names:
        if len(shards[name]) < streams:
            raise ValueError(
                f"[data] source {name!r} has {len(shards[name])} usable shards ({name_paths(shards[name])}), fewer "
                f"than num_streams = {streams}: each stream reads its own shards of every source; write more "
                "shards (python -m data.prepare --shards N) or lower num_streams"
            )
    return {name: list(shards[name]) for name in names}


def source_infos(cfg: DataConfig) -> tuple[dict[str, list[str]], dict[str, ShardInfo]]:
    """Every mixture source's usable shards and, with `check_shards`, their row groups: listed and
    checked once per job (rank 0, from the shard index where there is one) and shared with every
    rank; every rank must call it."""
    shards, infos = {}, {}
    for src in parse_mixture(cfg):
        if cfg.check_shards:
            found = startup_shards(list(src.paths), src.manifest, cfg.text_column, cfg.source_column, cfg.on_bad_shard)
            shards[src.name] = list(found)
            infos.update(found)
        else:
            shards[src.name] = list_shards(list(src.paths), src.manifest)
        logger.info(f"[data] source {src.name!r} (weight {src.weight:g}): {len(shards[src.name])} shards")
    return shards, infos


def source_shards(cfg: DataConfig) -> dict[str, list[str]]:
    """`source_infos`' shards alone."""
    return source_infos(cfg)[0]


def data_config(job_config: JobConfig) -> DataConfig:
    cfg = copy.deepcopy(job_config.data)
    if not cfg.paths and not cfg.manifest and not cfg.mixture:
        if not job_config.training.dataset_path:
            raise ValueError("[data] paths, [data] manifest or training.dataset_path must name the shards")
        cfg.paths = [job_config.training.dataset_path]
    return cfg


def build_parquet_dataloader(
    dp_world_size: int, dp_rank: int, tokenizer: BaseTokenizer, job_config: JobConfig, **_: Any
) -> ParquetDataLoader:
    """The `TrainSpec` dataloader builder."""
    cfg = data_config(job_config)
    if not isinstance(tokenizer, HuggingFaceTokenizer):
        raise TypeError("the parquet loader needs the HF tokenizer of model.hf_assets_path")
    t = job_config.training
    global_batch = t.global_batch_size if t.global_batch_size > 0 else t.local_batch_size * dp_world_size
    accumulation, rest = divmod(global_batch, t.local_batch_size * dp_world_size)
    if rest or not accumulation:  # torchtitan refuses it too, later
        raise ValueError(
            f"[training] global_batch_size = {global_batch} is not a multiple of local_batch_size x data-parallel "
            f"ranks = {t.local_batch_size} x {dp_world_size}"
        )
    check_stages(job_config)  # before any shard is listed
    shards, infos = source_infos(cfg)
    return ParquetDataLoader(
        cfg,
        shards,
        Encoder(tokenizer, cfg.bos),
        seq_len=t.seq_len,
        batch=t.local_batch_size,
        dp_rank=dp_rank,
        dp_world=dp_world_size,
        num_workers=t.dataloader.num_workers,
        infos=infos,
        accumulation=accumulation,
        workers={k: getattr(t.dataloader, k) for k in ("prefetch_factor", "pin_memory", "persistent_workers")},
    )


def last_step(job_config: JobConfig) -> int:
    """The last step of the run's schedule: its steps, or the LR schedule's end if later (a run trained in
    several shorter jobs)."""
    return max(job_config.training.steps, job_config.lr_scheduler.total_steps or 0)


def check_stages(job_config: JobConfig) -> StageSchedule:
    """`[data] mixture_stages` against the mixture and the run's last step (a ValueError names the stage)."""
    cfg = data_config(job_config)
    sources = parse_mixture(cfg)
    names, weights = [s.name for s in sources], [s.weight for s in sources]
    return StageSchedule(parse_stages(cfg, names, weights, last_step(job_config)))


def gather_counters(loader: ParquetDataLoader) -> dict[str, int]:
    """Counters summed over all ranks (every rank must call)."""
    total: dict[str, int] = {}
    for counts in gather_objects(loader.counters()):
        for k, v in counts.items():
            total[k] = total.get(k, 0) + v
    return total
