"""A corpus's content identity: one digest over its shards' keys, sizes and footer digests.

The run fingerprint's path digest cannot see a corpus re-prepared in place (same paths, other
documents). Each usable shard's (key below the corpus folder, size in bytes, footer digest) is
known after start-up (`ShardInfo`, from the shard index or the footers) at no extra request;
`contents_digest` hashes them in key order, so a copy of the corpus elsewhere gives the same
digest and a rewritten shard does not. `contents_changes` names the shards that differ between
two such records, for an error message that says what changed.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from data.shards import ShardInfo
from data.stream import shard_keys


def shard_contents(infos: Iterable[ShardInfo]) -> dict[str, tuple[int, str]]:
    """Shard key (`data.stream.shard_keys`: the path below the shards' common folder) -> (size, footer
    digest), in key order: what `contents_digest` hashes, and what `contents_changes` compares."""
    infos = list(infos)
    keys = shard_keys([info.path for info in infos])
    contents: dict[str, tuple[int, str]] = {}
    for info in infos:
        if keys[info.path] in contents:
            raise ValueError(f"[data] shard {info.path} is listed twice")
        contents[keys[info.path]] = (info.size, info.footer)
    return dict(sorted(contents.items()))


def contents_digest(infos: Iterable[ShardInfo]) -> str:
    """One digest (blake2b, 16 bytes, hex) of a source's usable shards: their keys, sizes and footer
    digests in key order; independent of where the corpus lies and of the order given."""
    rows = [[key, size, footer] for key, (size, footer) in shard_contents(infos).items()]
    return hashlib.blake2b(json.dumps(rows, separators=(",", ":")).encode(), digest_size=16).hexdigest()


@dataclass(frozen=True)
class ContentsChanges:
    """The shard keys that differ between a recorded and a current `shard_contents`, each list sorted."""

    added: list[str]
    removed: list[str]
    resized: list[str]  # another size (and so, in practice, another footer)
    rewritten: list[str]  # the same size, another footer digest

    def __bool__(self) -> bool:
        return bool(self.added or self.removed or self.resized or self.rewritten)

    def describe(self, first: int = 4) -> str:
        """One line for a message: `2 rewritten (a.parquet, b.parquet); 1 added (c.parquet)`."""
        parts = []
        for what, keys in (
            ("added", self.added),
            ("removed", self.removed),
            ("resized", self.resized),
            ("rewritten, same size", self.rewritten),
        ):
            if keys:
                parts.append(f"{len(keys)} {what} ({', '.join(keys[:first])}{', ...' if len(keys) > first else ''})")
        return "; ".join(parts) or "no shard differs"


def contents_changes(
    recorded: Mapping[str, Sequence[int | str]], current: Mapping[str, Sequence[int | str]]
) -> ContentsChanges:
    """Which shards differ between two `shard_contents` mappings (key -> (size, footer digest); lists, as
    JSON reads them back, compare equal to tuples)."""
    common = sorted(set(recorded) & set(current))
    return ContentsChanges(
        added=sorted(set(current) - set(recorded)),
        removed=sorted(set(recorded) - set(current)),
        resized=[key for key in common if recorded[key][0] != current[key][0]],
        rewritten=[
            key for key in common if recorded[key][0] == current[key][0] and recorded[key][1] != current[key][1]
        ],
    )
