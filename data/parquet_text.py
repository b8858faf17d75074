"""A torchtitan dataset over local parquet files with a `text` column.

Registered as `[training] dataset = "parquet"`, with `dataset_path` a folder of
`*.parquet` files (or one file). It runs through torchtitan's stateful HF text
loader, so checkpoints resume it exactly; the streaming sharded-parquet
pipeline of `data/` supersedes it for corpus-scale runs.
"""

from __future__ import annotations

import os
from typing import Any

from datasets import Dataset, load_dataset
from torchtitan.hf_datasets import DatasetConfig
from torchtitan.hf_datasets.text_datasets import DATASETS


def load_parquet(path: str) -> Dataset:
    if os.path.isdir(path):
        files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".parquet"))
    else:
        files = [path]
    if not files or not all(os.path.isfile(f) for f in files):
        raise FileNotFoundError(f"training.dataset_path={path!r}: no parquet files found there")
    return load_dataset("parquet", data_files=files, split="train")


def text_of(sample: dict[str, Any]) -> str:
    return sample["text"]


DATASETS["parquet"] = DatasetConfig(path="assets/tiny/corpus", loader=load_parquet, sample_processor=text_of)
