"""What loading an HF checkpoint would do with each tensor (loaded, newly initialised, unused, missing,
mismatched), from the safetensors headers alone: checked on every rank before any weight is read."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

import fsspec
import torch

from mhar_titan.hf.files import SAFETENSORS_DTYPES, safetensors_header
from mhar_titan.model.hf_config import DTYPE_NAMES
from mhar_titan.model.state_dict_adapter import OUR_ROUTING, ROUTING_INIT, MHARStateDictAdapter


def join(path: str, name: str) -> str:
    return path.rstrip("/") + "/" + name


def read_json(path: str) -> dict[str, Any]:
    with fsspec.open(path, "r") as f:
        return json.load(f)


def checkpoint_files(path: str) -> dict[str, str]:
    """{HF key: shard file} of a checkpoint directory (sharded with an index, or one file)."""
    fs, root = fsspec.core.url_to_fs(path)
    index = join(path, "model.safetensors.index.json")
    if fs.exists(join(root, "model.safetensors.index.json")):
        weight_map = read_json(index)["weight_map"]
        return {k: join(path, v) for k, v in weight_map.items()}
    single = join(path, "model.safetensors")
    if fs.exists(join(root, "model.safetensors")):
        return {k: single for k in safetensors_header(single)}
    raise FileNotFoundError(f"{path}: no model.safetensors.index.json or model.safetensors")


@dataclass
class LoadLedger:
    """What a load did with every tensor; printed on rank 0 and written as JSON into the run."""

    source: str
    loaded: list[str] = field(default_factory=list)
    initialised: dict[str, str] = field(default_factory=dict)
    unused: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.unused or self.missing or self.mismatched)

    def summary(self) -> str:
        lines = [
            f"load ledger for {self.source}: {len(self.loaded)} tensors loaded, "
            f"{len(self.initialised)} newly initialised, {len(self.unused)} unused, "
            f"{len(self.missing)} missing, {len(self.mismatched)} mismatched"
        ]
        for title, items in (("missing", self.missing), ("mismatched", self.mismatched), ("unused", self.unused)):
            lines += [f"  {title}: {item}" for item in items]
        by_init: dict[str, int] = {}
        for init in self.initialised.values():
            by_init[init] = by_init.get(init, 0) + 1
        lines += [f"  initialised {n} tensors as {init}" for init, n in sorted(by_init.items())]
        return "\n".join(lines)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


def build_ledger(path: str, expected: dict[str, torch.Size], adapter: MHARStateDictAdapter) -> LoadLedger:
    """Compare the checkpoint's tensors (headers only) with the model's {key: global shape}."""
    ledger = LoadLedger(source=path)
    config_dtype = read_json(join(path, "config.json")).get("torch_dtype")
    headers: dict[str, dict[str, Any]] = {}
    for shard in sorted(set(checkpoint_files(path).values())):
        headers.update(safetensors_header(shard))
    seen: set[str] = set()
    for hf_key, info in sorted(headers.items()):
        try:
            ours = adapter.our_key(hf_key)
        except KeyError:
            ledger.unused.append(hf_key)
            continue
        if ours is None:
            ledger.ignored.append(hf_key)
            continue
        if ours not in expected:
            ledger.unused.append(hf_key)
            continue
        seen.add(ours)
        want = tuple(expected[ours])
        dtype = SAFETENSORS_DTYPES.get(info["dtype"])
        if tuple(info["shape"]) != want:
            ledger.mismatched.append(f"{hf_key}: shape {tuple(info['shape'])} in the checkpoint, {want} in the model")
        elif dtype is None or (config_dtype and DTYPE_NAMES.get(dtype) != config_dtype):
            ledger.mismatched.append(f"{hf_key}: dtype {info['dtype']} in the checkpoint, config says {config_dtype}")
        else:
            ledger.loaded.append(ours)
    for key in sorted(set(expected) - seen):
        if m := OUR_ROUTING.match(key):
            ledger.initialised[key] = ROUTING_INIT[m[3]]
        else:
            ledger.missing.append(key)
    return ledger


class LedgerStateDictAdapter(MHARStateDictAdapter):
    """The train spec's adapter: the model's, and the ledger the checkpoint manager checks before it loads an HF
    checkpoint (mhar_titan/components/checkpoint/manager.py, which does not import hf)."""

    def ledger(self, path: str, expected: dict[str, torch.Size]) -> LoadLedger:
        return build_ledger(path, expected, self)
