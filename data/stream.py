"""The document order and one logical stream: shards -> documents -> tokens -> windows.

Order, a function of (seed, epoch) and the shards' paths below the corpus's common folder
alone (not where the corpus lies): the epoch's shards are permuted and
dealt round-robin to `num_streams` logical streams; inside a shard the row
groups are permuted and the rows of each row group permuted (a shuffle bounded
by the row-group size). A stream joins its documents with the end-of-text id
and cuts the token stream into windows of seq_len + 1 tokens: no padding, no
token dropped or repeated, long documents running on into the next window.

A stream's state (epoch, shard, row group, row, leftover tokens, counters) is
all it needs to continue exactly, without re-reading or re-tokenising earlier
documents; states are independent of ranks and loader workers.
"""

from __future__ import annotations

import copy
import logging
import random
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from data.config import DataConfig
from data.shards import BadShardError, read_row_group, shard_info

logger = logging.getLogger(__name__)


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


def new_state() -> dict[str, Any]:
    return {
        "epoch": 0,
        "shard": 0,
        "row_group": 0,
        "row": 0,
        "buffer": [],
        "batches": 0,
        "docs": 0,
        "skipped_docs": 0,
        "skipped_shards": 0,
        "held_out_docs": 0,
        "source_tokens": {},
    }


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
    ):
        """`keep` selects documents (the rest are counted as held out); `validation` makes the
        stream finite and sequential over `shards` (no permutation, one pass)."""
        self.stream, self.shards, self.cfg = stream, shards, cfg
        self.encode, self.eos_id, self.keep, self.validation = encode, eos_id, keep, validation
        self.state = copy.deepcopy(state) if state is not None else new_state()
        self.keys = shard_keys(shards)
        self._groups: dict[tuple[str, int], list[tuple[int, int]]] = {}
        self._pending: deque[tuple[list[int] | None, str | None, dict[str, int]]] = deque()
        self._read: dict[str, int] | None = None  # read cursor, ahead of the state's
        self._rows: tuple[str, int, list[str | None], list[str | None], list[int]] | None = None

    # -- order ---------------------------------------------------------------------------------

    def _epoch_shards(self, epoch: int) -> list[str]:
        if self.validation:
            return self.shards
        return epoch_streams(self.shards, self.cfg.seed, epoch, self.cfg.num_streams)[self.stream]

    def _row_groups(self, path: str, epoch: int) -> list[tuple[int, int]]:
        """(row group, rows) in this epoch's order; checks the shard's schema on first use."""
        if (path, epoch) not in self._groups:
            sizes = shard_info(path, self.cfg.text_column, self.cfg.source_column).row_groups
            order = list(range(len(sizes)))
            if not self.validation:
                order = _permutation(len(sizes), f"rg:{self.cfg.seed}:{epoch}:{self.keys[path]}")
            self._groups = {(path, epoch): [(rg, sizes[rg]) for rg in order]}
        return self._groups[(path, epoch)]

    # -- reading -------------------------------------------------------------------------------

    def _refill(self) -> bool:
        """Tokenise the next chunk of documents after the read cursor; False at the end of a finite stream."""
        cur = dict(self._read or {k: self.state[k] for k in ("epoch", "shard", "row_group", "row")})
        while True:
            shards = self._epoch_shards(cur["epoch"])
            if cur["shard"] >= len(shards):
                if self.validation:
                    self._read = cur
                    return False
                cur = {"epoch": cur["epoch"] + 1, "shard": 0, "row_group": 0, "row": 0}
                continue
            path = shards[cur["shard"]]
            try:
                groups = self._row_groups(path, cur["epoch"])
                if cur["row_group"] >= len(groups):
                    cur = {**cur, "shard": cur["shard"] + 1, "row_group": 0, "row": 0}
                    continue
                rg, n_rows = groups[cur["row_group"]]
                if cur["row"] >= n_rows:
                    cur = {**cur, "row_group": cur["row_group"] + 1, "row": 0}
                    continue
                texts, sources, order = self._row_group(path, cur["epoch"], rg)
            except BadShardError as e:
                if self.cfg.on_bad_shard != "skip":
                    raise
                logger.warning(f"[data] skipping shard: {e}")
                nxt = {**cur, "shard": cur["shard"] + 1, "row_group": 0, "row": 0}
                self._pending.append((None, None, nxt | {"skipped_shards": 1}))
                cur = nxt
                self._read = cur
                return True
            chunk = order[cur["row"] : cur["row"] + self.cfg.tokenize_batch]
            docs, kinds = [], []
            for i in chunk:
                text = texts[i]  # a string or None: shard_info checked the column's type
                if not text:
                    kinds.append("skipped_docs")
                elif not self.keep(text):
                    kinds.append("held_out_docs")
                else:
                    kinds.append("doc")
                    docs.append(text)
            encoded = iter(self.encode(docs)) if docs else iter(())
            for j, (i, kind) in enumerate(zip(chunk, kinds, strict=True)):
                pos = {**cur, "row": cur["row"] + j + 1}
                if kind == "doc":
                    self._pending.append((next(encoded), sources[i], pos))
                else:
                    self._pending.append((None, None, pos | {kind: 1}))
            cur = {**cur, "row": cur["row"] + len(chunk)}
            self._read = cur
            return True

    def _row_group(self, path: str, epoch: int, rg: int) -> tuple[list[str | None], list[str | None], list[int]]:
        if self._rows is None or self._rows[:2] != (path, rg):
            texts, sources = read_row_group(path, rg, self.cfg.text_column, self.cfg.source_column)
            order = list(range(len(texts)))
            if not self.validation:
                order = _permutation(len(texts), f"row:{self.cfg.seed}:{epoch}:{self.keys[path]}:{rg}")
            self._rows = (path, rg, texts, sources, order)
        return self._rows[2], self._rows[3], self._rows[4]

    def _append_next_doc(self) -> bool:
        if not self._pending and not self._refill():
            return False
        if not self._pending:
            return True
        tokens, source, pos = self._pending.popleft()
        st = self.state
        for key in ("skipped_docs", "skipped_shards", "held_out_docs"):
            st[key] += pos.pop(key, 0)
        st.update(pos)
        if tokens is not None:
            st["buffer"].extend(tokens)
            st["buffer"].append(self.eos_id)
            st["docs"] += 1
            if source is not None:
                st["source_tokens"][source] = st["source_tokens"].get(source, 0) + len(tokens) + 1
        return True

    # -- windows -------------------------------------------------------------------------------

    def next_batch(self, batch: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """[batch, seq_len] inputs and labels, or None when a finite (validation) stream is spent."""
        need = batch * (seq_len + 1)
        while len(self.state["buffer"]) < need:
            if not self._append_next_doc():
                return None
        buf = self.state["buffer"]
        window = torch.tensor(buf[:need], dtype=torch.long).view(batch, seq_len + 1)
        del buf[:need]
        self.state["batches"] += 1
        return window[:, :-1].contiguous(), window[:, 1:].contiguous()
