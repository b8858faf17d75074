"""What `data.prepare` counts and reports: rows per input file and reason, the token estimate, the summary.

The estimate tokenises a deterministic sample of each source (every k-th document, k doubling while
the sample passes a few MB) and extrapolates tokens per byte to the source's bytes; when the sample
holds every document whole, the count is exact and says so. Nothing in the summary depends on the
time or the machine, so a rerun writes the same summary.json.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from tokenizers import Tokenizer

from data.readers import Skip

SAMPLE_BYTES = 4 << 20  # text per source tokenised for the estimate
EXAMPLES = 5  # problem locations kept per input file
MOSTLY_BAD = 0.5  # a file with more bad rows than this fraction is warned about by name


@dataclass
class FileStats:
    """What one input gave: rows read, documents written, rows not written by reason, first locations."""

    path: str
    kind: str
    source: str
    rows: int = 0
    documents: int = 0
    text_bytes: int = 0
    bad: dict[str, int] = field(default_factory=dict)
    empty: dict[str, int] = field(default_factory=dict)
    first_bad: list[str] = field(default_factory=list)
    first_empty: list[str] = field(default_factory=list)

    def skip(self, skip: Skip) -> None:
        self.rows += skip.count
        counts, first = (self.bad, self.first_bad) if skip.bad else (self.empty, self.first_empty)
        counts[skip.reason] = counts.get(skip.reason, 0) + skip.count
        if len(first) < EXAMPLES:
            first.append(skip.describe())

    @property
    def bad_rows(self) -> int:
        return sum(self.bad.values())


class Sample:
    """Every k-th document of one source, k doubling whenever the sample passes SAMPLE_BYTES: a spread
    over the whole source, deterministic, whatever its length."""

    def __init__(self) -> None:
        self.k, self.seen, self.bytes = 1, 0, 0
        self.docs: list[tuple[int, str, int]] = []
        self.complete = True  # every document, whole: the count is exact

    def add(self, text: str, size: int) -> None:
        i, self.seen = self.seen, self.seen + 1
        if i % self.k:
            return
        if size > SAMPLE_BYTES:  # one huge document: its start stands for it
            text = text[: SAMPLE_BYTES // 4]
            size, self.complete = len(text.encode("utf-8")), False
        self.docs.append((i, text, size))
        self.bytes += size
        while self.bytes > SAMPLE_BYTES and len(self.docs) > 1:
            self.k *= 2
            self.docs = [doc for doc in self.docs if doc[0] % self.k == 0]
            self.bytes = sum(doc[2] for doc in self.docs)
            self.complete = False


def bad_rows_problem(stats: list[FileStats], limit: float) -> str:
    """Why the bad rows of all inputs together exceed `limit` (naming the file with the most), or ""."""
    rows, bad = sum(st.rows for st in stats), sum(st.bad_rows for st in stats)
    if not rows or bad / rows <= limit:
        return ""
    worst = sorted(stats, key=lambda st: (-st.bad_rows, -st.bad_rows / max(st.rows, 1), st.path))
    lines = [
        f"{bad:,} of {rows:,} rows read are bad ({bad / rows:.2%} > --max-bad-fraction {limit:g}); nothing written. "
        f"Worst file: {worst[0].path}"
    ]
    for st in (st for st in worst[:10] if st.bad_rows):
        reasons = ", ".join(f"{k}: {v:,}" for k, v in sorted(st.bad.items()))
        lines.append(f"  {st.path}: {st.bad_rows:,} of {st.rows:,} rows bad ({reasons})")
        lines += [f"    {where}" for where in st.first_bad[:3]]
    return "\n".join(lines)


def estimate_tokens(
    samples: dict[str, Sample], sources: dict[str, dict[str, int]], tokenizer: Tokenizer, path: str
) -> dict[str, Any]:
    """Tokens per source: the sample's tokens per byte times the source's bytes, plus one end-of-text
    token per document (as the loader appends)."""
    total, exact = 0, all(s.complete for s in samples.values())
    for name, sample in sorted(samples.items()):
        texts = [text for _, text, _ in sample.docs]
        tokens = 0
        for start in range(0, len(texts), 256):  # in batches: a batch's encodings hold far more than its ids
            tokens += sum(
                len(e.ids) for e in tokenizer.encode_batch(texts[start : start + 256], add_special_tokens=False)
            )
        text_tokens = tokens if sample.complete else round(tokens / max(sample.bytes, 1) * sources[name]["text_bytes"])
        sources[name]["estimated_tokens"] = text_tokens + sources[name]["documents"]
        total += sources[name]["estimated_tokens"]
    method = (
        "exact: every document tokenised"
        if exact
        else f"estimate: every k-th document of each source up to {SAMPLE_BYTES >> 20} MiB tokenised, "
        "tokens per byte extrapolated to the source's bytes"
    )
    return {
        "total": total,
        "method": method + ", plus one end-of-text token per document",
        "tokenizer": path,
        "sampled_documents": sum(len(s.docs) for s in samples.values()),
        "sampled_bytes": sum(s.bytes for s in samples.values()),
    }


def describe(summary: dict[str, Any]) -> str:
    """The printed summary."""
    lines = [f"{summary['documents']:,} documents, {summary['text_bytes'] / 1e6:,.1f} MB of text"]
    tokens = summary["estimated_tokens"]
    for name, src in summary["sources"].items():
        est = f", ~{src['estimated_tokens']:,} tokens" if "estimated_tokens" in src else ""
        lines.append(f"  source {name}: {src['documents']:,} documents, {src['text_bytes'] / 1e6:,.1f} MB{est}")
    per = summary["documents_per_shard"]
    lines.append(
        f"{summary['shards']} shards ({per['min']:,} to {per['max']:,} documents each), {summary['row_groups']} row "
        f"groups of up to {summary['settings']['row_group_docs']:,} documents, zstd"
    )
    if tokens:
        lines.append(f"tokens: {tokens['total']:,} ({tokens['method']}; tokenizer {tokens['tokenizer']})")
    else:
        lines.append("tokens: not estimated (pass --tokenizer DIR for an estimate)")
    lines.append(
        f"rows read: {summary['rows_read']:,}; not written: {summary['bad_rows']:,} bad {summary['bad_by_reason']}, "
        f"{summary['empty_rows']:,} empty {summary['empty_by_reason']}"
    )
    troubled = [f for f in summary["files"] if f["bad"] or f["empty"]]
    troubled.sort(key=lambda f: (-sum(f["bad"].values()), -sum(f["empty"].values()), f["path"]))
    for f in troubled[:10]:
        lines.append(f"  {f['path']}: {f['rows']:,} rows, bad {f['bad']}, empty {f['empty']}")
        lines += [f"    {where}" for where in f["first_bad"] + f["first_empty"]]
    if len(troubled) > 10:
        lines.append(f"  ... and {len(troubled) - 10} more files with rows not written (summary.json lists them)")
    if summary["ignored_files"]:
        ignored = summary["ignored_files"]
        lines.append(f"ignored in input folders ({len(ignored)}, of no known kind): {', '.join(ignored[:5])}")
    lines += [f"WARNING: {w}" for w in summary["warnings"]]
    return "\n".join(lines)


def make_summary(
    stats: list[FileStats],
    ignored: list[str],
    shard_docs: list[int],
    row_groups: int,
    min_shards: int,
    settings: dict[str, Any],
    tokenizer: tuple[Tokenizer, str, dict[str, Sample]] | None = None,
) -> dict[str, Any]:
    """summary.json: what was written, from what, and what was not. `tokenizer`: (tokenizer, its path,
    the samples per source) for the token estimate."""
    sources: dict[str, dict[str, int]] = {}
    for st in stats:
        src = sources.setdefault(st.source, {"documents": 0, "text_bytes": 0})
        src["documents"] += st.documents
        src["text_bytes"] += st.text_bytes
    tokens = estimate_tokens(tokenizer[2], sources, tokenizer[0], tokenizer[1]) if tokenizer else None
    bad: dict[str, int] = {}
    empty: dict[str, int] = {}
    for st in stats:
        for into, counts in ((bad, st.bad), (empty, st.empty)):
            for reason, n in counts.items():
                into[reason] = into.get(reason, 0) + n
    warnings = []
    if len(shard_docs) < min_shards:
        warnings.append(
            f"{len(shard_docs)} shards, fewer than --min-shards {min_shards}: [data] num_streams must not "
            f"exceed the shard count (its default is 16); use --shards {min_shards} or a lower --docs-per-shard"
        )
    for st in stats:
        if st.rows and st.bad_rows / st.rows > MOSTLY_BAD:
            hint = " (wrong --text-key?)" if st.bad.get("missing text key", 0) * 2 > st.rows else ""
            warnings.append(f"{st.path}: {st.bad_rows:,} of {st.rows:,} rows bad {st.bad}{hint}")
    return {
        "documents": sum(st.documents for st in stats),
        "text_bytes": sum(st.text_bytes for st in stats),
        "sources": sources,
        "shards": len(shard_docs),
        "row_groups": row_groups,
        "documents_per_shard": {"min": min(shard_docs), "max": max(shard_docs)},
        "estimated_tokens": tokens,
        "rows_read": sum(st.rows for st in stats),
        "bad_rows": sum(bad.values()),
        "bad_by_reason": dict(sorted(bad.items())),
        "empty_rows": sum(empty.values()),
        "empty_by_reason": dict(sorted(empty.items())),
        "files": [asdict(st) for st in stats],
        "ignored_files": ignored,
        "warnings": warnings,
        "settings": settings,
    }
