"""Issue 37, too many TensorBoard tags: data/token_share/<tag> for at most `[data] token_share_sources` tags
(the most tokens first, ties by name), the rest as data/token_share/other; the demo corpus's coarse source
column, so that the demo writes at most 40 scalar tags under data/."""

import ast
import random

import pyarrow.parquet as pq
import pytest
from conftest import REPO
from torchtitan.components.tokenizer import HuggingFaceTokenizer

from data.config import DataConfig
from data.counters import mixture_shares, token_shares
from data.demo_corpus import CODE_SOURCES, DOCSTRING_SOURCES, SOURCES, docstrings, node_kinds
from data.loader import build_parquet_dataloader
from mhar_titan.config import parse_config

ASSETS = REPO / "assets" / "tiny"
DEMO_DATA_TAGS = 40  # the most scalar tags under data/ that the demo may write


def counters_of(tokens: dict[str, int]) -> dict[str, int]:
    """Loader counters with these per-tag token counts (and counters that are not per tag, left out of shares)."""
    return {"docs": 7, "mixture/web/tokens": 99, **{f"tokens/{tag}": n for tag, n in tokens.items()}}


def test_the_largest_sources_get_a_share_each_and_the_rest_one_other_share():
    tokens = {f"s{i:02d}": 1000 - 10 * i for i in range(20)}  # s00 the largest
    shares = token_shares(counters_of(tokens), top=16)
    total = sum(tokens.values())
    assert list(shares) == [*(f"data/token_share/s{i:02d}" for i in range(16)), "data/token_share/other"]
    assert shares["data/token_share/s03"] == tokens["s03"] / total
    assert shares["data/token_share/other"] == pytest.approx(sum(tokens[f"s{i}"] for i in range(16, 20)) / total)
    assert sum(shares.values()) == pytest.approx(1.0, abs=1e-12)
    assert token_shares(counters_of(tokens)) == shares  # the default: 16


def test_no_other_share_without_a_rest_and_none_at_all_with_top_0():
    tokens = {"web": 30, "code": 10}
    assert token_shares(counters_of(tokens), top=2) == {"data/token_share/web": 0.75, "data/token_share/code": 0.25}
    assert token_shares(counters_of(tokens), top=16) == token_shares(counters_of(tokens), top=2)
    assert token_shares(counters_of(tokens), top=1) == {"data/token_share/web": 0.75, "data/token_share/other": 0.25}
    assert token_shares(counters_of(tokens), top=0) == {}
    assert token_shares({"docs": 3}, top=4) == {} and token_shares(counters_of({"web": 0}), top=4) == {}


def test_a_source_named_other_is_counted_in_the_other_share():
    tokens = {"other": 50, "web": 30, "code": 15, "math": 5}
    shares = token_shares(counters_of(tokens), top=2)
    assert shares == {"data/token_share/web": 0.3, "data/token_share/code": 0.15, "data/token_share/other": 0.55}
    assert token_shares(counters_of({"other": 2, "web": 2}), top=4) == {
        "data/token_share/web": 0.5,
        "data/token_share/other": 0.5,
    }


def test_the_chosen_sources_are_the_same_whatever_the_counters_order():
    tokens = {"b": 5, "a": 5, "d": 5, "c": 5, "big": 9, "small": 1}
    want = token_shares(counters_of(tokens), top=3)
    assert set(want) == {"data/token_share/big", "data/token_share/a", "data/token_share/b", "data/token_share/other"}
    rng = random.Random(0)
    for _ in range(20):
        items = list(tokens.items())
        rng.shuffle(items)
        assert token_shares(counters_of(dict(items)), top=3) == want


def test_a_negative_option_is_refused_naming_key_and_value():
    with pytest.raises(ValueError, match=r"\[data\] token_share_sources = -1 must be >= 0"):
        DataConfig(token_share_sources=-1).validate()
    DataConfig(token_share_sources=0).validate()
    with pytest.raises(ValueError, match="top = -2 must be >= 0"):
        token_shares(counters_of({"web": 1}), top=-2)


def test_the_option_is_in_the_job_configs_data_section():
    config = REPO / "configs" / "tiny_cpu.toml"
    assert parse_config(["--job.config_file", str(config)]).data.token_share_sources == 16
    again = parse_config(["--job.config_file", str(config), "--data.token_share_sources", "3"])
    assert again.data.token_share_sources == 3


def test_demo_corpus_sources_are_coarse_kinds():
    tree = ast.parse(
        f'"""{"m" * 200}"""\n'
        f'def f():\n    """{"f" * 200}"""\n    def inner():\n        """{"i" * 200}"""\n'
        f'class C:\n    """{"c" * 200}"""\n    async def g(self):\n        """{"g" * 200}"""\n'
        f'    def short(self):\n        """too short"""\n'
    )
    assert [source for _, source in docstrings(tree)] == [
        "module_docstrings",
        "function_docstrings",
        "class_docstrings",
        "function_docstrings",  # a function inside a function
        "method_docstrings",
    ]
    kinds = node_kinds(tree)
    assert sorted(CODE_SOURCES[kinds[n]] for n in ast.walk(tree) if isinstance(n, ast.AsyncFunctionDef)) == ["methods"]
    assert set(SOURCES) == {*DOCSTRING_SOURCES.values(), *CODE_SOURCES.values()} and len(SOURCES) == 6
    for folder in ("corpus", "code"):  # the committed shards, as data.demo_corpus writes them
        shards = sorted((ASSETS / folder).glob("*.parquet"))
        values = {v for shard in shards for v in pq.read_table(shard)["source"].to_pylist()}
        want = DOCSTRING_SOURCES if folder == "corpus" else CODE_SOURCES
        assert values == set(want.values()), folder


@pytest.mark.parametrize("config", ["tiny_cpu.toml", "tiny_cpu_mhar.toml"])
def test_the_demo_writes_at_most_40_data_tags(config, monkeypatch):
    """The trainer's data/ scalars (`data/<counter>`, the mixture's and the token shares) from the demo's loader
    after a few batches, with every source value of the demo corpus counted (the most tags a run can reach)."""
    monkeypatch.chdir(REPO)  # the configs name assets/tiny relative to the repository
    job = parse_config(["--job.config_file", f"configs/{config}"])
    loader = build_parquet_dataloader(2, 0, HuggingFaceTokenizer(job.model.hf_assets_path), job)
    it = iter(loader)
    for _ in range(4):
        next(it)
    counters = loader.counters()
    assert any(k.startswith("tokens/") for k in counters) and any(k.startswith("mixture/") for k in counters)
    for src in SOURCES:  # every source seen
        counters.setdefault(f"tokens/{src}", 1)
    tags = {f"data/{k}" for k in counters}
    tags |= {*mixture_shares(counters), *token_shares(counters, top=job.data.token_share_sources)}
    assert all(tag.startswith("data/") for tag in tags)
    assert len(tags) <= DEMO_DATA_TAGS, sorted(tags)
    assert len([t for t in tags if t.startswith("data/token_share/")]) == len(SOURCES)
