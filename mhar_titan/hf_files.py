"""Checks and file helpers for HF checkpoints (mhar_titan/hf.py), kept apart to keep hf.py small.

Each turns a bare parser error (JSONDecodeError, MemoryError, KeyError) into a ValueError that
names the file and what is wrong with it, and output folders get the mode `mkdir` would give.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Any

import fsspec
from torchtitan.models.llama3.model.args import RoPEScalingArgs

# The safetensors format caps the header at 100 MB (MAX_HEADER_SIZE in the safetensors crate).
SAFETENSORS_MAX_HEADER = 100_000_000
LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def safetensors_header(path: str) -> dict[str, Any]:
    """{tensor name: {"dtype", "shape", ...}} of a safetensors file (no "__metadata__"), without its data.

    The 8-byte length is checked against the file size and the format's limit before anything is read.
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
    for name, info in header.items():
        if not isinstance(info, dict) or "dtype" not in info or not isinstance(info.get("shape"), list):
            raise ValueError(f"{path}: corrupt safetensors header: tensor {name!r} has no dtype and shape: {info!r}")
    return header


def llama3_rope_scaling(rope: dict[str, Any], source: str, field_name: str = "rope_scaling") -> RoPEScalingArgs:
    """torchtitan's RoPE scaling arguments for an HF llama3 `rope_scaling` block, or a ValueError naming the key."""
    for key in LLAMA3_ROPE_KEYS:
        if key not in rope:
            raise ValueError(
                f"{source}: {field_name}.{key} is missing (rope type llama3 needs {', '.join(LLAMA3_ROPE_KEYS)})"
            )
    try:
        return RoPEScalingArgs(
            scaling_factor=float(rope["factor"]),
            low_freq_factor=float(rope["low_freq_factor"]),
            high_freq_factor=float(rope["high_freq_factor"]),
            original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
        )
    except (TypeError, ValueError):
        values = {k: rope[k] for k in LLAMA3_ROPE_KEYS}
        raise ValueError(f"{source}: {field_name}: {values} are not all numbers") from None


def umask() -> int:
    """The process umask, read without changing it where Linux shows it (/proc/self/status)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)  # elsewhere: set and restore (racy only against threads creating files now)
    os.umask(mask)
    return mask


def chmod_like_mkdir(path: str) -> None:
    """Give a folder made by tempfile.mkdtemp (mode 0700) the mode a plain mkdir would have given it."""
    os.chmod(path, 0o777 & ~umask())
