"""`[data]`: the sharded-parquet corpus, its order and its validation split."""

from dataclasses import dataclass, field


@dataclass
class DataConfig:
    paths: list[str] = field(default_factory=list)
    """Parquet shards: globs or paths, local or fsspec URLs (s3://, gs://). Empty: training.dataset_path."""
    manifest: str = ""
    """A text file with one shard path per line, instead of `paths`."""
    text_column: str = "text"
    source_column: str = ""
    """Column with each document's source tag, for per-source token counters (empty: none)."""
    seed: int = 0
    """The data order is a function of (seed, epoch) alone: both arms of a pair share it."""
    num_streams: int = 16
    """Logical streams the shards are dealt to; data-parallel ranks x loader workers must divide it,
    and it fixes the order whatever the number of ranks (resume may change the rank count)."""
    on_bad_shard: str = "error"
    """error: an unreadable shard, a missing text column or a non-string value stops the run.
    skip: the shard is skipped, logged and counted."""
    validation_fraction: float = 0.0
    """Documents held out for validation by a hash of their text (0: none)."""
    validation_paths: list[str] = field(default_factory=list)
    """Named validation shards (instead of, or besides, the held-out fraction)."""
    tokenize_batch: int = 256
    """Documents tokenised per call."""
    max_document_tokens: int = 0
    """Documents longer than this many tokens are cut to it (before their end-of-text token), counted
    (truncated_docs, truncated_tokens) and logged, naming shard and row (the first 10 in a process,
    then the 100th, 1000th, ...); 0: no cap. Uncapped, a long document costs nothing extra per batch."""
    check_shards: bool = True
    """Read every shard's footer at start-up, on every rank: a bad shard then stops all ranks at
    once (or is skipped everywhere) instead of one rank failing mid-run while the others wait."""

    def validate(self) -> None:
        if self.on_bad_shard not in ("error", "skip"):
            raise ValueError(f"[data] on_bad_shard = {self.on_bad_shard!r} must be 'error' or 'skip'")
        if self.num_streams <= 0:
            raise ValueError(f"[data] num_streams = {self.num_streams} must be positive")
        if self.max_document_tokens < 0:
            raise ValueError(f"[data] max_document_tokens = {self.max_document_tokens} must be >= 0 (0: no cap)")
        if not 0.0 <= self.validation_fraction < 1.0:
            raise ValueError(f"[data] validation_fraction = {self.validation_fraction} must be in [0, 1)")
