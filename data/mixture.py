"""Weighted mixtures of named sources: which source each window comes from, and a stream over them.

A mixture is a list of named sources, each a set of shards with a weight. Every logical stream
reads every source (each source's shards are dealt to the `num_streams` streams as a corpus of
its own is) and takes its j-th window from the source that a low-discrepancy sequence picks:

    u_j = frac(phase(seed, stream) + j * (sqrt(5) - 1) / 2),   source = the weight interval holding u_j

in exact 64-bit integer arithmetic, so the pick is a pure function of (seed, stream, j) and the
weights: both arms of a pair get the same windows, a resume (on any number of ranks or loader
workers) continues each stream exactly, and over any n consecutive windows of a stream each
source's count is within a few windows of weight * n (the golden-ratio sequence's discrepancy
grows like log n), so token shares follow the weights batch by batch, not only on average.

The weights can change at given training steps (`[data] mixture_stages`, data/stages.py): window j is then
picked against the weights of the stage its training step is in, from the same sequence u_j.

A source whose shards are all read starts another epoch (re-shuffled); that is logged and
counted (`epochs`), and `[data] on_source_exhausted = "stop"` makes the trainer stop the run at
its next log step, on every rank at once (the counters are gathered there).
"""

from __future__ import annotations

import bisect
import hashlib
import json
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from data.config import DataConfig
from data.shards import ShardInfo
from data.stages import Stage, StageSchedule
from data.stream import PackedStream, new_state, state_from_json

logger = logging.getLogger(__name__)

ONE = 2**64
GOLDEN = (math.isqrt(5 * ONE * ONE) - ONE) // 2  # floor(2**64 * (sqrt(5) - 1) / 2), exactly
DEFAULT_SOURCE = "corpus"  # the name of the one source of `[data] paths` / `manifest`
MIXED_KEYS = ("windows", "sources", "tokens", "stage")
OPTIONAL_KEYS = ("stage",)  # states written before mixture stages lack it


@dataclass(frozen=True)
class Source:
    name: str
    weight: float
    paths: tuple[str, ...] = ()
    manifest: str = ""


def parse_source(spec: str) -> Source:
    """'name=weight:path[+path...]' or 'name=weight:@manifest.txt' -> Source; a ValueError quotes the entry.
    Paths are joined with '+', as torchtitan's command line splits a list at commas."""
    head, sep, where = spec.partition(":")
    name, eq, weight = head.partition("=")
    name = name.strip()
    if not (sep and eq and name and where.strip()):
        raise ValueError(
            f"[data] mixture entry {spec!r}: expected 'name=weight:paths' (paths: globs or folders joined "
            "with +, or @manifest.txt), e.g. 'web=0.7:/data/web/*.parquet'"
        )
    if not all(c.isalnum() or c in "-_." for c in name):
        raise ValueError(f"[data] mixture entry {spec!r}: source name {name!r} may hold letters, digits, - _ . only")
    try:
        w = float(weight)
    except ValueError:
        raise ValueError(f"[data] mixture entry {spec!r}: weight {weight!r} is not a number") from None
    if not (math.isfinite(w) and w > 0):
        raise ValueError(f"[data] mixture entry {spec!r}: weight {w} must be positive and finite")
    where = where.strip()
    if where.startswith("@"):
        return Source(name, w, manifest=where[1:])
    return Source(name, w, paths=tuple(p.strip() for p in where.split("+") if p.strip()))


def parse_mixture(cfg: DataConfig) -> list[Source]:
    """The run's sources: `[data] mixture`, or the one source of `paths` / `manifest`, named 'corpus'."""
    if not cfg.mixture:
        return [Source(DEFAULT_SOURCE, 1.0, tuple(cfg.paths), cfg.manifest)]
    if cfg.paths or cfg.manifest:
        raise ValueError("[data] mixture replaces paths and manifest: set either the mixture or paths/manifest")
    sources = [parse_source(spec) for spec in cfg.mixture]
    names = [s.name for s in sources]
    if len(set(names)) != len(names):
        raise ValueError(f"[data] mixture names a source twice: {names}")
    return sources


@dataclass(frozen=True)
class ValidationSet:
    """A named validation set: shards of its own, or the documents of a mixture source (`heldout`; '*':
    every source) held out of training by `validation_fraction`."""

    name: str
    paths: tuple[str, ...] = ()
    manifest: str = ""
    heldout: str | None = None


def parse_validation_sets(cfg: DataConfig) -> list[ValidationSet]:
    """`[data] validation_sets`, or the one set 'val': validation_paths, else the held-out fraction."""
    if not cfg.validation_sets:
        if cfg.validation_paths:
            return [ValidationSet("val", tuple(cfg.validation_paths))]
        if cfg.validation_fraction > 0:
            return [ValidationSet("val", heldout="*")]
        raise ValueError("[data] no validation set: set validation_sets, validation_paths or validation_fraction")
    names = [s.name for s in parse_mixture(cfg)]
    out = []
    for spec in cfg.validation_sets:
        name, sep, where = (part.strip() for part in spec.partition(":"))
        if not (sep and name and where) or not all(c.isalnum() or c in "-_." for c in name):
            raise ValueError(
                f"[data] validation_sets entry {spec!r}: expected 'name:paths' (globs or folders joined with +, "
                "or @manifest.txt) or 'name:heldout=SOURCE', the name of letters, digits, - _ ."
            )
        if where.startswith("heldout="):
            source = where.removeprefix("heldout=")
            if source != "*" and source not in names:
                raise ValueError(f"[data] validation_sets entry {spec!r}: no mixture source {source!r} ({names})")
            if cfg.validation_fraction <= 0:
                raise ValueError(f"[data] validation_sets entry {spec!r} holds documents out: set validation_fraction")
            out.append(ValidationSet(name, heldout=source))
        elif where.startswith("@"):
            out.append(ValidationSet(name, manifest=where[1:]))
        else:
            out.append(ValidationSet(name, tuple(p.strip() for p in where.split("+") if p.strip())))
    if len({v.name for v in out}) != len(out):
        raise ValueError(f"[data] validation_sets names a set twice: {[v.name for v in out]}")
    return out


def bounds(weights: list[float]) -> list[int]:
    """The upper ends of the first len-1 weight intervals of [0, 2**64), for `pick`."""
    total, acc, out = sum(weights), 0.0, []
    for w in weights[:-1]:
        acc += w
        out.append(round(acc / total * ONE))
    return out


def phase(seed: int, stream: int) -> int:
    digest = hashlib.blake2b(f"mixture:{seed}:{stream}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def pick(start: int, j: int, edges: list[int]) -> int:
    """The source index of window j of a stream whose sequence starts at `start` (its phase)."""
    return bisect.bisect_right(edges, (start + j * GOLDEN) % ONE)


# -- state -------------------------------------------------------------------------------------


def new_stage_state(number: int, names: list[str]) -> dict[str, Any]:
    """The stage a stream's last window was in and the tokens each source delivered in it."""
    return {"number": number, "tokens": {n: 0 for n in names}}


def new_mixed_state(names: list[str]) -> dict[str, Any]:
    return {
        "windows": 0,
        "sources": {n: new_state() for n in names},
        "tokens": {n: 0 for n in names},
        "stage": new_stage_state(1, names),
    }


def mixed_state_to_json(state: dict[str, Any]) -> str:
    return json.dumps(state, sort_keys=True, separators=(",", ":"))


def mixed_state_from_json(key: str, value: object, names: list[str]) -> dict[str, Any]:
    """A stream's checkpointed state for the sources `names`. A state of one source from before mixtures
    existed (flat keys) is read as that source's. Sources the state has and the mixture lacks are dropped,
    sources it lacks start from their beginning, each logged: the fingerprint refuses a changed mixture
    unless `[checkpoint] allow_changes` has 'data'."""
    if not isinstance(value, str):
        state_from_json(key, value)  # its message for bytes (a pickled state) and other types
    try:
        raw = json.loads(value)  # type: ignore[arg-type]
    except json.JSONDecodeError as e:
        raise ValueError(f"{key}: not a JSON stream state ({e})") from e
    if isinstance(raw, dict) and "sources" not in raw:  # one source, as written before mixtures
        if len(names) != 1:
            raise ValueError(
                f"{key}: a single-source stream state, but the mixture has {len(names)} sources ({names}); "
                "resume with the run's own data settings"
            )
        flat = state_from_json(key, value)
        state = new_mixed_state(names)
        state.update(windows=flat["batches"], sources={names[0]: flat})
        return state
    if not isinstance(raw, dict):
        raise ValueError(f"{key}: not a JSON stream state (a JSON {type(raw).__name__}, not an object)")
    if not set(MIXED_KEYS) - set(OPTIONAL_KEYS) <= set(raw) <= set(MIXED_KEYS):
        raise ValueError(f"{key}: not a mixture stream state (keys {sorted(raw)}, expected {list(MIXED_KEYS)})")
    if type(raw["windows"]) is not int or raw["windows"] < 0:
        raise ValueError(f"{key}.windows: {raw['windows']!r} is not a non-negative integer")
    sources, tokens = raw["sources"], raw["tokens"]
    if not isinstance(sources, dict) or not isinstance(tokens, dict) or set(sources) != set(tokens):
        raise ValueError(f"{key}: sources and tokens must be objects over the same source names")
    state = new_mixed_state(names)
    state["windows"] = raw["windows"]
    for name in sources:
        if name not in names:
            logger.warning(f"[data] {key}: source {name!r} is no longer in the mixture; its position is dropped")
            continue
        state["sources"][name] = state_from_json(f"{key}.sources.{name}", json.dumps(sources[name]))
        if type(tokens[name]) is not int or tokens[name] < 0:
            raise ValueError(f"{key}.tokens.{name}: {tokens[name]!r} is not a non-negative integer")
        state["tokens"][name] = tokens[name]
    for name in names:
        if name not in sources:
            logger.warning(f"[data] {key}: source {name!r} is new to the mixture; it starts at its beginning")
    # written before stages: one stage, the whole run so far
    stage = raw.get("stage", {"number": 1, "tokens": state["tokens"]})
    state["stage"] = _stage_from_json(f"{key}.stage", stage, names)
    return state


def _stage_from_json(key: str, raw: object, names: list[str]) -> dict[str, Any]:
    if not isinstance(raw, dict) or set(raw) != {"number", "tokens"} or not isinstance(raw["tokens"], dict):
        raise ValueError(f"{key}: expected an object with number and tokens, got {raw!r}")
    if type(raw["number"]) is not int or raw["number"] < 1:
        raise ValueError(f"{key}.number: {raw['number']!r} is not a stage number (1, 2, ...)")
    stage = new_stage_state(raw["number"], names)
    for name, n in raw["tokens"].items():
        if type(n) is not int or n < 0:
            raise ValueError(f"{key}.tokens.{name}: {n!r} is not a non-negative integer")
        if name in names:
            stage["tokens"][name] = n
    return stage


# -- the stream --------------------------------------------------------------------------------


class MixedStream:
    """One logical stream over every source: window j from source `pick(phase, j)`."""

    def __init__(
        self,
        stream: int,
        sources: list[Source],
        shards: dict[str, list[str]],
        cfg: DataConfig,
        encode: Callable[[list[str]], list[list[int]]],
        eos_id: int,
        state: dict[str, Any] | None = None,
        keep: Callable[[str], bool] = lambda text: True,
        infos: dict[str, ShardInfo] | None = None,
        schedule: StageSchedule | None = None,
    ):
        """`schedule`: the weights by training step (default: the mixture's own at every step)."""
        names = [s.name for s in sources]
        self.stream, self.names = stream, names
        self.state = state if state is not None else new_mixed_state(names)
        self.schedule = schedule or StageSchedule([Stage(1, 1, tuple(s.weight for s in sources))])
        self.edges = {stage.number: bounds(list(stage.weights)) for stage in self.schedule.stages}
        self.start = phase(cfg.seed, stream)
        self.subs = {
            n: PackedStream(stream, shards[n], cfg, encode, eos_id, self.state["sources"][n], keep, infos=infos)
            for n in names
        }

    def next_batch(self, batch: int, seq_len: int, step: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """`batch` windows of training step `step` (its stage's weights pick their sources)."""
        number = self.schedule.at(step).number
        if self.state["stage"]["number"] != number:
            self.state["stage"] = new_stage_state(number, self.names)
        edges = self.edges[number]
        rows = []
        for _ in range(batch):
            name = self.names[pick(self.start, self.state["windows"], edges)]
            sub = self.subs[name]
            epoch = sub.state["epoch"]
            out = sub.next_batch(1, seq_len)
            assert out is not None  # training streams are endless
            rows.append(out)
            if sub.state["epoch"] != epoch:
                logger.info(
                    f"[data] stream {self.stream}: source {name!r} read to its end; epoch {sub.state['epoch']} "
                    "begins (re-shuffled)"
                )
            self.state["windows"] += 1
            self.state["tokens"][name] += seq_len
            self.state["stage"]["tokens"][name] += seq_len
        return torch.cat([r[0] for r in rows]), torch.cat([r[1] for r in rows])

    def snapshot(self) -> dict[str, Any]:
        return {
            "windows": self.state["windows"],
            "sources": {n: sub.snapshot() for n, sub in self.subs.items()},
            "tokens": dict(self.state["tokens"]),
            "stage": {"number": self.state["stage"]["number"], "tokens": dict(self.state["stage"]["tokens"])},
        }
