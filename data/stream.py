"""The document order and one logical stream: shards -> documents -> tokens -> windows.

Order, a function of (seed, epoch) and the shards' paths below the corpus's common folder
alone (not where the corpus lies): the epoch's shards are permuted and
dealt round-robin to `num_streams` logical streams; inside a shard the row
groups are permuted and the rows of each row group permuted (a shuffle bounded
by the row-group size). A stream joins its documents with the end-of-text id
and cuts the token stream into windows of seq_len + 1 tokens: no padding, no
token dropped or repeated, long documents running on into the next window.

A stream's state is small whatever the documents' lengths (no tokens in it): the read
position (epoch, shard, row_group, row) of the head item, the first row whose tokens are
not all delivered, and `offset`, how many of the head document's tokens (its end-of-text
token included) were delivered. Resuming re-reads and re-tokenises from the head and drops
`offset` tokens: an exact continuation. Counters count what was delivered: a document when
its last token is, source tokens as they are, and empty, held-out rows and skipped shards
when the head passes them. States are independent of ranks and loader workers.
"""

from __future__ import annotations

import copy
import json
import logging
import random
from collections import deque
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from data.config import DataConfig
from data.shards import (
    BadShardError,
    NoDataError,
    Scan,
    ShardInfo,
    find_documents,
    name_paths,
    read_row_group,
    shard_info,
)

logger = logging.getLogger(__name__)

POSITION = ("epoch", "shard", "row_group", "row")
COUNTERS = ("docs", "skipped_docs", "skipped_shards", "held_out_docs", "truncated_docs", "truncated_tokens")
STATE_INTS = (*POSITION, "offset", "batches", *COUNTERS)
Position = tuple[int, int, int, int]


def epoch_streams(shards: list[str], seed: int, epoch: int, num_streams: int) -> list[list[str]]:
    """The shards of each logical stream in one epoch."""
    if len(shards) < num_streams:
        raise ValueError(f"[data] num_streams = {num_streams} exceeds the number of shards ({len(shards)})")
    order = list(shards)
    random.Random(f"shards:{seed}:{epoch}").shuffle(order)
    return [order[s::num_streams] for s in range(num_streams)]


def shard_keys(shards: list[str]) -> dict[str, str]:
    """Each shard's path below the corpus's common folder: what the order is keyed by, so the same
    corpus copied to another place (local SSD, another bucket) is read in the same order."""
    parts = [s.split("/") for s in shards]
    common = 0
    while all(len(p) > common + 1 and p[common] == parts[0][common] for p in parts):
        common += 1
    return {s: "/".join(p[common:]) for s, p in zip(shards, parts, strict=True)}


def _permutation(n: int, key: str) -> list[int]:
    perm = list(range(n))
    random.Random(key).shuffle(perm)
    return perm


# -- state -------------------------------------------------------------------------------------


def new_state() -> dict[str, Any]:
    return {key: 0 for key in STATE_INTS} | {"source_tokens": {}}


def state_to_json(state: dict[str, Any]) -> str:
    """The checkpointed form of a stream's state: plain JSON, loaded without running any code."""
    return json.dumps(state, sort_keys=True, separators=(",", ":"))


def state_from_json(name: str, value: object) -> dict[str, Any]:
    """A stream state from its checkpointed JSON; anything else is a ValueError naming `name` (the key)."""
    if not isinstance(value, str):
        if isinstance(value, (bytes, bytearray)):
            raise ValueError(
                f"{name}: not a JSON stream state (bytes: a pickled state from an older mhar-titan?); "
                "refusing to unpickle it"
            )
        raise ValueError(f"{name}: not a JSON stream state (a {type(value).__name__}, not a str)")
    try:
        state = json.loads(value)
    except json.JSONDecodeError as e:
        raise ValueError(f"{name}: not a JSON stream state ({e})") from e
    if not isinstance(state, dict):
        raise ValueError(f"{name}: not a JSON stream state (a JSON {type(state).__name__}, not an object)")
    want = set(STATE_INTS) | {"source_tokens"}
    if set(state) != want:
        missing, unknown = sorted(want - set(state)), sorted(set(state) - want)
        raise ValueError(f"{name}: stream state keys differ (missing: {missing}, unknown: {unknown})")
    for key in STATE_INTS:
        if type(state[key]) is not int or state[key] < 0:
            raise ValueError(f"{name}.{key}: {state[key]!r} is not a non-negative integer")
    sources = state["source_tokens"]
    if not isinstance(sources, dict):
        raise ValueError(f"{name}.source_tokens: {sources!r} is not an object of source -> tokens")
    for source, n in sources.items():
        if type(n) is not int or n < 0:
            raise ValueError(f"{name}.source_tokens.{source}: {n!r} is not a non-negative integer")
    return state


class _RateLimitedLog:
    """Warnings of one kind: the first `first`, then the 10th, 100th, 1000th, ... (each with the
    running count), so a corpus of long documents does not flood the log."""

    def __init__(self, what: str, first: int = 10):
        self.what, self.first, self.seen = what, first, 0

    def warn(self, message: str) -> None:
        self.seen += 1
        n = self.seen
        if n <= self.first or str(n).rstrip("0") == "1":
            more = "; from now on only the 10th, 100th, 1000th, ... are logged" if n == self.first else ""
            logger.warning(f"[data] {message} [{self.what} {n}{more}]")


# Truncated documents: the first 10 in this process are logged, then the 100th, 1000th, ...
_TRUNCATIONS = _RateLimitedLog("truncation in this process")


class _Item(NamedTuple):
    """One row (or a skipped shard) read ahead of the head."""

    pos: Position  # where reading it starts
    after: Position  # the position after it
    tokens: torch.Tensor | None  # the document's tokens and its end-of-text id; None: nothing to deliver
    source: str | None
    event: str  # the counter it adds when passed: docs, skipped_docs, held_out_docs or skipped_shards
    truncated: int  # tokens cut by max_document_tokens


class PackedStream:
    """One logical stream; `next_batch` returns the next `batch` windows and advances the state."""

    def __init__(
        self,
        stream: int,
        shards: list[str],
        cfg: DataConfig,
        encode: Callable[[list[str]], list[list[int]]],
        eos_id: int,
        state: dict[str, Any] | None = None,
        keep: Callable[[str], bool] = lambda text: True,
        validation: bool = False,
        infos: dict[str, ShardInfo] | None = None,
    ):
        """`keep` selects documents (the rest are counted as held out); `validation` makes the
        stream finite and sequential over `shards` (no permutation, one pass); `infos`: the row
        groups the start-up check found (else each shard's footer is read when the stream gets to it)."""
        self.stream, self.shards, self.cfg = stream, shards, cfg
        self.infos = infos or {}
        self.encode, self.eos_id, self.keep, self.validation = encode, eos_id, keep, validation
        self.state = copy.deepcopy(state) if state is not None else new_state()
        self.keys = shard_keys(shards)
        self.seen = Scan()  # what was read (not delivered): for the messages when there is no data
        self._groups: dict[tuple[str, int], list[tuple[int, int]]] = {}
        self._rows: tuple[str, int, int, list[str | None], list[str | None], list[int]] | None = None
        self._queue: deque[_Item] = deque()  # read ahead: the head item first
        self._cursor: Position = tuple(self.state[k] for k in POSITION)  # type: ignore[assignment]
        self._offset = self.state["offset"]
        self._buffered = -self._offset  # tokens read ahead and not delivered
        # An epoch read from its start that yields no document may mean a corpus without any.
        self._epoch_seen: Scan | None = Scan() if self._cursor[1:] == (0, 0, 0) and not self._offset else None
        self._corpus_has_documents = False
        self._empty_epochs = _RateLimitedLog(f"empty epoch of stream {stream}", first=1)

    def snapshot(self) -> dict[str, Any]:
        """A copy of the state, for the main process to keep while the stream moves on."""
        return {**self.state, "source_tokens": dict(self.state["source_tokens"])}

    # -- order ---------------------------------------------------------------------------------

    def _epoch_shards(self, epoch: int) -> list[str]:
        if self.validation:
            return self.shards
        return epoch_streams(self.shards, self.cfg.seed, epoch, self.cfg.num_streams)[self.stream]

    def _row_groups(self, path: str, epoch: int) -> list[tuple[int, int]]:
        """(row group, rows) in this epoch's order; checks the shard's schema on first use."""
        if (path, epoch) not in self._groups:
            known = self.infos.get(path)
            sizes = (known or shard_info(path, self.cfg.text_column, self.cfg.source_column)).row_groups
            order = list(range(len(sizes)))
            if not self.validation:
                order = _permutation(len(sizes), f"rg:{self.cfg.seed}:{epoch}:{self.keys[path]}")
            self._groups = {(path, epoch): [(rg, sizes[rg]) for rg in order]}
        return self._groups[(path, epoch)]

    def _row_group(self, path: str, epoch: int, rg: int) -> tuple[list[str | None], list[str | None], list[int]]:
        # Keyed by the epoch too: a shard read at the end of one epoch and the start of the next is
        # permuted afresh (the order is a function of the epoch, not of what was read before).
        if self._rows is None or self._rows[:3] != (path, epoch, rg):
            texts, sources = read_row_group(path, rg, self.cfg.text_column, self.cfg.source_column)
            order = list(range(len(texts)))
            if not self.validation:
                order = _permutation(len(texts), f"row:{self.cfg.seed}:{epoch}:{self.keys[path]}:{rg}")
            self._rows = (path, epoch, rg, texts, sources, order)
        return self._rows[3], self._rows[4], self._rows[5]

    # -- reading -------------------------------------------------------------------------------

    def _count(self, field: str) -> None:
        for scan in filter(None, (self.seen, self._epoch_seen)):
            setattr(scan, field, getattr(scan, field) + 1)

    def _end_of_epoch(self, epoch: int) -> None:
        """A whole epoch without a document: an error if the corpus has none at all (no endless loop)."""
        seen, self._epoch_seen = self._epoch_seen, Scan()
        if seen is None or seen.documents:
            return
        mine = self._epoch_shards(epoch)
        if not self._corpus_has_documents:
            if sorted(mine) != sorted(self.shards):  # the other shards may hold documents
                seen = find_documents(self.shards, self.cfg.text_column, self.keep, self.cfg.on_bad_shard)
            if not seen.documents:
                raise NoDataError(
                    f"[data] no training data: {name_paths(self.shards)} yield no token in a whole pass over "
                    f"column {self.cfg.text_column!r} ({seen.describe()})"
                )
            self._corpus_has_documents = True
        self._empty_epochs.warn(f"stream {self.stream}: epoch {epoch} ({name_paths(mine)}) yielded no document")

    def _refill(self) -> bool:
        """Read and tokenise the next chunk of rows after the cursor; False at the end of a finite stream."""
        e, s, g, r = self._cursor
        while True:
            shards = self._epoch_shards(e)
            if s >= len(shards):
                if self.validation:
                    self._cursor = (e, s, g, r)
                    return False
                self._end_of_epoch(e)
                e, s, g, r = e + 1, 0, 0, 0
                continue
            path = shards[s]
            try:
                groups = self._row_groups(path, e)
                if g >= len(groups):
                    s, g, r = s + 1, 0, 0
                    continue
                rg, n_rows = groups[g]
                if r >= n_rows:
                    g, r = g + 1, 0
                    continue
                texts, sources, order = self._row_group(path, e, rg)
            except BadShardError as err:
                if self.cfg.on_bad_shard != "skip":
                    raise
                logger.warning(f"[data] skipping shard: {err}")
                self._count("skipped_shards")
                self._queue.append(_Item((e, s, g, r), (e, s + 1, 0, 0), None, None, "skipped_shards", 0))
                self._cursor = (e, s + 1, 0, 0)
                return True
            chunk = order[r : r + self.cfg.tokenize_batch]
            self._read_rows(path, rg, texts, sources, chunk, (e, s, g, r))
            self._cursor = (e, s, g, r + len(chunk))
            return True

    def _read_rows(
        self,
        path: str,
        rg: int,
        texts: list[str | None],
        sources: list[str | None],
        chunk: list[int],
        at: Position,
    ) -> None:
        events = []
        for i in chunk:
            text = texts[i]  # a string or None: shard_info checked the column's type
            events.append("skipped_docs" if not text else "docs" if self.keep(text) else "held_out_docs")
        docs = [texts[i] for i, event in zip(chunk, events, strict=True) if event == "docs"]
        encoded = iter(self.encode(docs)) if docs else iter(())  # type: ignore[arg-type]
        cap = self.cfg.max_document_tokens
        e, s, g, r = at
        for j, (i, event) in enumerate(zip(chunk, events, strict=True)):
            self._count("rows")
            self._count({"docs": "documents", "skipped_docs": "empty", "held_out_docs": "held_out"}[event])
            tokens, truncated = None, 0
            if event == "docs":
                ids = next(encoded)
                if cap and len(ids) > cap:
                    truncated = len(ids) - cap
                    ids = ids[:cap]
                    _TRUNCATIONS.warn(
                        f"{path}: row group {rg}, row {i}: document of {cap + truncated} tokens truncated to "
                        f"max_document_tokens = {cap}"
                    )
                ids.append(self.eos_id)
                tokens = torch.tensor(ids, dtype=torch.long)
                self._buffered += len(ids)
            self._queue.append(_Item((e, s, g, r + j), (e, s, g, r + j + 1), tokens, sources[i], event, truncated))

    # -- windows -------------------------------------------------------------------------------

    def next_batch(self, batch: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """[batch, seq_len] inputs and labels, or None when a finite (validation) stream is spent.

        A window is cut by slicing the documents read ahead: time linear in the window, whatever
        the documents' lengths."""
        need = batch * (seq_len + 1)
        while self._buffered < need:
            if not self._refill():
                return None
        st, pieces = self.state, []
        while need:
            item = self._queue[0]
            if self._offset and (item.tokens is None or self._offset >= len(item.tokens)):
                e, s, g, r = item.pos
                raise ValueError(
                    f"[data] stream {self.stream}: the state's head (epoch {e}, {self._epoch_shards(e)[s]}, "
                    f"row group {g} of the epoch's order, row {r}) is not a document of more than the "
                    f"{self._offset} tokens already delivered: the corpus or max_document_tokens changed since"
                )
            if item.tokens is None:
                self._pass(self._queue.popleft())
                continue
            start = self._offset
            take = min(need, len(item.tokens) - start)
            pieces.append(item.tokens[start : start + take])
            need -= take
            self._buffered -= take
            if item.source is not None:
                st["source_tokens"][item.source] = st["source_tokens"].get(item.source, 0) + take
            if start + take == len(item.tokens):
                self._offset = 0
                self._pass(self._queue.popleft())
            else:
                self._offset = start + take
                st.update(zip(POSITION, item.pos, strict=True))
        st["offset"] = self._offset
        st["batches"] += 1
        window = torch.cat(pieces).view(batch, seq_len + 1)
        return window[:, :-1].contiguous(), window[:, 1:].contiguous()

    def _pass(self, item: _Item) -> None:
        """The head moves past `item`: its counters count."""
        st = self.state
        st[item.event] += 1
        if item.truncated:
            st["truncated_docs"] += 1
            st["truncated_tokens"] += item.truncated
        st.update(zip(POSITION, item.after, strict=True))
