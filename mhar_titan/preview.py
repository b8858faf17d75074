"""Look at the data before a long run: the first packed windows, and the mixture's token shares.

python -m mhar_titan.preview CONFIG [--rank R --world W] [--step S] [--n N] [--batches B] [--json] [--section.key V ...]

The run's config is parsed as train_cpt.py parses it; what is shown is data/preview.py's. From `--step S` on
(default 1), the windows are picked as training picks them from that step on, with the weights of each mixture
stage it reaches ([data] mixture_stages), and the shares are counted per stage. The documents in those windows
are each source's first ones: the documents a stream reads at step S depend on everything it read before, which
the preview does not read.

Any further `--section.key value` arguments override the config as they do for train_cpt.py
(e.g. `--data.mixture web=0.7:/data/web code=0.3:/data/code --training.seq_len 512`).
"""

from __future__ import annotations

import argparse
import sys

from data.preview import show
from data.shards import BadShardError, NoDataError
from mhar_titan.config import parse_config


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="Other arguments (--section.key value) override the config, as for train_cpt.py.",
    )
    parser.add_argument("config", help="the run's TOML config (its [data], [model] hf_assets_path, [training] seq_len)")
    parser.add_argument("--rank", type=int, default=0, help="the data-parallel rank whose batches to show (default 0)")
    parser.add_argument("--world", type=int, default=1, help="the number of data-parallel ranks (default 1)")
    parser.add_argument("--step", type=int, default=1, help="the training step to start at (default 1)")
    parser.add_argument("--n", type=int, default=4, help="windows to print (default 4)")
    parser.add_argument(
        "--batches", type=int, default=0, help="batches (of [training] local_batch_size) read for the shares"
    )
    parser.add_argument(
        "--json", action="store_true", help="print one JSON object: windows (token ids), source_shares, counters"
    )
    args, overrides = parser.parse_known_args(argv)
    if args.step < 1 or args.world < 1 or not 0 <= args.rank < args.world:
        parser.error(f"--step {args.step} (from 1), --rank {args.rank} of --world {args.world}: out of range")
    try:
        job = parse_config(["--job.config_file", args.config, *overrides])
        show(job, args)
    except (NoDataError, BadShardError, ValueError, OSError) as e:  # the message names the setting, shard or file
        sys.exit(f"mhar_titan.preview: {type(e).__name__}: {e}")


if __name__ == "__main__":
    main()
