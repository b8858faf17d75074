"""Shard content identity (data.contents, data.shards.read_footer, the index's "footer" key): a shard
rewritten in place changes the contents digest, a copied corpus does not, old indexes still work, and the
footer digest costs no request beyond the footer read."""

import hashlib
import json
import logging
import os
import re
import shutil

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from fsspec.spec import AbstractBufferedFile, AbstractFileSystem

from data import index as index_module
from data.contents import contents_changes, contents_digest, shard_contents
from data.index import (
    INDEX_NAME,
    BadIndexError,
    infos_from_json,
    infos_to_json,
    read_index,
    shard_infos,
    startup_shards,
    write_index,
)
from data.shards import FOOTER_READ, list_shards, read_footer, shard_info


def write_shard(path, rows, word="doc", row_group_size=3):
    table = pa.table({"text": [f"{word} {i}" for i in range(rows)], "source": ["web"] * rows})
    pq.write_table(table, path, row_group_size=row_group_size)


@pytest.fixture
def corpus(tmp_path):
    folder = tmp_path / "corpus"
    folder.mkdir()
    for i in range(4):
        write_shard(folder / f"shard-{i:02d}.parquet", 5 + 2 * i)
    return folder


def footers_read(monkeypatch):
    """Record the paths whose footers `shard_infos` reads (they are still read)."""
    read = []
    real = index_module.read_footers

    def recording(paths, threads=index_module.FOOTER_THREADS):
        read.extend(paths)
        return real(paths, threads)

    monkeypatch.setattr(index_module, "read_footers", recording)
    return read


def file_footer_digest(path):
    """The footer digest computed from the whole file: blake2b of its last (footer length + 8) bytes."""
    data = open(path, "rb").read()
    length = int.from_bytes(data[-8:-4], "little")
    return hashlib.blake2b(data[-(length + 8) :], digest_size=16).hexdigest()


def test_the_footer_gives_the_shards_size_and_footer_digest(corpus):
    for shard in list_shards([str(corpus)]):
        info = shard_info(shard, "text", "source")
        assert info.size == os.path.getsize(shard) and re.fullmatch(r"[0-9a-f]{32}", info.footer)
        assert info.footer == file_footer_digest(shard)


def test_a_shard_rewritten_in_place_changes_the_digest_from_footers_and_a_rebuilt_index(corpus, monkeypatch):
    shards = list_shards([str(corpus)])
    write_index(shards, str(corpus / INDEX_NAME))
    before = shard_infos(shards, "text", "source")
    assert before == shard_infos(shards, "text", "source", index=None)
    size = os.path.getsize(shards[1])
    write_shard(shards[1], 7, word="dox")  # other documents: the same rows, schema and size
    assert os.path.getsize(shards[1]) == size
    from_footers = shard_infos(shards, "text", "source", index=None)
    assert from_footers[shards[1]].row_groups == before[shards[1]].row_groups
    assert contents_digest(from_footers.values()) != contents_digest(before.values())
    changes = contents_changes(shard_contents(before.values()), shard_contents(from_footers.values()))
    assert changes.rewritten == ["shard-01.parquet"] and not (changes.added or changes.removed or changes.resized)
    write_index(shards, str(corpus / INDEX_NAME))  # rebuilt, as data.prepare --overwrite does
    read = footers_read(monkeypatch)
    from_index = shard_infos(shards, "text", "source")
    assert read == [] and from_index == from_footers
    assert contents_digest(from_index.values()) == contents_digest(from_footers.values())


def test_the_same_corpus_elsewhere_or_in_another_order_gives_the_same_digest(corpus, tmp_path):
    shards = list_shards([str(corpus)])
    write_index(shards, str(corpus / INDEX_NAME))
    digest = contents_digest(shard_infos(shards, "text", "source").values())
    copy = tmp_path / "elsewhere" / "deeper"
    shutil.copytree(corpus, copy)
    copied = list_shards([str(copy)])
    assert contents_digest(shard_infos(copied, "text", "source").values()) == digest  # its index
    assert contents_digest(shard_infos(copied[::-1], "text", "source", index=None).values()) == digest
    assert contents_digest(shard_infos(shards[:3], "text", "source").values()) != digest  # a shard fewer
    nested = tmp_path / "nested"
    shutil.copytree(corpus, nested / "a")
    write_shard(nested / "b.parquet", 3)
    contents = shard_contents(shard_infos(list_shards([str(nested / "a"), str(nested)]), "text").values())
    assert list(contents) == [f"a/shard-{i:02d}.parquet" for i in range(4)] + ["b.parquet"]  # below the common folder
    assert list(contents.values())[:4] == list(shard_contents(shard_infos(shards, "text").values()).values())


def test_an_index_without_footer_digests_is_read_and_its_shards_footers_are_read(corpus, monkeypatch, caplog):
    shards = list_shards([str(corpus)])
    path = corpus / INDEX_NAME
    write_index(shards, str(path))
    index = json.loads(path.read_text())
    for entry in index["shards"][:3]:  # as an index written before footer digests
        del entry["footer"]
    path.write_text(json.dumps(index))
    assert read_index(str(path))["shards"][0].keys() == {"path", "bytes", "row_groups", "columns"}
    read = footers_read(monkeypatch)
    with caplog.at_level(logging.INFO, logger="data.index"):
        infos = shard_infos(shards, "text", "source")
    assert read == shards[:3]
    assert infos == shard_infos(shards, "text", "source", index=None)
    advice = [r.getMessage() for r in caplog.records if "python -m data.index FOLDER" in r.getMessage()]
    assert len(advice) == 1 and "no footer digest for 3 shards" in advice[0] and str(path) in advice[0]


@pytest.mark.parametrize("value", ["f" * 31, "F" * 32, "g" * 32, 12, None, ["0" * 32]])
def test_a_malformed_footer_digest_is_an_error_naming_the_file_and_key(corpus, value):
    shards = list_shards([str(corpus)])
    path = corpus / INDEX_NAME
    write_index(shards, str(path))
    index = json.loads(path.read_text())
    index["shards"][2]["footer"] = value
    path.write_text(json.dumps(index))
    with pytest.raises(BadIndexError, match=rf"{re.escape(str(path))}: shards\[2\]\.footer: .* not a footer digest"):
        shard_infos(shards, "text", "source")


def test_infos_survive_the_broadcasts_json(corpus):
    shards = list_shards([str(corpus)])
    infos = shard_infos(shards, "text", "source", index=None)
    assert infos_from_json(json.loads(json.dumps(infos_to_json(infos)))) == infos
    assert startup_shards([str(corpus)], "", "text", "source", "error") == infos  # one process: no group


def test_contents_changes_name_added_removed_resized_and_rewritten_shards():
    recorded = {"a": (10, "1" * 32), "b": (20, "2" * 32), "c": (30, "3" * 32), "d": (40, "4" * 32)}
    current = {"a": (10, "1" * 32), "b": (21, "5" * 32), "c": (30, "6" * 32), "e": (50, "7" * 32)}
    changes = contents_changes(json.loads(json.dumps(recorded)), current)  # lists, as a fingerprint reads back
    assert (changes.added, changes.removed, changes.resized, changes.rewritten) == (["e"], ["d"], ["b"], ["c"])
    assert changes.describe() == "1 added (e); 1 removed (d); 1 resized (b); 1 rewritten, same size (c)"
    assert not contents_changes(recorded, dict(recorded)) and contents_changes(recorded, {}).removed == list("abcd")


class CountingFileSystem(AbstractFileSystem):
    """Local files behind an object store's buffered file (read-ahead cache): every ranged read is recorded."""

    protocol = "countingfs"
    fetches: list = []

    def info(self, path, **kwargs):
        path = self._strip_protocol(path)
        return {"name": path, "size": os.path.getsize(path), "type": "file"}

    def _open(self, path, mode="rb", **kwargs):
        return _CountingFile(self, self._strip_protocol(path), mode, cache_type="readahead")


class _CountingFile(AbstractBufferedFile):
    def _fetch_range(self, start, end):
        CountingFileSystem.fetches.append((start, end))
        with open(self.path, "rb") as f:
            f.seek(start)
            return f.read(end - start)


@pytest.mark.parametrize(("row_group_size", "long_footer"), [(2000, False), (50, True)])  # 4 KiB; 140 KiB
def test_the_size_and_digest_cost_no_request_beyond_the_footers(tmp_path, row_group_size, long_footer):
    fsspec.register_implementation(CountingFileSystem.protocol, CountingFileSystem, clobber=True)
    path = tmp_path / "big.parquet"
    pq.write_table(
        pa.table({"text": [f"document {i} " * 40 for i in range(6000)]}), path, row_group_size=row_group_size
    )
    size, digest = os.path.getsize(path), file_footer_digest(path)
    CountingFileSystem.fetches.clear()
    footer = read_footer(f"countingfs://{path}")
    assert (footer.size, footer.digest) == (size, digest) == (os.path.getsize(path), read_footer(str(path)).digest)
    length = int.from_bytes(open(path, "rb").read()[-8:-4], "little")
    assert (length + 8 > FOOTER_READ) == long_footer
    if not long_footer:  # one ranged read of the file's end, as pyarrow alone makes
        assert CountingFileSystem.fetches == [(size - FOOTER_READ, size)]
    else:  # one more read for the footer's start, never the whole file
        assert len(CountingFileSystem.fetches) == 2 and CountingFileSystem.fetches[1][0] == size - length - 8
        assert sum(end - start for start, end in CountingFileSystem.fetches) < size / 2
