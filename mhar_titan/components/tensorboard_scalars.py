"""Read scalars back from a run's TensorBoard event files, and the names of the routing statistics' tags
(one place for the trainer that writes them and the comparison that reads them).

Every start of a run writes a new event file into `<dump_folder>/tb` (one TensorBoard run per
arm, see step_metrics.one_tensorboard_run); steps it repeats after resuming from an earlier
checkpoint replace the old values, so the merged series is what the run finally computed.

    python -m mhar_titan.components.tensorboard_scalars RUN_DIR [--tag TAG]
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from mhar_titan.model.sources import BASE_SOURCES, STAT_NAMES

LOSS_TAG = "train/loss"
RESTARTS_TAG = "job/restarts"  # at a restarted job's first step: the crashes and hangs restarted after so far
PRIMARY_TAGS = {"raw": "val/ce", "ema": "val/ce_ema"}  # the first validation set's, whatever its name

# Routing statistics (docs/recipe.md, "The MHAR arm"). TensorBoard groups charts by a tag's first component, so
# each (sublayer, statistic) is a group of its own with one chart per layer, `mhar_<site>_<stat>/layerNN`
# (32 charts at 8B, in depth order), and `mhar/<stat>/mean` (the mean over all sites) is the overview group.
# A site's statistics: STAT_NAMES, `w_<source>` for each source it reads (SourceLayout.names), and DELTAS_STAT.
DELTAS_STAT = "w_deltas"  # the weights of all the deltas a site reads, summed
ROUTING_SITE_TAG = re.compile(r"^mhar_(?P<site>[a-z]+)_(?P<stat>\w+)/layer(?P<layer>\d+)$")
OLD_ROUTING_SITE_TAG = re.compile(r"^mhar/(?P<stat>\w+)/layer(?P<layer>\d+)_(?P<site>[a-z]+)$")  # before issue 23


# Per-layer norms (components/param_norms.py): one chart group a kind, one chart a layer or named part.
NORM_KINDS = ("weight", "grad", "update")
NORM_TAG = re.compile(r"^norms_(?P<kind>weight|grad|update)/(?P<group>\w+)$")


def norm_tag(kind: str, group: str) -> str:
    """The tag of a group's norm: `norms_weight/layer07`, `norms_update/output`."""
    return f"norms_{kind}/{group}"


def weight_stat(source: str) -> str:
    """The statistic of a source's mean routing weight: `w_null`, `w_embed`, `w_d03`."""
    return f"w_{source}"


def weight_source(stat: str) -> str | None:
    """The source whose mean weight `stat` is ('w_d03': 'd03'); None for any other statistic."""
    return stat[2:] if stat.startswith("w_") and stat != DELTAS_STAT else None


ROUTING_MEAN_STATS = (*STAT_NAMES, *(weight_stat(source) for source in BASE_SOURCES), DELTAS_STAT)


def routing_site_tag(site: str, stat: str, layer: int) -> str:
    """The tag of one site's statistic: `mhar_attn_gate/layer07`, `mhar_ffn_w_d03/layer31`."""
    return f"mhar_{site}_{stat}/layer{layer:02d}"


def routing_mean_tag(stat: str) -> str:
    """The tag of a statistic's mean over all sites: `mhar/gate/mean`."""
    return f"mhar/{stat}/mean"


def set_tags(name: str) -> dict[str, str]:
    """TensorBoard tags of one named validation set, raw and EMA weights (the lone default set 'val':
    `PRIMARY_TAGS`)."""
    if name == "val":
        return dict(PRIMARY_TAGS)
    return {"raw": f"val/{name}/ce", "ema": f"val/{name}/ce_ema"}


def event_files(run_dir: str | Path) -> list[Path]:
    files = sorted(Path(run_dir).rglob("events.out.tfevents.*"))
    if not files:
        raise FileNotFoundError(f"no TensorBoard event files under {run_dir}")
    return files


def load_scalars(run_dir: str | Path) -> dict[str, dict[int, float]]:
    """{tag: {step: value}} for every scalar of the run, merged over its event files in write order."""
    parts: dict[str, list] = {}
    for path in event_files(run_dir):
        acc = EventAccumulator(str(path), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            events = acc.Scalars(tag)
            if events:
                parts.setdefault(tag, []).append((events[0].wall_time, events))
    merged = {}
    for tag, files in parts.items():
        series: dict[int, float] = {}
        for _, events in sorted(files, key=lambda f: f[0]):
            series.update((e.step, e.value) for e in events)
        merged[tag] = dict(sorted(series.items()))
    return merged


def read_scalars(run_dir: str | Path, tag: str = LOSS_TAG) -> dict[int, float]:
    """{step: value} for `tag`, merged over every event file of the run in write order."""
    scalars = load_scalars(run_dir)
    if tag not in scalars:
        raise KeyError(f"tag {tag!r} not found in the event files under {run_dir}")
    return scalars[tag]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Summarise a scalar of a run's TensorBoard logs.")
    parser.add_argument("run_dir", help="a run's folder (its event files anywhere below it, e.g. <dump_folder>/tb)")
    parser.add_argument("--tag", default=LOSS_TAG, help=f"the scalar to summarise (default {LOSS_TAG})")
    args = parser.parse_args(argv)
    try:
        values = read_scalars(args.run_dir, args.tag)
    except (FileNotFoundError, KeyError) as e:
        sys.exit(f"tensorboard_scalars: {e.args[0]}")
    steps = list(values)
    k = max(1, len(steps) // 10)
    head = sum(values[s] for s in steps[:k]) / k
    tail = sum(values[s] for s in steps[-k:]) / k
    print(f"{args.tag}: {len(steps)} steps ({steps[0]}..{steps[-1]}) in {args.run_dir}")
    print(f"  mean of first {k}: {head:.4f}   mean of last {k}: {tail:.4f}   change: {tail - head:+.4f}")


if __name__ == "__main__":
    main()
