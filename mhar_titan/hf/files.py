"""Checks and file helpers for HF checkpoints: safetensors headers and sizes, RoPE fields, output folders
(their modes, temporary siblings and those left by killed writers), config.json of an export, shards and
their index.

Each turns a bare parser error (JSONDecodeError, MemoryError, KeyError) into a ValueError that
names the file and what is wrong with it, and what is written gets the mode `open`/`mkdir` would give.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections.abc import Callable
from typing import Any

import fsspec
import torch
from safetensors.torch import save_file

from data.atomic import RemoteFolder, clean_stale, sibling, umask
from mhar_titan.model.args import MHAR
from mhar_titan.model.hf_config import MHAR_ARCHITECTURE, MHAR_MODEL_TYPE

# The safetensors format caps the header at 100 MB (MAX_HEADER_SIZE in the safetensors crate).
SAFETENSORS_MAX_HEADER = 100_000_000
SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}  # CLI names
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


def safetensors_header(path: str) -> dict[str, Any]:
    """{tensor name: {"dtype", "shape", ...}} of a safetensors file (no "__metadata__"), without its data.

    The 8-byte length is checked against the file size and the format's limit before anything is read,
    and the file's size against the one its header describes: a file cut short (a copy still running)
    would otherwise pass here and fail deep inside the load, naming no file.
    """
    fs, root = fsspec.core.url_to_fs(path)
    size = fs.size(root)  # None where a file system cannot tell: then only the format's limit applies
    if size is not None and size < 8:
        raise ValueError(f"{path}: not a safetensors file: {size} bytes, shorter than the 8-byte header length")
    with fs.open(root, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path}: not a safetensors file: shorter than the 8-byte header length")
        (length,) = struct.unpack("<Q", head)
        room = SAFETENSORS_MAX_HEADER if size is None else min(size - 8, SAFETENSORS_MAX_HEADER)
        if length > room:
            after = "an unknown number of bytes" if size is None else size - 8
            raise ValueError(
                f"{path}: corrupt safetensors header: length {length} bytes, but the file has {after} after "
                f"the length field (and the format allows at most {SAFETENSORS_MAX_HEADER})"
            )
        raw = f.read(length)
    if len(raw) != length:
        raise ValueError(
            f"{path}: corrupt safetensors header: length {length} bytes, but only {len(raw)} could be read"
        )
    try:
        header = json.loads(raw)
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
        raise ValueError(f"{path}: corrupt safetensors header: not JSON ({e})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: corrupt safetensors header: JSON {type(header).__name__}, expected an object")
    header.pop("__metadata__", None)
    end = 0
    for name, info in header.items():
        if not isinstance(info, dict) or "dtype" not in info or not isinstance(info.get("shape"), list):
            raise ValueError(f"{path}: corrupt safetensors header: tensor {name!r} has no dtype and shape: {info!r}")
        offsets = info.get("data_offsets")
        if not (
            isinstance(offsets, list)
            and len(offsets) == 2
            and all(type(o) is int and o >= 0 for o in offsets)
            and offsets[0] <= offsets[1]
        ):
            raise ValueError(f"{path}: corrupt safetensors header: tensor {name!r} has no valid data_offsets: {info!r}")
        end = max(end, offsets[1])
    want = 8 + length + end  # the format: the length, the header, then the data up to the last tensor's end
    if size is not None and size != want:
        why = "truncated or still being copied" if size < want else "bytes after the last tensor's data"
        raise ValueError(f"{path}: {size:,} bytes, the header describes {want:,}: {why}")
    return header


def write_safetensors(tensors: dict[str, torch.Tensor], path: str) -> None:
    """save_file, then the mode `open` would give: safetensors 0.8 writes through a temporary file (mode
    0600) renamed into place, which teammates on a shared file system could not read."""
    save_file(tensors, path, metadata={"format": "pt"})
    os.chmod(path, 0o666 & ~umask())


# ---------------------------------------------------------------------------------------------
# output folders: written in a hidden sibling named for the output, this host and this process

NAME_MAX = 255
EXPORT = "export"  # the kind of sibling an export or init writes in (data/atomic.py)


EXPORTING = "_EXPORTING.json"  # on object storage: created first, deleted last (data/atomic.py RemoteFolder)


def remote_folder(out_dir: str, verb: str = "export") -> RemoteFolder:
    return RemoteFolder(out_dir, EXPORTING, f"hf {verb}", redo=f"delete {out_dir} and {verb} again")


def check_new_output(out_dir: str, verb: str = "export") -> None:
    """Refuse an existing output (or one whose temporary sibling's name would be too long), on disk or on object
    storage (a prefix with anything under it), before any work."""
    if "://" in out_dir:
        if entries := remote_folder(out_dir, verb).check(replace=False, log=print):
            raise FileExistsError(
                f"{out_dir} already exists ({len(entries)} entries, e.g. {entries[0]}); {verb} into a new folder"
            )
        return
    if os.path.lexists(out_dir):
        raise FileExistsError(f"{out_dir} already exists; {verb} into a new directory")
    name = os.path.basename(sibling(out_dir, EXPORT))
    if len(name) > NAME_MAX:
        raise ValueError(f"{out_dir}: the name is too long for its temporary sibling {name} (at most {NAME_MAX})")


def temp_folder(out_dir: str, log: Callable[[str], None]) -> str:
    """A new hidden sibling of `out_dir` to write into (renamed into place when complete), made by mkdir
    (its mode follows the umask), after removing those that killed exports to `out_dir` left."""
    clean_stale(out_dir, (EXPORT,), "an export to", log)
    tmp = sibling(out_dir, EXPORT)
    os.mkdir(tmp)
    return tmp


# ---------------------------------------------------------------------------------------------
# the MHAR arm's own HF architecture (mhar_titan/hf/modeling/)

MODELING_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "modeling")
MODELING_FILES = ("configuration_mhar_llama.py", "modeling_mhar_llama.py")
MHAR_LAYER_TYPE = "mhar_delta"  # configuration_mhar_llama.MHAR_LAYER_TYPE: what a plain LlamaConfig refuses
MHAR_CONFIG_KEYS = ("auto_map", "mhar", "layer_types")


def export_config(config: dict[str, Any], mhar: dict[str, Any] | None) -> dict[str, Any]:
    """config.json for an export: plain Llama when `mhar` is None, else the MHAR arm's own architecture.

    From a plain or an MHAR config (whose own keys are dropped first), keeping the key order, so that
    export -> load -> export writes the same file.
    """
    mhar_keys = MHAR_CONFIG_KEYS if config.get("model_type") == MHAR_MODEL_TYPE else ("mhar",)
    out = {k: v for k, v in config.items() if k not in mhar_keys}
    out["model_type"] = "llama" if mhar is None else MHAR_MODEL_TYPE
    out["architectures"] = ["LlamaForCausalLM"] if mhar is None else [MHAR_ARCHITECTURE]
    if mhar is not None:
        out["auto_map"] = {
            "AutoConfig": "configuration_mhar_llama.MHARLlamaConfig",
            "AutoModelForCausalLM": f"modeling_mhar_llama.{MHAR_ARCHITECTURE}",
        }
        out["mhar"] = dict(mhar)
        out["layer_types"] = [MHAR_LAYER_TYPE] * config["num_hidden_layers"]
    return out


def copy_modeling_files(out_dir: str) -> None:
    """Put the MHAR configuration and modeling files beside the weights (for trust_remote_code)."""
    for name in MODELING_FILES:
        shutil.copyfile(os.path.join(MODELING_DIR, name), os.path.join(out_dir, name))


def mhar_settings(config: dict[str, Any], mhar: MHAR | dict[str, Any] | None, source: str) -> MHAR:
    """The [mhar] settings a load uses: the caller's, the export's own, or the control's."""
    if isinstance(mhar, dict):
        mhar = dict(mhar)
        if "variant" in mhar:  # an export's own block: {"num_heads", "num_blocks", "variant"}
            mhar.setdefault("enable", True)
        variant = mhar.pop("variant", "delta")
        if variant != "delta":
            raise ValueError(f"mhar variant = {variant!r}: only 'delta' is implemented")
        mhar = MHAR(**mhar)
    if config.get("model_type") != MHAR_MODEL_TYPE:
        return mhar if mhar is not None else MHAR(enable=False)
    block = config.get("mhar") or {}
    if block.get("variant", "delta") != "delta":
        raise ValueError(f"{source}: mhar.variant = {block['variant']!r}: only 'delta' is implemented")
    own = MHAR(enable=True, num_heads=block.get("num_heads"), num_blocks=block.get("num_blocks"))
    if mhar is None:
        return own
    for name in ("enable", "num_heads", "num_blocks"):
        if getattr(mhar, name) != getattr(own, name):
            raise ValueError(
                f"{source}: an MHAR export with {name} = {getattr(own, name)!r}, loaded with "
                f"mhar {name} = {getattr(mhar, name)!r}; leave mhar unset to use the export's own settings"
            )
    return mhar


def plan_shards(sizes: dict[str, int], max_shard_bytes: int) -> list[list[str]]:
    """HF keys in sorted order, cut greedily into shards of at most max_shard_bytes (one tensor per shard if larger)."""
    shards: list[list[str]] = [[]]
    size = 0
    for key in sorted(sizes):
        if shards[-1] and size + sizes[key] > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += sizes[key]
    return shards


def shard_name(i: int, n: int) -> str:
    return f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def write_index(out_dir: str, shards: list[list[str]], total_bytes: int) -> None:
    weight_map = {key: shard_name(i, len(shards)) for i, keys in enumerate(shards) for key in keys}
    index = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f, indent=2)


def write_shards(state: dict[str, torch.Tensor], out_dir: str, max_shard_bytes: int) -> None:
    """Sharded safetensors of at most max_shard_bytes each (one tensor per shard if larger), and the index."""
    sizes = {key: t.numel() * t.element_size() for key, t in state.items()}
    shards = plan_shards(sizes, max_shard_bytes)
    for i, keys in enumerate(shards):
        write_safetensors({k: state[k] for k in keys}, os.path.join(out_dir, shard_name(i, len(shards))))
    write_index(out_dir, shards, sum(sizes.values()))
