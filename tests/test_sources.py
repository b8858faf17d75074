"""mhar_titan.model.sources: the routing sources' layout (names, count per site, the maximum, the statistics'
width), its refusals, and the tiny model's sites and statistics following it."""

import copy
import math

import pytest
import torch

from mhar_titan.components.routing_stats import name_routing_stats
from mhar_titan.components.tensorboard_scalars import routing_site_tag, weight_stat
from mhar_titan.model.args import FLAVORS, MHAR
from mhar_titan.model.model import build_initialised
from mhar_titan.model.sources import (
    BASE_SOURCES,
    SITE_NAMES,
    STAT_NAMES,
    SourceLayout,
    delta_index,
    delta_name,
    with_null,
    without_null,
)


def test_four_layers_in_two_blocks():
    layout = SourceLayout(num_blocks=2, n_layers=4)
    assert layout.layers_per_block == 2 and layout.sites_per_block == 4
    assert layout.blocks() == (range(0, 2), range(2, 4))
    assert [layout.block(layer) for layer in range(4)] == [0, 0, 1, 1]
    assert [layout.site_sources(layer) for layer in range(4)] == [2, 2, 3, 3]  # null, embedding (, D_0)
    assert [layout.caller_sources(layer) for layer in range(4)] == [1, 1, 2, 2]  # the null is the site's own
    assert layout.names == ("null", "embed", "d00")  # the last block's delta is never a source
    assert (layout.max_sources, layout.max_caller_sources, layout.deltas) == (3, 2, 1)
    assert [layout.delta_is_source(b) for b in range(2)] == [True, False]
    assert layout.stats_width == 5  # gate, entropy, then a weight per name


def test_the_8b_geometry_32_layers_in_8_blocks():
    layout = SourceLayout(num_blocks=8, n_layers=32)
    assert layout.layers_per_block == 4 and layout.sites_per_block == 8
    assert [layout.site_sources(layer) for layer in range(32)] == [2 + layer // 4 for layer in range(32)]
    assert layout.names == ("null", "embed", "d00", "d01", "d02", "d03", "d04", "d05", "d06")
    assert (layout.max_sources, layout.max_caller_sources, layout.stats_width) == (9, 8, 11)
    assert layout.fits(8) and not layout.fits(7)  # the kernels' 8 source pointers hold the 8B's 8 blocks
    assert not SourceLayout(num_blocks=16, n_layers=32).fits(8)


def test_one_block_reads_the_null_and_the_embedding_only():
    layout = SourceLayout(num_blocks=1, n_layers=4)
    assert layout.blocks() == (range(0, 4),) and layout.names == BASE_SOURCES == ("null", "embed")
    assert {layout.site_sources(layer) for layer in range(4)} == {2} and layout.max_caller_sources == 1
    assert (layout.deltas, layout.delta_is_source(0), layout.stats_width) == (0, False, 4)


@pytest.mark.parametrize("num_blocks,n_layers", [(0, 4), (-2, 4), (3, 4), (8, 4), (8, 0), (8, -8)])
def test_geometries_that_do_not_split_are_refused(num_blocks, n_layers):
    with pytest.raises(ValueError, match=f"num_blocks = {num_blocks} must be positive and divide the layer count"):
        SourceLayout(num_blocks, n_layers)


def test_a_layer_outside_the_model_has_no_block():
    with pytest.raises(ValueError, match="layer 4: the model has layers 0..3"):
        SourceLayout(2, 4).site_sources(4)


@pytest.mark.parametrize("num_blocks,n_layers", [(1, 4), (2, 4), (4, 4), (8, 32)])
def test_the_statistics_width_gives_back_the_layout(num_blocks, n_layers):
    layout = SourceLayout(num_blocks, n_layers)
    assert SourceLayout.of_stats(n_layers, layout.stats_width) == layout
    assert layout.stats_width == len(STAT_NAMES) + len(layout.names)


def test_a_width_no_layout_has_is_refused():
    with pytest.raises(ValueError):
        SourceLayout.of_stats(4, 6)  # 3 blocks
    with pytest.raises(ValueError):
        SourceLayout.of_stats(4, 3)  # no block


def test_delta_names_and_the_null():
    assert [delta_name(k) for k in (0, 7, 12)] == ["d00", "d07", "d12"]
    assert [delta_index(name) for name in ("d00", "d07", "d12")] == [0, 7, 12]
    assert [delta_index(name) for name in ("null", "embed", "deltas", "d", "dx1")] == [None] * 5
    assert with_null(8) == 9 and without_null(9) == 8


@pytest.mark.parametrize("num_blocks", [1, 2, 4])
def test_the_tiny_models_sites_and_statistics_follow_the_layout(num_blocks):
    args = copy.deepcopy(FLAVORS["tiny"])
    args.max_seq_len = 8
    args.mhar = MHAR(enable=True, num_blocks=num_blocks, backend="torch")
    torch.manual_seed(0)
    model = build_initialised(args)
    layout = model.model_args.layout
    assert layout == SourceLayout(num_blocks, model.n_layers)
    read = []  # the caller sources each block's route_block is given
    route_block = model.route_block
    model.route_block = lambda block, sources: read.append(len(sources)) or route_block(block, sources)
    model.collect_routing_stats = True
    with torch.no_grad():
        model(torch.randint(0, args.vocab_size, (1, 8), generator=torch.Generator().manual_seed(1)))
    assert read == [layout.caller_sources(layers[0]) for layers in layout.blocks()]
    stats = model.routing_stats
    assert stats.shape == (model.n_layers, len(SITE_NAMES), layout.stats_width)
    named = name_routing_stats(stats)
    for i, layer in enumerate(model.layers.values()):
        assert layer.sites() == tuple(getattr(layer, f"{site}_routing") for site in SITE_NAMES)
        assert all(site.max_sources == layout.max_sources for site in layer.sites())
        n = layout.site_sources(i)
        weights = stats[i, :, len(STAT_NAMES) :]
        assert not weights[:, :n].isnan().any() and weights[:, n:].isnan().all()
        torch.testing.assert_close(weights[:, :n], torch.full((2, n), 1 / n))  # q = 0: uniform at init
        for site in SITE_NAMES:
            for source in layout.names:
                tag = routing_site_tag(site, weight_stat(source), i)
                assert (tag in named) == (source in layout.names[:n])
            assert named[routing_site_tag(site, "entropy", i)] == pytest.approx(math.log(n))
