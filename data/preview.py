"""Look at the data before a long run: the first packed windows and per-source statistics.

python -m data.preview configs/X.toml [--rank R --world W] [--n N] [--json] [--section.key value ...]
"""

from __future__ import annotations

import argparse
import json
import sys

from torchtitan.components.tokenizer import HuggingFaceTokenizer
from torchtitan.config import JobConfig

from data.loader import Encoder, ParquetDataLoader, data_config
from data.shards import BadShardError, NoDataError, check_shards, list_shards
from mhar_titan.config import parse_config


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--world", type=int, default=1)
    parser.add_argument("--n", type=int, default=4, help="windows to show")
    parser.add_argument("--json", action="store_true", help="token ids as JSON lines instead of text")
    args, overrides = parser.parse_known_args(argv)
    job = parse_config(["--job.config_file", args.config, *overrides])
    try:
        show(job, args)
    except (NoDataError, BadShardError) as e:  # the message names the shards: no traceback needed
        sys.exit(f"data.preview: {type(e).__name__}: {e}")


def show(job: JobConfig, args: argparse.Namespace) -> None:
    cfg = data_config(job)
    shards = check_shards(list_shards(cfg.paths, cfg.manifest), cfg.text_column, cfg.source_column, cfg.on_bad_shard)
    tokenizer = HuggingFaceTokenizer(job.model.hf_assets_path)
    loader = ParquetDataLoader(cfg, shards, Encoder(tokenizer), job.training.seq_len, 1, args.rank, args.world)
    it = iter(loader)
    for i in range(args.n):
        batch, labels = next(it)
        window = batch["input"][0].tolist() + [labels[0, -1].item()]
        stream = loader.local[i % len(loader.local)]
        if args.json:
            print(json.dumps({"window": i, "stream": stream, "ids": window}))
        else:
            print(f"--- window {i} (stream {stream}, {len(window)} tokens) ---")
            print(tokenizer.decode(window))
    counters = loader.counters()
    out = sys.stderr if args.json else sys.stdout
    print(f"--- {len(shards)} shards; after {args.n} windows on rank {args.rank} of {args.world}:", file=out)
    total = sum(v for k, v in counters.items() if k.startswith("tokens/")) or 1
    for key, value in sorted(counters.items()):
        share = f" ({value / total:.1%} of tokens)" if key.startswith("tokens/") else ""
        print(f"  {key}: {value:,}{share}", file=out)


if __name__ == "__main__":
    main()
