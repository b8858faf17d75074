"""The MHAR arm's routing, from the statistics its trainer logged (nothing is recomputed): which sources each
layer's two sublayer inputs read (a layer x source heatmap of the mean routing weights at the first, middle
and last logged step), and per layer over training how far the gate has opened (|gate|) and how spread the
routing is (entropy). Written as PNGs beside report.md, as images in the pair's TensorBoard `delta` run
(`routing/weights` at each of those steps, `routing/gate_entropy` at the last) and as the report's "Routing"
section. A run that logged the older layout (`mhar/<stat>/layerNN_<site>`: the weights on the null source,
the embedding and all deltas summed, none per delta) gets a heatmap with one column for all deltas.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.cm import ScalarMappable
from matplotlib.colors import Normalize
from matplotlib.figure import Figure
from matplotlib.image import imsave
from matplotlib.ticker import MaxNLocator

from mhar_titan.components.tensorboard_scalars import (
    DELTAS_STAT,
    OLD_ROUTING_SITE_TAG,
    ROUTING_MEAN_STATS,
    ROUTING_SITE_TAG,
    weight_source,
    weight_stat,
)
from mhar_titan.model.sources import BASE_SOURCES, EMBED, NULL, SITE_NAMES, delta_index

Series = dict[int, float]
WEIGHTS_PNG, GATE_ENTROPY_PNG = "routing_weights.png", "routing_gate_entropy.png"
WEIGHTS_IMAGE, GATE_ENTROPY_IMAGE = "routing/weights", "routing/gate_entropy"
W_NULL, W_EMBED = weight_stat(NULL), weight_stat(EMBED)
LABELS = {W_NULL: "null", W_EMBED: "embedding", DELTAS_STAT: "all deltas"}  # the heatmap's columns but D_k
DPI = 110  # as report.py's plots
ANNOTATE_CELLS = 64  # write each weight into its cell up to this many cells a panel (small models)


@dataclass
class RoutingLog:
    """One run's routing statistics: `values[(site, stat)][layer]` = {step: value}; `sources`: the
    heatmap's columns (stat names, w_null, w_embed, then w_d00, w_d01, ... or, older runs, w_deltas)."""

    run: str
    values: dict[tuple[str, str], dict[int, Series]]
    layers: int
    steps: list[int]
    sources: list[str]
    older_layout: bool  # some or all of it logged as mhar/<stat>/layerNN_<site> (no weight per delta)


def read_routing(scalars: dict[str, Series], run: str | Path) -> RoutingLog | None:
    """The routing statistics among a run's scalars; None when it logged none (the control, stats_freq 0)."""
    values: dict[tuple[str, str], dict[int, Series]] = {}
    older = False
    for tag, series in scalars.items():
        match = ROUTING_SITE_TAG.match(tag) or OLD_ROUTING_SITE_TAG.match(tag)
        if match is None or match["site"] not in SITE_NAMES or not series:
            continue
        older = older or match.re is OLD_ROUTING_SITE_TAG
        by_layer = values.setdefault((match["site"], match["stat"]), {})
        by_layer[int(match["layer"])] = {**by_layer.get(int(match["layer"]), {}), **series}
    if not values:
        return None
    deltas = sorted({stat for _, stat in values if delta_of(stat) is not None}, key=delta_of)
    sources = [*map(weight_stat, BASE_SOURCES), *(deltas if deltas or not older else [DELTAS_STAT])]
    layers = 1 + max(layer for by_layer in values.values() for layer in by_layer)
    steps = sorted({s for by_layer in values.values() for series in by_layer.values() for s in series})
    return RoutingLog(str(run), values, layers, steps, sources, older)


def chosen_steps(steps: list[int]) -> list[int]:
    """The first, middle and last logged step (fewer when fewer were logged)."""
    return list(dict.fromkeys((steps[0], steps[(len(steps) - 1) // 2], steps[-1])))


def value(log: RoutingLog, site: str, stat: str, layer: int, step: int) -> float:
    """One logged value; NaN where it was not logged (a source the layer's block does not read)."""
    return log.values.get((site, stat), {}).get(layer, {}).get(step, math.nan)


def weights_matrix(log: RoutingLog, site: str, step: int) -> np.ndarray:
    """[layers, sources] mean routing weights of one sublayer at one step, NaN where not logged."""
    return np.array([[value(log, site, src, layer, step) for src in log.sources] for layer in range(log.layers)])


def delta_of(stat: str) -> int | None:
    """k for the statistic of D_k's weight ('w_d03': 3); None for any other."""
    source = weight_source(stat)
    return None if source is None else delta_index(source)


def source_label(stat: str) -> str:
    k = delta_of(stat)
    return LABELS[stat] if k is None else f"D{k}"


def weights_figure(log: RoutingLog, steps: list[int], vmax: float | None = None) -> Figure:
    """Heatmaps of the mean routing weights, layer x source, a row per sublayer and a column per step (one
    step: the sublayers side by side), on one colour scale up to `vmax` (default: the largest weight shown);
    grey cells: sources the layer's block does not read."""
    n_src = len(log.sources)
    width, height = 1.2 + 0.4 * n_src, 1.0 + 0.2 * max(log.layers, 4)
    rows, cols = (1, len(SITE_NAMES)) if len(steps) == 1 else (len(SITE_NAMES), len(steps))
    fig = Figure(figsize=(width * cols + 1.2, height * rows + 0.6), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, cols, squeeze=False).flatten()
    mats = {(site, step): weights_matrix(log, site, step) for site in SITE_NAMES for step in steps}
    vmax = vmax or _largest(mats.values())
    cmap = colormaps["viridis"].with_extremes(bad="0.85")
    layer_ticks = range(0, log.layers, 1 if log.layers <= 16 else 4)
    image = None
    for ax, (site, step) in zip(axes, mats, strict=True):
        mat = mats[(site, step)]
        image = ax.imshow(mat, cmap=cmap, vmin=0, vmax=vmax, aspect="auto", interpolation="nearest")
        ax.set_xticks(range(n_src), [source_label(s) for s in log.sources], rotation=90 if n_src > 3 else 0)
        ax.set_yticks(list(layer_ticks))
        ax.set_title(f"{site}, step {step}", fontsize=10)
        ax.set_ylabel("layer")
        if mat.size <= ANNOTATE_CELLS:
            _annotate(ax, mat, vmax)
    fig.colorbar(image, ax=axes, label="mean routing weight", shrink=0.8)
    fig.suptitle(f"{Path(log.run).name}: mean routing weight per layer and source", fontsize=10)
    return fig


def _largest(mats: Any) -> float:
    finite = [m[np.isfinite(m)] for m in mats]
    return max((float(f.max()) for f in finite if f.size), default=1.0) or 1.0


def _annotate(ax: Any, mat: np.ndarray, vmax: float) -> None:
    for (i, j), w in np.ndenumerate(mat):
        if np.isfinite(w):
            ax.text(j, i, f"{w:.2f}", ha="center", va="center", fontsize=7, color="w" if w < vmax / 2 else "k")


def gate_entropy_figure(log: RoutingLog) -> Figure:
    """|gate| and routing entropy of every layer over training, a panel per sublayer, colour by depth."""
    fig = Figure(figsize=(11, 7), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, len(SITE_NAMES), sharex=True, squeeze=False)
    cmap, norm = colormaps["viridis"], Normalize(0, max(log.layers - 1, 1))
    few = len(log.steps) < 3
    for c, site in enumerate(SITE_NAMES):
        for r, (stat, label) in enumerate((("gate", "|gate|"), ("entropy", "routing entropy (nats)"))):
            ax = axes[r][c]
            for layer, series in sorted(log.values.get((site, stat), {}).items()):
                steps = sorted(series)
                ys = [abs(series[s]) if stat == "gate" else series[s] for s in steps]
                ax.plot(steps, ys, color=cmap(norm(layer)), lw=0.9, marker="o" if few else None, ms=3)
            ax.set_title(f"{site}: {label}", fontsize=10)
            ax.set_ylabel(label)
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            if r == 1:
                ax.set_xlabel("step")
    bar = fig.colorbar(ScalarMappable(norm, cmap), ax=axes, label="layer", shrink=0.8)
    bar.locator = MaxNLocator(integer=True)
    bar.update_ticks()
    fig.suptitle(f"{Path(log.run).name}: gate magnitude and routing entropy per layer", fontsize=10)
    return fig


def figure_array(fig: Figure) -> np.ndarray:
    """The figure drawn at the report's resolution as an [H, W, 3] uint8 image: written as a PNG and given
    to SummaryWriter.add_image from one drawing (no pyplot)."""
    fig.set_dpi(DPI)
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())[..., :3].copy()


def summary(log: RoutingLog) -> dict[str, Any]:
    """The figures the report quotes: logged steps, the heatmap's steps, and per sublayer at the last step
    the means over layers of |gate|, entropy and the weights on null, embedding and all deltas."""
    last = log.steps[-1]
    at_last: dict[str, dict[str, float | None]] = {}
    for site in SITE_NAMES:
        row: dict[str, float | None] = {}
        for stat in ROUTING_MEAN_STATS:
            vals = [value(log, site, stat, layer, last) for layer in range(log.layers)]
            vals = [abs(v) if stat == "gate" else v for v in vals if math.isfinite(v)]
            row[stat] = statistics.fmean(vals) if vals else None
        at_last[site] = row
    return {
        "run": log.run,
        "layers": log.layers,
        "steps": log.steps,
        "chosen_steps": chosen_steps(log.steps),
        "sources": log.sources,
        "older_layout": log.older_layout,
        "last": at_last,
    }


def write(out: Path, log: RoutingLog | None) -> tuple[list[Path], list[tuple[str, int, np.ndarray]]]:
    """The routing PNGs in `out` (stale ones removed when there is nothing to plot) and the TensorBoard
    images (tag, step, [H, W, 3] array): the heatmap at each chosen step, the lines at the last step."""
    for name in (WEIGHTS_PNG, GATE_ENTROPY_PNG):
        (out / name).unlink(missing_ok=True)
    if log is None:
        return [], []
    steps = chosen_steps(log.steps)
    vmax = _largest(weights_matrix(log, site, step) for site in SITE_NAMES for step in steps)
    lines = figure_array(gate_entropy_figure(log))
    imsave(out / WEIGHTS_PNG, figure_array(weights_figure(log, steps, vmax)))
    imsave(out / GATE_ENTROPY_PNG, lines)
    images = [(WEIGHTS_IMAGE, step, figure_array(weights_figure(log, [step], vmax))) for step in steps]
    images.append((GATE_ENTROPY_IMAGE, log.steps[-1], lines))
    return [out / WEIGHTS_PNG, out / GATE_ENTROPY_PNG], images


def _f(x: float | None, fmt: str) -> str:
    return "n/a" if x is None else format(x, fmt)


def report_lines(r: dict[str, Any] | None, mhar: str, delta_run: str) -> list[str]:
    """The report's "Routing" section; nothing when the MHAR arm logged no routing statistics."""
    if r is None:
        return []
    steps, chosen = r["steps"], r["chosen_steps"]
    logged = f"{len(steps)} logged steps, {steps[0]}..{steps[-1]}" if len(steps) > 1 else f"step {steps[0]}"
    lines = [
        f"## Routing (`{mhar}`)",
        "",
        f"From the routing statistics `{mhar}` logged at step 1 and every `[mhar] stats_freq` steps ({logged}; tags "
        "`mhar_<site>_<stat>/layerNN`, means over sites `mhar/<stat>/mean`): means over the tokens and heads of "
        "the step's last microbatch, averaged over the ranks; nothing is recomputed. The same pictures are images "
        f"in the TensorBoard run `{delta_run}` (`routing/weights` at steps {', '.join(map(str, chosen))}, "
        "`routing/gate_entropy`).",
        "",
    ]
    if r["older_layout"]:
        lines += [
            f"`{mhar}` logged (at least part of) its routing statistics in the older layout "
            "(`mhar/<stat>/layerNN_<site>`): the weights on the null source, the embedding and all deltas "
            "summed, not each delta's weight"
            + (": the heatmap's last column is all deltas together." if DELTAS_STAT in r["sources"] else "."),
            "",
        ]
    lines += [
        f"Means over the {r['layers']} layers at step {steps[-1]}:",
        "",
        "| sublayer | \\|gate\\| | entropy (nats) | weight on null | on embedding | on all deltas |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for site, row in r["last"].items():
        lines.append(
            f"| {site} | {_f(row['gate'], '.3e')} | {_f(row['entropy'], '.3f')} | {_f(row[W_NULL], '.3f')} | "
            f"{_f(row[W_EMBED], '.3f')} | {_f(row[DELTAS_STAT], '.3f')} |"
        )
    lines += [
        "",
        f"![routing weights]({WEIGHTS_PNG})",
        "",
        "The mean routing weight each layer (rows) puts on each source (columns: the null source, the "
        "embedding, each block delta D_k) for the attention (top) and MLP (bottom) inputs at steps "
        f"{', '.join(map(str, chosen))}; grey: a source the layer's block does not read.",
        "",
        f"![gate magnitude and routing entropy]({GATE_ENTROPY_PNG})",
        "",
        "Per layer over training (colour: depth), how far each sublayer's gate has opened (|gate|; 0 at init, "
        "where the arm computes the base model) and its mean per-head routing entropy (ln N for uniform "
        "weights over a layer's N sources).",
        "",
    ]
    return lines
