"""The committed demo corpus and tokenizer agree with the tiny flavor."""

import random
import string

import pyarrow.parquet as pq
import pytest
from conftest import REPO
from torchtitan.components.tokenizer import HuggingFaceTokenizer

from data.shards import list_shards
from mhar_titan.model.args import FLAVORS

ASSETS = REPO / "assets" / "tiny"


def test_tokenizer_matches_tiny_flavor_and_round_trips():
    tok = HuggingFaceTokenizer(str(ASSETS))
    assert tok.get_vocab_size() == FLAVORS["tiny"].vocab_size
    assert tok.eos_id == FLAVORS["tiny"].eos_id
    assert tok.bos_id is not None and tok.bos_id != tok.eos_id
    rng = random.Random()
    text = "".join(rng.choice(string.printable + "éß→€") for _ in range(500))
    ids = tok.encode(text, add_bos=True, add_eos=True)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
    assert tok.decode(ids[1:-1]) == text


def test_corpus_shards_hold_nonempty_text_with_sources():
    shards = sorted((ASSETS / "corpus").glob("*.parquet"))
    assert len(shards) == 4
    rows = 0
    for shard in shards:
        table = pq.read_table(shard)
        assert table.column_names == ["text", "source"]
        assert all(len(t) >= 200 for t in table.column("text").to_pylist())
        rows += table.num_rows
    assert rows > 2000
    assert list_shards([str(ASSETS / "corpus")]) == [str(s) for s in shards]


def test_missing_shard_path_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        list_shards([str(tmp_path / "nowhere" / "*.parquet")])
