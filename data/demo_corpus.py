"""Build the demo corpus and tokenizer that `make demo` and the CPU tests train on.

Two sources from CPython's standard library (PSF licence), with no download: `corpus/`, its long
docstrings (English prose, about 1.2 MB; the tokenizer is trained on these), and `code/`, the
source of its short functions (about 0.6 MB), so the demo trains on a two-source mixture. The
`source` column holds a coarse kind, one of six whatever the Python version (`SOURCES`: module,
class, function or method docstrings; functions or methods), so the demo logs few data/tokens/<tag>
and data/token_share/<tag> charts. The outputs are committed under `assets/tiny/`, so every machine
trains on the same bytes whatever its Python version; run this module only to rebuild them:

    python -m data.demo_corpus assets/tiny
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"
_SKIP_DIRS = {"test", "tests", "idlelib", "site-packages", "lib2to3", "turtledemo", "__pycache__"}
DOCSTRING_SOURCES = {
    "module": "module_docstrings",
    "class": "class_docstrings",
    "function": "function_docstrings",
    "method": "method_docstrings",
}
CODE_SOURCES = {"function": "functions", "method": "methods"}
SOURCES = (*DOCSTRING_SOURCES.values(), *CODE_SOURCES.values())
"""Every value of the demo corpus's `source` column."""


def node_kinds(tree: ast.Module) -> dict[ast.AST, str]:
    """'module', 'class', 'function' or 'method' (a function defined directly in a class body) of the
    module, each class and each function of `tree`."""
    kinds: dict[ast.AST, str] = {tree: "module"}
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            kinds[node] = "class"
            for child in node.body:
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    kinds[child] = "method"
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            kinds.setdefault(node, "function")
    return kinds


def stdlib_modules() -> Iterator[tuple[str, ast.Module]]:
    """(source text, its syntax tree) of each standard-library file, in sorted path order (test and
    tool folders left out; files that do not parse skipped)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            path = Path(dirpath) / name
            try:
                text = path.read_text(encoding="utf-8")
                tree = ast.parse(text)
            except (SyntaxError, UnicodeDecodeError):
                continue
            yield text, tree


def docstrings(tree: ast.Module, min_chars: int = 200) -> list[tuple[str, str]]:
    """(text, source) of the docstrings of `min_chars` or more in `tree`, in `ast.walk` order; source
    from `DOCSTRING_SOURCES`."""
    kinds = node_kinds(tree)
    docs: list[tuple[str, str]] = []
    for node in ast.walk(tree):
        if node in kinds:
            text = ast.get_docstring(node)
            if text and len(text) >= min_chars:
                docs.append((text, DOCSTRING_SOURCES[kinds[node]]))
    return docs


def stdlib_docstrings(min_chars: int = 200) -> list[tuple[str, str]]:
    """(text, source) pairs of every standard-library file (`docstrings`)."""
    return [doc for _, tree in stdlib_modules() for doc in docstrings(tree, min_chars)]


def stdlib_functions(min_chars: int = 300, max_chars: int = 1500, limit: int = 600_000) -> list[tuple[str, str]]:
    """(source code, source) of the standard library's functions of min..max characters, in file
    order, up to `limit` characters in all; source from `CODE_SOURCES`."""
    out: list[tuple[str, str]] = []
    total = 0
    for text, tree in stdlib_modules():
        kinds = node_kinds(tree)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                code = ast.get_source_segment(text, node)
                if code and min_chars <= len(code) <= max_chars:
                    out.append((code, CODE_SOURCES[kinds[node]]))
                    total += len(code)
                    if total >= limit:
                        return out
    return out


def write_shards(folder: Path, docs: list[tuple[str, str]], num_shards: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(num_shards):
        part = docs[i::num_shards]
        table = pa.table({"text": [t for t, _ in part], "source": [s for _, s in part]})
        pq.write_table(table, folder / f"shard-{i:05d}.parquet", row_group_size=128)


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE with Llama-3-style special tokens, so any text encodes."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def build(out_dir: Path, num_shards: int = 4, vocab_size: int = 2048) -> None:
    docs = stdlib_docstrings()
    write_shards(out_dir / "corpus", docs, num_shards)
    code = stdlib_functions()
    write_shards(out_dir / "code", code, num_shards)
    tok = train_tokenizer([t for t, _ in docs], vocab_size)
    tok.save(str(out_dir / "tokenizer.json"))
    config = {"bos_token": BOS, "eos_token": EOS, "add_bos_token": True, "add_eos_token": False}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    print(
        f"{len(docs)} docstrings and {len(code)} functions, {num_shards} shards each, vocab {tok.get_vocab_size()}, "
        f"in {out_dir}"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m data.demo_corpus", description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path, help="where corpus/, code/ and the tokenizer files are written")
    args = parser.parse_args(argv)
    build(args.out_dir)


if __name__ == "__main__":
    main()
