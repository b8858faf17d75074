"""The routing section of `mhar_titan.compare`: synthetic routing statistics named as the trainer names them,
read back into heatmaps, line plots, report.md and TensorBoard images; older runs' layout; none for a control."""

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from test_compare import write_run

from mhar_titan.compare import routing
from mhar_titan.compare.pair import compare
from mhar_titan.components.routing_stats import name_routing_stats
from mhar_titan.components.tensorboard_scalars import event_files, load_scalars
from mhar_titan.model.sources import SITE_NAMES

LAYERS, NUM_BLOCKS = 4, 4  # one layer per block: layer l reads null, embedding, D_0 .. D_{l-1}
ROUTING_STEPS = range(10, 70, 10)
PNG = b"\x89PNG\r\n\x1a\n"


def site_stats(step: int, rng: np.random.Generator) -> torch.Tensor:
    """[layers, 2, 2 + NUM_BLOCKS + 1] as the model leaves them: gate, entropy, per-source weights, NaN pads."""
    stats = torch.full((LAYERS, 2, 2 + NUM_BLOCKS + 1), math.nan)
    for layer in range(LAYERS):
        n = 2 + layer
        for site in range(2):
            w = rng.dirichlet(np.ones(n))
            stats[layer, site, 0] = (-1) ** site * 1e-3 * step * (layer + 1)
            stats[layer, site, 1] = float(-(w * np.log(w)).sum())
            stats[layer, site, 2 : 2 + n] = torch.from_numpy(w)
    return stats


def routing_pair(root: Path, older: bool = False) -> dict[int, torch.Tensor]:
    """A pair whose MHAR arm logged routing statistics at ROUTING_STEPS (with `older`: the tags of runs before
    issue 23, mhar/<stat>/layerNN_<site>, gate, entropy, w_null, w_embed, w_deltas)."""
    rng = np.random.default_rng(23)
    loss = {s: 3.0 - s / 100 for s in range(1, 61)}
    stats = {s: site_stats(s, rng) for s in ROUTING_STEPS}
    scalars: dict[str, dict[int, float]] = {"train/loss": loss}
    for step, values in stats.items():
        for tag, v in name_routing_stats(values).items():
            if older and not tag.startswith("mhar/"):  # the means' tags are unchanged
                site_stat, layer = tag.split("/")
                _, site, stat = site_stat.split("_", 2)
                if stat.startswith("w_d0"):
                    continue  # older runs logged no weight per delta
                tag = f"mhar/{stat}/{layer}_{site}"
            scalars.setdefault(tag, {})[step] = v
    write_run(root / "control", {"train/loss": loss})
    write_run(root / "mhar", scalars)
    return stats


def images(run: Path) -> dict[str, list]:
    acc = EventAccumulator(str(event_files(run)[0]), size_guidance={"images": 0})
    acc.Reload()
    return {tag: acc.Images(tag) for tag in acc.Tags()["images"]}


def test_routing_section_heatmaps_and_tensorboard_images(tmp_path):
    stats = routing_pair(tmp_path)
    r = compare(tmp_path)
    out = tmp_path / "compare"
    assert r["routing"]["chosen_steps"] == [10, 30, 60] and r["routing"]["steps"] == list(ROUTING_STEPS)
    assert r["routing"]["sources"] == ["w_null", "w_embed", "w_d00", "w_d01", "w_d02"]
    assert r["routing"]["older_layout"] is False and r["routing"]["layers"] == LAYERS

    log = routing.read_routing(load_scalars(tmp_path / "mhar"), tmp_path / "mhar")
    for step in ROUTING_STEPS:  # the heatmap's numbers are the logged per-source means, NaN where not read
        for s, site in enumerate(SITE_NAMES):
            expected = stats[step][:, s, 2:].numpy()
            np.testing.assert_allclose(routing.weights_matrix(log, site, step), expected, rtol=1e-6)
            assert np.isnan(routing.weights_matrix(log, site, step)[0, 2:]).all()
    assert routing.read_routing(load_scalars(tmp_path / "control"), tmp_path / "control") is None

    last = stats[60]
    for s, site in enumerate(SITE_NAMES):
        row = r["routing"]["last"][site]
        assert row["gate"] == pytest.approx(float(last[:, s, 0].abs().mean()), rel=1e-6)
        assert row["entropy"] == pytest.approx(float(last[:, s, 1].mean()), rel=1e-6)
        assert row["w_deltas"] == pytest.approx(float(last[:, s, 4:].nansum(-1).mean()), rel=1e-6)

    text = (out / "report.md").read_text()
    section = text.split("## Routing (`mhar`)")[1].split("## Throughput")[0]
    for name in (routing.WEIGHTS_PNG, routing.GATE_ENTROPY_PNG):
        assert (out / name).read_bytes()[:8] == PNG and f"]({name})" in section
        assert str(out / name) in r["plots"]
    assert "at steps 10, 30, 60" in section and f"| attn | {r['routing']['last']['attn']['gate']:.3e} |" in section

    tb = images(tmp_path / "delta")  # the delta run holds the same pictures
    assert [e.step for e in tb[routing.WEIGHTS_IMAGE]] == [10, 30, 60]
    assert [e.step for e in tb[routing.GATE_ENTROPY_IMAGE]] == [60]
    for event in tb[routing.WEIGHTS_IMAGE] + tb[routing.GATE_ENTROPY_IMAGE]:
        assert event.encoded_image_string[:8] == PNG and event.width > 300 and event.height > 200


def test_an_older_runs_layout_is_drawn_and_said(tmp_path):
    routing_pair(tmp_path, older=True)
    r = compare(tmp_path)
    assert r["routing"]["older_layout"] is True and r["routing"]["sources"] == ["w_null", "w_embed", "w_deltas"]
    text = (tmp_path / "compare" / "report.md").read_text()
    assert "in the older layout" in text and "the heatmap's last column is all deltas together" in text
    assert (tmp_path / "compare" / routing.WEIGHTS_PNG).read_bytes()[:8] == PNG
    assert [e.step for e in images(tmp_path / "delta")[routing.WEIGHTS_IMAGE]] == [10, 30, 60]


def test_no_routing_statistics_no_section(tmp_path):
    for arm in ("control", "mhar"):
        write_run(tmp_path / arm, {"train/loss": {s: 3.0 - s / 100 for s in range(1, 11)}})
    out = tmp_path / "compare"
    out.mkdir()
    (out / routing.WEIGHTS_PNG).write_bytes(PNG)  # from an earlier comparison of other runs
    r = compare(tmp_path)
    assert r["routing"] is None and "## Routing" not in (out / "report.md").read_text()
    assert not (out / routing.WEIGHTS_PNG).exists() and routing.WEIGHTS_IMAGE not in images(tmp_path / "delta")
