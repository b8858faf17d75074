"""Look at the data before a long run: the first packed windows, and the mixture's token shares.

python -m data.preview CONFIG [--rank R --world W] [--n N] [--batches B] [--json] [--section.key value ...]

Any further `--section.key value` arguments override the config as they do for train_cpt.py
(e.g. `--data.mixture web=0.7:/data/web code=0.3:/data/code --training.seq_len 512`).
"""

from __future__ import annotations

import argparse
import json
import sys

from torchtitan.components.tokenizer import HuggingFaceTokenizer
from torchtitan.config import JobConfig

from data.loader import Encoder, ParquetDataLoader, data_config, source_shards, source_shares
from data.mixture import parse_validation_sets
from data.shards import BadShardError, NoDataError
from mhar_titan.config import parse_config

BOUNDARY = "\n\u2502\u2502 end of document \u2502\u2502\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="Other arguments (--section.key value) override the config, as for train_cpt.py.",
    )
    parser.add_argument("config", help="the run's TOML config (its [data], [model] hf_assets_path, [training] seq_len)")
    parser.add_argument("--rank", type=int, default=0, help="the data-parallel rank whose batches to show (default 0)")
    parser.add_argument("--world", type=int, default=1, help="the number of data-parallel ranks (default 1)")
    parser.add_argument("--n", type=int, default=4, help="windows to print (default 4)")
    parser.add_argument(
        "--batches", type=int, default=0, help="batches (of [training] local_batch_size) read for the shares"
    )
    parser.add_argument(
        "--json", action="store_true", help="print one JSON object: windows (token ids), source_shares, counters"
    )
    args, overrides = parser.parse_known_args(argv)
    job = parse_config(["--job.config_file", args.config, *overrides])
    try:
        show(job, args)
    except (NoDataError, BadShardError, ValueError) as e:  # the message names the setting or shard
        sys.exit(f"data.preview: {type(e).__name__}: {e}")


def decode_marked(tokenizer: HuggingFaceTokenizer, ids: list[int]) -> str:
    """The window's text with every document boundary (the end-of-text token) shown as a rule."""
    pieces, current = [], []
    for i in ids:
        if i == tokenizer.eos_id:
            pieces.append(tokenizer.decode(current) + BOUNDARY)
            current = []
        else:
            current.append(i)
    return "".join(pieces) + tokenizer.decode(current)


def show(job: JobConfig, args: argparse.Namespace) -> None:
    cfg = data_config(job)
    parse_validation_sets(cfg)  # a wrong set is named here, not only when training builds its validator
    tokenizer = HuggingFaceTokenizer(job.model.hf_assets_path)
    batch = job.training.local_batch_size
    encode = Encoder(tokenizer, cfg.bos)
    loader = ParquetDataLoader(
        cfg,
        source_shards(cfg),
        encode,
        seq_len=job.training.seq_len,
        batch=batch,
        dp_rank=args.rank,
        dp_world=args.world,
    )
    it = iter(loader)
    batches = max(args.batches, -(-args.n // batch))
    windows = []
    for k in range(batches):
        inputs, labels = next(it)
        stream = loader.local[k % len(loader.local)]
        for row in range(inputs["input"].shape[0]):
            if len(windows) < args.n:
                ids = inputs["input"][row].tolist() + [labels[row, -1].item()]
                windows.append({"window": len(windows), "batch": k, "stream": stream, "ids": ids})
    counters = loader.counters()
    shares = source_shares(counters)
    if not shares:  # one source: all of it
        shares = {name: 1.0 for name in loader.names}
    if args.json:
        record = {"batches": batches, "rank": args.rank, "world": args.world, "source_shares": shares}
        print(json.dumps({**record, "counters": counters, "windows": windows}))
        return
    for w in windows:
        print(f"--- window {w['window']} (batch {w['batch']}, stream {w['stream']}, {len(w['ids'])} tokens) ---")
        print(decode_marked(tokenizer, w["ids"]))
    print(f"--- after {batches} batches of {batch} on rank {args.rank} of {args.world}:")
    for name, share in shares.items():
        weight = next(s.weight for s in loader.sources if s.name == name) / sum(s.weight for s in loader.sources)
        print(f"  source {name}: {share:.1%} of tokens (weight {weight:.1%}), {counters[f'mixture/{name}/tokens']:,}")
    total = sum(v for k, v in counters.items() if k.startswith("tokens/")) or 1
    for key, value in sorted(counters.items()):
        if not key.startswith("mixture/"):
            share = f" ({value / total:.1%} of tokens)" if key.startswith("tokens/") else ""
            print(f"  {key}: {value:,}{share}")


if __name__ == "__main__":
    main()
