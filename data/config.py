"""`[data]`: the sharded-parquet corpus, its order and its validation split."""

from dataclasses import dataclass, field


@dataclass
class DataConfig:
    paths: list[str] = field(default_factory=list)
    """Parquet shards: globs or paths, local or fsspec URLs (s3://, gs://). Empty: training.dataset_path."""
    manifest: str = ""
    """A text file with one shard path per line, instead of `paths`."""
    mixture: list[str] = field(default_factory=list)
    """Weighted named sources instead of `paths`: entries 'name=weight:paths' (paths: globs or folders joined
    with +, or @manifest.txt), e.g. ["web=0.7:/data/web", "math=0.3:/data/math/*.parquet"]; on the command
    line comma-separated: --data.mixture web=0.7:/data/web,math=0.3:/data/math. Each window
    comes from one source, picked by a low-discrepancy sequence of (seed, stream, window): shares follow the
    weights batch by batch; each source needs at least num_streams shards."""
    mixture_stages: list[str] = field(default_factory=list)
    """Mixture weights that change at training steps: entries 'STEP: name=weight name=weight ...' naming every
    mixture source (0 leaves one out), in force from training step STEP on (before the first entry, the
    mixture's own weights), e.g. ["7601: web=0.3 hq=0.7"] for an anneal mix over the last 20% of 9,500 steps;
    on the command line --data.mixture_stages "7601: web=0.3 hq=0.7" (entries comma-separated)."""
    on_source_exhausted: str = "repeat"
    """A source read to its end: 'repeat' starts its next epoch (re-shuffled; logged, counted as
    data/mixture/<name>/epochs); 'stop' also ends the run at the next log step, with a checkpoint."""
    text_column: str = "text"
    """The column holding each document's text; every shard must have it, as strings."""
    source_column: str = ""
    """Column with each document's source tag, for per-source token counters (empty: none)."""
    token_share_sources: int = 16
    """TensorBoard's data/token_share/<tag> for at most this many source-column tags, those with the most
    tokens so far (ties by tag name), the rest summed into data/token_share/other; 0: none."""
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
    """Validation shards, the set named 'val' (instead of the held-out fraction)."""
    validation_sets: list[str] = field(default_factory=list)
    """Named validation sets, each logged as val/<name>/ce and val/<name>/ce_ema: entries 'name:paths'
    (globs or folders joined with +, or @manifest.txt), or 'name:heldout=SOURCE' (the documents of mixture
    source SOURCE held out by validation_fraction). Empty: one set 'val' (validation_paths, or the
    held-out fraction of every source)."""
    tokenize_batch: int = 256
    """Documents tokenised per call."""
    max_document_tokens: int = 0
    """Documents longer than this many tokens are cut to it (before their end-of-text token), counted
    (truncated_docs, truncated_tokens) and logged, naming shard and row (the first 10 in a process,
    then the 100th, 1000th, ...); 0: no cap. Uncapped, a long document costs nothing extra per batch."""
    check_shards: bool = True
    """Check every shard's schema at start-up, once per job (rank 0, from the shard index `_index.json`
    beside the shards where there is one, else reading the footers in parallel) and shared with every
    rank: a bad shard then stops all ranks at once (or is skipped everywhere)."""
    bos: str = "auto"
    """A begin-of-text token before each document: 'auto' as the tokenizer's own template does (Marin-8B's
    Llama-3 tokenizer prepends <|begin_of_text|>, and Marin's pre-training documents start with it),
    'always' (the tokenizer's bos token; an error without one), 'never'. Documents always end with eos."""
    loss_on_document_start: bool = True
    """false: the label after each eos (the next document's first token, bos where documents have one) is left
    out of the loss and the token counts, in training and validation: nothing of its own document precedes it.
    Usually paired with `[model] attention_mask = "block_causal"`."""

    def validate(self) -> None:
        if self.on_source_exhausted not in ("repeat", "stop"):
            raise ValueError(f"[data] on_source_exhausted = {self.on_source_exhausted!r} must be 'repeat' or 'stop'")
        if self.bos not in ("auto", "always", "never"):
            raise ValueError(f"[data] bos = {self.bos!r} must be 'auto', 'always' or 'never'")
        if self.on_bad_shard not in ("error", "skip"):
            raise ValueError(f"[data] on_bad_shard = {self.on_bad_shard!r} must be 'error' or 'skip'")
        if self.num_streams <= 0:
            raise ValueError(f"[data] num_streams = {self.num_streams} must be positive")
        if self.token_share_sources < 0:
            raise ValueError(
                f"[data] token_share_sources = {self.token_share_sources} must be >= 0 (0: no per-source token shares)"
            )
        if self.max_document_tokens < 0:
            raise ValueError(f"[data] max_document_tokens = {self.max_document_tokens} must be >= 0 (0: no cap)")
        if not 0.0 <= self.validation_fraction < 1.0:
            raise ValueError(f"[data] validation_fraction = {self.validation_fraction} must be in [0, 1)")
