"""A multiple-choice task for lm-evaluation-harness built from the demo corpus, so the evaluation of a pair
runs offline (CI, `make demo`) through the same harness and code path as the standard tasks on a cluster.

`mhar_tiny_cloze`: from each held-out document of `assets/tiny/corpus` (the validation split's hash, so
no training document), spans of 12 words are the context and the next 6 words the answer, against 3
continuations drawn from other spans. Deterministic: the same items on every machine.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pyarrow.parquet as pq

from data.shards import held_out

TASK = "mhar_tiny_cloze"
CORPUS = Path(__file__).resolve().parents[2] / "assets" / "tiny" / "corpus"
CONTEXT_WORDS, ANSWER_WORDS, SPANS_PER_DOC, CHOICES = 12, 6, 4, 4
HELD_OUT = 0.02  # configs/tiny_cpu.toml's validation_fraction: documents the tiny runs never train on


def cloze_items(corpus: Path = CORPUS, seed: int = 0) -> list[dict]:
    """{"context", "choices", "label"} items from the held-out documents of a parquet corpus."""
    spans = []
    for shard in sorted(corpus.glob("*.parquet")):
        for text in pq.read_table(shard, columns=["text"]).column("text").to_pylist():
            if not text or not held_out(text, HELD_OUT):
                continue
            words = text.split()
            width = CONTEXT_WORDS + ANSWER_WORDS
            for start in range(0, min(len(words) - width + 1, SPANS_PER_DOC * width), width):
                span = words[start : start + width]
                spans.append((" ".join(span[:CONTEXT_WORDS]), " " + " ".join(span[CONTEXT_WORDS:])))
    if len(spans) < CHOICES:
        raise ValueError(f"{corpus}: {len(spans)} held-out spans, too few for a {CHOICES}-way task")
    rng = random.Random(seed)
    items = []
    for i, (context, answer) in enumerate(spans):
        others = rng.sample([a for j, (_, a) in enumerate(spans) if j != i and a != answer], CHOICES - 1)
        choices = [answer, *others]
        rng.shuffle(choices)
        items.append({"context": context, "choices": choices, "label": choices.index(answer)})
    return items


def write_task(folder: Path) -> Path:
    """The task's data and its lm-eval YAML in `folder` (an lm-eval include path); returns the folder."""
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / f"{TASK}.jsonl"
    data.write_text("".join(json.dumps(item) + "\n" for item in cloze_items()))
    (folder / f"{TASK}.yaml").write_text(
        f"task: {TASK}\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {json.dumps(str(data.resolve()))}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        'doc_to_text: "{{context}}"\n'
        'doc_to_choice: "{{choices}}"\n'
        "doc_to_target: label\n"
        "metric_list:\n"
        "  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
        "  - metric: acc_norm\n    aggregation: mean\n    higher_is_better: true\n"
    )
    return folder
