"""make bench-data's main path on tiny settings: one table row per tokenizer x worker count, and the
local BPE (trained small, through the 128k recipe's code) cached and loadable by torchtitan."""

import json
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from torchtitan.components.tokenizer import HuggingFaceTokenizer

from benchmarks import bench_data
from benchmarks.bpe128k import BOS, EOS, Recipe, cached_bpe, special_tokens, train_bpe

TEXTS = [f"def f{i}(x):\n    return x + {i}  # the {i}th function, says the docstring\n" * 20 for i in range(24)]


def shards(tmp_path, n=2):
    out = tmp_path / "shards"
    out.mkdir()
    for i in range(n):
        pq.write_table(pa.table({"text": TEXTS[i::n]}), out / f"{i}.parquet", row_group_size=4)
    return out


def rows(output):
    return [line.split("|")[1:-1] for line in output.splitlines() if re.match(r"\| \S", line)][1:]


def corpus(tmp_path):
    """A few stdlib modules: real code, enough for a few hundred merges."""
    out = tmp_path / "corpus"
    out.mkdir()
    for i, text in enumerate(bench_data.stdlib_texts()[:12]):
        (out / f"m{i}.py").write_text(text)
    return out


def test_the_table_has_a_row_per_tokenizer_and_worker_count(tmp_path, capsys, monkeypatch):
    cache = tmp_path / "cache"
    roots = (str(corpus(tmp_path)),)
    monkeypatch.setattr(bench_data, "library_roots", lambda: roots)  # a few files, not all of site-packages
    argv = ["--shards", str(shards(tmp_path)), "--seq-len", "64", "--batch", "1", "--batches", "2"]
    bpe = ["--bpe128k", "--bpe-vocab", "600", "--bpe-corpus-mb", "0.3", "--bpe-cache", str(cache)]
    bench_data.main([*argv, "--tokenizer", str(bench_data.DEMO), "--workers", "0", "2", *bpe])
    out = capsys.readouterr().out
    assert out.count("byte-level BPE") == 1 and "2 shards of" in out
    table = [[cell.strip() for cell in row] for row in rows(out)]
    assert [(r[0], r[1], r[2], r[3]) for r in table] == [
        ("assets/tiny", "2,048", "0", "2"),
        ("assets/tiny", "2,048", "2", "2"),
        ("bpe600", "600", "0", "2"),
        ("bpe600", "600", "2", "2"),
    ]
    for row in table:
        assert float(row[4].replace(",", "")) > 0 and 1.0 < float(row[5]) < 10.0
    # without --tokenizer: the demo's and the local BPE, found in the cache this time (no training)
    bench_data.main([*argv, "--workers", "0", *bpe[1:]])
    out = capsys.readouterr().out
    assert "byte-level BPE" not in out and [r[0].strip() for r in rows(out)] == ["assets/tiny", "bpe600"]
    assert len(list(cache.iterdir())) == 1


def test_the_local_bpe_has_llama3s_shape_and_loads_in_torchtitan(tmp_path):
    recipe = Recipe(vocab_size=700, corpus_mb=0.3, roots=(str(corpus(tmp_path)),))
    folder = cached_bpe(recipe, tmp_path / "cache")
    assert json.loads((folder / "tokenizer_config.json").read_text())["bos_token"] == BOS
    tok = HuggingFaceTokenizer(str(folder))
    assert tok.get_vocab_size() == 700
    assert (tok.bos_id, tok.eos_id) == (700 - 256, 700 - 255)  # as 128000 and 128001 in 128,256
    assert tok.tokenizer.id_to_token(699) == "<|reserved_special_token_247|>"
    ids = tok.tokenizer.encode("x = 1234567").ids
    assert ids[0] == tok.bos_id and tok.tokenizer.decode(ids, skip_special_tokens=True) == "x = 1234567"
    split = tok.tokenizer.pre_tokenizer.pre_tokenize_str("x1234567 don't")
    assert [piece for piece, _ in split] == ["x", "123", "456", "7", "Ġdon", "'t"]  # Llama-3's split
    assert cached_bpe(recipe, tmp_path / "cache") == folder  # found again, not retrained


def test_special_tokens_follow_llama31():
    names = special_tokens()
    assert len(names) == 256 == len(set(names))
    assert names[:2] == [BOS, EOS] and names[9] == "<|eot_id|>" and names[-1] == "<|reserved_special_token_247|>"


def test_training_refuses_a_corpus_too_small_for_the_vocabulary(tmp_path):
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.py").write_text("ab " * 10)
    with pytest.raises(ValueError, match="too little"):
        cached_bpe(Recipe(vocab_size=5000, corpus_mb=1, roots=(str(tmp_path / "corpus"),)), tmp_path / "cache")
    with pytest.raises(ValueError, match="fewer than 256"):
        train_bpe(iter(["ab ab"]), 300)
