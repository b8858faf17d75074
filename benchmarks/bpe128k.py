"""A Llama-3-sized byte-level BPE (128,256 ids), trained on this machine's text and cached.

Marin-8B reads the Llama-3 tokenizer, which is not on a machine without a download; the loader's
throughput depends on the vocabulary (a larger one means fewer, longer tokens per byte), so the
bench trains a stand-in of the same shape: a Llama-3-style regex split then byte-level BPE, 128,000
learned ids (the 256 bytes and merges) followed by 256 special tokens (<|begin_of_text|> = 128000,
<|end_of_text|> = 128001, the rest Llama-3.1's names and reserved slots), and a post-processor that
puts <|begin_of_text|> in front when asked for special tokens, as Llama-3's does.

The corpus is the Python sources, docs and text files of this interpreter's library folders
(stdlib and site-packages), a sample chosen by a hash of each file's relative path, so the same
files give the same tokenizer. The result lives in `~/.cache/mhar-titan/bpe128k/<key>/`, the key
a hash of the recipe and the candidate files' names and sizes: a re-run finds it in seconds.

    python -m benchmarks.bpe128k          # train (or find) it and print its folder
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sysconfig
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"
# Llama-3.1's first special tokens, in id order; reserved slots fill the rest of the 256.
NAMED_SPECIALS = (
    BOS,
    EOS,
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>",
    "<|reserved_special_token_2|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eom_id|>",
    "<|eot_id|>",
    "<|python_tag|>",
)
# Llama-3's split, written out: English contractions (any case), a letter run with at most one
# leading non-letter, numbers in groups of at most three digits, punctuation runs with a leading
# space and trailing newlines, newline runs, and other whitespace (the last space before a word
# stays with the word).
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
    r"|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+"
    r"|\s+(?!\S)"
    r"|\s+"
)
SUFFIXES = (".py", ".md", ".rst", ".txt")
CACHE = Path.home() / ".cache" / "mhar-titan" / "bpe128k"


def special_tokens(count: int = 256) -> list[str]:
    """Llama-3.1's special tokens: the named ones, then reserved slots up to `count`."""
    if count < 2:
        raise ValueError(f"special token count {count} leaves no room for {BOS} and {EOS}")
    named = list(NAMED_SPECIALS[:count])
    return named + [f"<|reserved_special_token_{i}|>" for i in range(3, 3 + count - len(named))]


@dataclass(frozen=True)
class Recipe:
    """Everything the tokenizer is a function of, besides the files themselves."""

    vocab_size: int = 128_256
    num_special: int = 256
    corpus_mb: float = 150.0
    max_file_kb: int = 512
    suffixes: tuple[str, ...] = SUFFIXES
    split_pattern: str = SPLIT_PATTERN
    version: int = 1
    roots: tuple[str, ...] = field(default_factory=tuple)

    @property
    def learned(self) -> int:
        return self.vocab_size - self.num_special


def library_roots() -> tuple[str, ...]:
    """This interpreter's stdlib and site-packages folders (a venv's and its base's), each once."""
    paths = sysconfig.get_paths()
    found = [paths["stdlib"], paths["purelib"], paths["platlib"]]
    real = dict.fromkeys(os.path.realpath(p) for p in found if os.path.isdir(p))
    return tuple(real)


def candidate_files(recipe: Recipe) -> list[tuple[str, Path, int]]:
    """(key, path, bytes) of every text file under the roots, in the order the sample takes them:
    the docs (every non-.py file) first, then sources, each by a hash of the file's path below its
    root, so the sample spreads over all packages."""
    found: dict[str, tuple[str, Path, int]] = {}  # by real path: a root inside another is read once
    limit = recipe.max_file_kb * 1024
    for index, root in enumerate(recipe.roots):
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__" and not d.startswith("."))
            for name in filenames:
                path = Path(dirpath) / name
                if path.suffix not in recipe.suffixes or path.is_symlink():
                    continue
                size, real = path.stat().st_size, os.path.realpath(path)
                if 0 < size <= limit and real not in found:
                    found[real] = (f"{index}/{path.relative_to(root).as_posix()}", path, size)
    return sorted(found.values(), key=lambda f: (f[1].suffix == ".py", hashlib.blake2b(f[0].encode()).digest()))


def corpus_texts(files: list[tuple[str, Path, int]], megabytes: float) -> Iterator[str]:
    """The files' text, up to `megabytes` of UTF-8; files that do not decode, and repeats of a
    file already taken (the same package installed twice), are skipped."""
    budget, seen = int(megabytes * 1e6), set()
    for _, path, _ in files:
        if budget <= 0:
            return
        data = path.read_bytes()
        digest = hashlib.blake2b(data, digest_size=16).digest()
        if digest in seen:
            continue
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            continue
        seen.add(digest)
        budget -= len(data)
        yield text


def recipe_key(recipe: Recipe, files: list[tuple[str, Path, int]]) -> str:
    """A hash of the recipe and of the candidate files' names and sizes: the cache folder's name."""
    h = hashlib.blake2b(json.dumps(asdict(recipe), sort_keys=True).encode(), digest_size=8)
    for key, _, size in files:
        h.update(f"{key}\0{size}\n".encode())
    return h.hexdigest()


def train_bpe(texts: Iterator[str], vocab_size: int, num_special: int = 256) -> Tokenizer:
    """Byte-level BPE on `texts`: vocab_size - num_special learned ids, then the special tokens."""
    if vocab_size - num_special < 256:
        raise ValueError(f"vocab_size {vocab_size} leaves fewer than 256 ids (the bytes) beside {num_special} specials")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - num_special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tok.model.ignore_merges = True  # as Llama-3's: a word already in the vocabulary is one token
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special_tokens(num_special)])
    bos = tok.token_to_id(BOS)
    template = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS}:1 $B:1", special_tokens=[(BOS, bos)]
    )
    tok.post_processor = processors.Sequence([processors.ByteLevel(trim_offsets=False), template])
    return tok


def save_tokenizer(tok: Tokenizer, out: Path) -> None:
    """tokenizer.json and the tokenizer_config.json torchtitan's HuggingFaceTokenizer reads."""
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {"bos_token": BOS, "eos_token": EOS, "tokenizer_class": "PreTrainedTokenizerFast"}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def cached_bpe(recipe: Recipe | None = None, cache: Path = CACHE) -> Path:
    """The folder of the tokenizer `recipe` makes, trained now (the time printed) if not cached."""
    recipe = recipe or Recipe(roots=library_roots())
    files = candidate_files(recipe)
    out = cache / recipe_key(recipe, files)
    if (out / "tokenizer_config.json").exists():
        return out
    start = time.perf_counter()
    tok = train_bpe(corpus_texts(files, recipe.corpus_mb), recipe.vocab_size, recipe.num_special)
    if tok.get_vocab_size() != recipe.vocab_size:
        raise ValueError(
            f"the BPE reached {tok.get_vocab_size()} ids, not {recipe.vocab_size}: "
            f"{recipe.corpus_mb:g} MB of text is too little for its merges"
        )
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:  # written whole, then renamed: no half caches
        save_tokenizer(tok, Path(tmp) / "tok")
        if not out.exists():
            os.replace(Path(tmp) / "tok", out)
    print(
        f"trained a {recipe.vocab_size:,}-id byte-level BPE on {recipe.corpus_mb:g} MB of local text "
        f"in {time.perf_counter() - start:.0f} s; cached in {out}"
    )
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab-size", type=int, default=Recipe.vocab_size, help="ids, special tokens included")
    parser.add_argument("--corpus-mb", type=float, default=Recipe.corpus_mb, help="MB of library text to train on")
    parser.add_argument("--cache", type=Path, default=CACHE, help=f"where tokenizers are kept (default {CACHE})")
    args = parser.parse_args(argv)
    print(cached_bpe(Recipe(args.vocab_size, corpus_mb=args.corpus_mb, roots=library_roots()), args.cache))


if __name__ == "__main__":
    main()
