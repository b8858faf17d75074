"""Look at the data before a long run: the first packed windows, and the mixture's token shares.

The command line, which reads the run's config, is `python -m mhar_titan.preview` (mhar_titan/preview.py): the
data package does not import mhar_titan. `show` prints what the loader of a parsed JobConfig delivers (its [data],
[model] hf_assets_path and [training] seq_len and batch sizes) to the data-parallel rank asked for.

From step S on (default 1), the windows are picked as training picks them from that step on, with the
weights of each mixture stage it reaches ([data] mixture_stages), and the shares are counted per stage. The
documents in those windows are each source's first ones: the documents a stream reads at step S depend on
everything it read before, which the preview does not read.
"""

from __future__ import annotations

import argparse
import json
import sys

from torchtitan.components.tokenizer import HuggingFaceTokenizer
from torchtitan.config import JobConfig

from data.counters import mixture_counter, source_shares
from data.loader import Encoder, ParquetDataLoader, check_stages, data_config, source_shards
from data.mixture import parse_validation_sets
from data.stages import step_of_batch

BOUNDARY = "\n\u2502\u2502 end of document \u2502\u2502\n"


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


def accumulation(job: JobConfig, world: int) -> int:
    """Microbatches a rank takes a step with `world` ranks, from the config's global batch."""
    t = job.training
    g = t.global_batch_size if t.global_batch_size > 0 else t.local_batch_size * world
    steps, rest = divmod(g, t.local_batch_size * world)
    if rest or not steps:
        raise ValueError(
            f"[training] global_batch_size = {g} is not a multiple of local_batch_size x --world = "
            f"{t.local_batch_size} x {world}"
        )
    return steps


def read(loader: ParquetDataLoader, batches: int, n: int) -> tuple[list[dict], list[dict]]:
    """The first `n` windows of `batches` batches, and per stage reached the tokens each source delivered."""
    it, windows, stages = iter(loader), [], {}
    for k in range(batches):
        before = mixture_counter(loader.counters(), "tokens")
        inputs, labels = next(it)
        after = mixture_counter(loader.counters(), "tokens")
        number = loader.schedule.at(loader.step()).number
        tokens = stages.setdefault(number, dict.fromkeys(loader.names, 0))
        for name in loader.names:
            tokens[name] += after[name] - before[name]
        stream = loader.local[(loader.batches - 1) % len(loader.local)]
        for row in range(inputs["input"].shape[0]):
            if len(windows) < n:
                ids = inputs["input"][row].tolist() + [labels[row, -1].item()]
                windows.append({"window": len(windows), "batch": k, "stream": stream, "ids": ids})
    described = loader.schedule.describe(loader.names)
    out = []
    for number, tokens in stages.items():
        total = sum(tokens.values()) or 1
        out.append(
            {
                "stage": number,
                "from_step": described[number - 1]["start"],
                "weights": described[number - 1]["weights"],
                "source_shares": {name: t / total for name, t in tokens.items()},
            }
        )
    return windows, out


def show(job: JobConfig, args: argparse.Namespace) -> None:
    cfg = data_config(job)
    parse_validation_sets(cfg)  # a wrong set is named here, not only when training builds its validator
    check_stages(job)
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
        accumulation=accumulation(job, args.world),
    )
    loader.start_at(args.step)
    batches = max(args.batches, -(-args.n // batch))
    windows, stages = read(loader, batches, args.n)
    counters = loader.counters()
    shares = source_shares(counters)
    if not shares:  # one source: all of it
        shares = {name: 1.0 for name in loader.names}
    last = step_of_batch(loader.batches - 1, loader.accumulation)
    record = {
        "batches": batches,
        "rank": args.rank,
        "world": args.world,
        "step": args.step,
        "last_step": last,
        "source_shares": shares,
        "stages": stages,
        "counters": counters,
        "windows": windows,
    }
    if args.json:
        print(json.dumps(record))
    else:
        print_text(tokenizer, loader, record)


def print_text(tokenizer: HuggingFaceTokenizer, loader: ParquetDataLoader, r: dict) -> None:
    """The preview for a reader: the windows' text, then the shares per stage and the counters."""
    for w in r["windows"]:
        print(f"--- window {w['window']} (batch {w['batch']}, stream {w['stream']}, {len(w['ids'])} tokens) ---")
        print(decode_marked(tokenizer, w["ids"]))
    print(
        f"--- steps {r['step']}-{r['last_step']}: {r['batches']} batches of {loader.batch} on rank {r['rank']} of "
        f"{r['world']}:"
    )
    if loader.schedule.staged:
        for st in r["stages"]:
            got = ", ".join(
                f"{name} {st['source_shares'][name]:.1%} (weight {w:.1%})" for name, w in st["weights"].items()
            )
            print(f"  stage {st['stage']} (from step {st['from_step']}): {got}")
        if r["step"] > 1:
            print("  (the windows' documents are each source's first: what a stream reads at a later step depends on")
            print("  everything before it)")
    counters = r["counters"]
    for name, share in r["source_shares"].items():
        weight = next(s.weight for s in loader.sources if s.name == name) / sum(s.weight for s in loader.sources)
        print(f"  source {name}: {share:.1%} of tokens (weight {weight:.1%}), {counters[f'mixture/{name}/tokens']:,}")
    total = sum(v for k, v in counters.items() if k.startswith("tokens/")) or 1
    for key, value in sorted(counters.items()):
        if not key.startswith("mixture/"):
            share = f" ({value / total:.1%} of tokens)" if key.startswith("tokens/") else ""
            print(f"  {key}: {value:,}{share}")


if __name__ == "__main__":  # the command moved where the run's config can be parsed: say so, not run silently
    sys.exit("the preview's command line is python -m mhar_titan.preview CONFIG [...] (mhar_titan/preview.py)")
