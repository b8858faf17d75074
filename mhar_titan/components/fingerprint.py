"""A run's fingerprint: what a resume must agree with, so a restarted job continues the run it claims to.

Recorded as `<dump_folder>/fingerprint.json` once a job has checked (or started) its weights,
in four groups:
- model: the architecture, the attention mask and the `[mhar]` graft (not the routing backend, which computes
  the same op);
- base: the weights a fresh start loads (path, and hashes of its config.json and weight index);
- data: the shards after the start-up check (their paths below the corpus folder, hashed; per
  mixture source with its weight; the mixture stages' weights by step), each source's contents
  (every shard's size and parquet footer, hashed: a corpus re-prepared in place differs), the order's
  seed and streams, the windows per loader batch (local_batch_size), the columns, the validation sets, whether
  the loss counts each document's first token;
- schedule: optimizer and LR schedule settings, global batch and sequence length, z-loss, EMA, and the
  precision (model converters such as float8, recorded only when there are any).
A job that would load one of the run's checkpoints compares its own fingerprint with the
recorded one and refuses, listing every difference, unless `[checkpoint] allow_changes` names
the groups it means to change (never `model`); allowed changes are logged and recorded.
The number of ranks and loader workers is not part of it: resume on another count is exact as long as
local_batch_size (and the global batch) stay, the gradient-accumulation steps taking up the difference.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from typing import TYPE_CHECKING, Any

from data.atomic import write_text
from data.mixture import parse_mixture
from data.stages import StageSchedule, parse_stages
from data.stream import shard_keys
from mhar_titan.components.checkpoint.layout import COMPLETE

if TYPE_CHECKING:  # annotations only: the comparison reads fingerprints without loading torchtitan (and triton)
    from torchtitan.config import JobConfig

FILE = "fingerprint.json"
GROUPS = ("model", "base", "data", "schedule")
ALLOWABLE = ("base", "data", "schedule")
LEGACY = "legacy"  # allow_changes value: resume a run folder that has checkpoints but no fingerprint.json
_NOT_ARCHITECTURE = ("_enforced", "max_seq_len", "attn_type")  # set per job, or an implementation choice
_MHAR_NOT_ARCHITECTURE = ("backend", "stats_freq", "lr_multiplier")  # lr_multiplier: in schedule
_INFORMATION = {("base", "path")}  # shown, never compared: the same files may move
# Recorded since a later version: compared only where the run's fingerprint has them (and this job too).
_ADDED_LATER = {("data", "local_batch_size"), ("data", "contents")}
_HINTS = {
    ("schedule", "decay_end"): "(decay_end is lr_scheduler.total_steps, or training.steps when that is unset)",
    ("data", "local_batch_size"): "(data.local_batch_size is training.local_batch_size: each loader batch is that "
    "many consecutive windows of one stream, so another value trains each step on other windows; to change the "
    "number of ranks keep it and let training.global_batch_size set the gradient-accumulation steps)",
    ("data", "contents"): "(data.contents: every shard's size and parquet footer, per source: the corpus was "
    "rewritten since the run recorded it, e.g. by data.prepare --overwrite, so a resume would read other documents)",
}


def _digest(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def _file_digest(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return _digest(f.read())
    except FileNotFoundError:
        return None


def _plain(value: Any) -> Any:
    """As JSON reads it back (tuples become lists), so recorded and current compare equal."""
    return json.loads(json.dumps(value))


def model_group(args: dict[str, Any]) -> dict[str, Any]:
    """The architecture from model arguments as `dataclasses.asdict` gives them (or model_args.json holds)."""
    args = _plain(args)
    for key in _NOT_ARCHITECTURE:
        args.pop(key, None)
    mhar = args.get("mhar", {})
    for key in _MHAR_NOT_ARCHITECTURE:
        mhar.pop(key, None)
    if not mhar.get("enable", False):  # the control: the routing settings are unused
        args["mhar"] = {"enable": False}
    return args


def base_group(job_config: JobConfig) -> dict[str, Any]:
    """The weights a fresh start loads; its hashes cover config.json and the weight index (or .metadata)."""
    ckpt = job_config.checkpoint
    if ckpt.initial_load_in_hf:
        path = ckpt.initial_load_path or job_config.model.hf_assets_path
        files = ("config.json", "model.safetensors.index.json", "model.safetensors")
    elif ckpt.initial_load_path:
        path, files = ckpt.initial_load_path, (COMPLETE,)
    else:
        return {"init": "random", "seed": job_config.debug.seed}
    out: dict[str, Any] = {"path": os.path.abspath(path), "format": "hf" if ckpt.initial_load_in_hf else "dcp"}
    for name in files:
        if name == "model.safetensors" and out.get("model.safetensors.index.json"):
            continue
        if name == "model.safetensors":  # one unsharded file: its header (names, shapes, offsets) identifies it
            out[name] = _safetensors_header_digest(os.path.join(path, name))
        else:
            out[name] = _file_digest(os.path.join(path, name))
    return out


def _safetensors_header_digest(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            length = int.from_bytes(head, "little") if len(head) == 8 else 0
            return _digest(head + f.read(min(length, 100 * 2**20)))
    except FileNotFoundError:
        return None


def _shards_digest(shards: list[str]) -> str:
    return _digest("\n".join(sorted(shard_keys(shards).values()) if shards else []).encode())


def data_group(
    job_config: JobConfig, shards: list[str] | dict[str, list[str]], contents: dict[str, str] | None = None
) -> dict[str, Any]:
    """`shards`: the usable shards of each mixture source (a list: the one source of `[data] paths`);
    `contents`: each source's content digest (None: not known, `[data] check_shards = false`).
    Settings added after the first runs are recorded only where they differ from their defaults (or, in
    `_ADDED_LATER`, compared only where the run recorded them), so the fingerprints of those runs still match."""
    cfg = job_config.data
    if isinstance(shards, dict) and not cfg.mixture:
        (shards,) = shards.values()
    optional: dict[str, Any] = {}
    if isinstance(shards, dict):
        weights = {src.name: src.weight for src in parse_mixture(cfg)}
        optional["mixture"] = {
            name: {"weight": weights[name], "shards": _shards_digest(paths), "num_shards": len(paths)}
            for name, paths in shards.items()
        }
        shards = [path for paths in shards.values() for path in paths]
    if cfg.mixture_stages:  # the weights by step, normalised: how they are written does not matter
        sources = parse_mixture(cfg)
        stages = parse_stages(cfg, [s.name for s in sources], [s.weight for s in sources], None)
        optional["mixture_stages"] = StageSchedule(stages).describe([s.name for s in sources])[1:]
    for key, default in (
        ("on_source_exhausted", "repeat"),
        ("bos", "auto"),
        ("validation_sets", []),
        ("loss_on_document_start", True),
    ):
        if getattr(cfg, key) != default:
            optional[key] = getattr(cfg, key)
    if contents is not None:
        optional["contents"] = contents
    return _plain(
        {
            "shards": _shards_digest(shards),
            "num_shards": len(shards),
            "seed": cfg.seed,
            "num_streams": cfg.num_streams,
            "text_column": cfg.text_column,
            "source_column": cfg.source_column,
            "max_document_tokens": getattr(cfg, "max_document_tokens", 0),
            "local_batch_size": job_config.training.local_batch_size,
            "validation_fraction": cfg.validation_fraction,
            "validation_paths": sorted(cfg.validation_paths),
            **optional,
        }
    )


def precision(job_config: JobConfig) -> dict[str, Any]:
    """The model converters a job trains with (torchtitan's `[model] converters`: float8 matmuls) and the float8
    settings that change what they compute; empty for plain bf16, as every run recorded before converters were."""
    converters = list(job_config.model.converters)
    if not converters:
        return {}
    out: dict[str, Any] = {"converters": converters}
    if any("float8" in c for c in converters):
        f8 = job_config.quantize.linear.float8
        out["float8"] = {"recipe_name": f8.recipe_name, "filter_fqns": sorted(f8.filter_fqns), "emulate": f8.emulate}
    return out


def schedule_group(job_config: JobConfig, global_batch_size: int) -> dict[str, Any]:
    opt, lr, t = job_config.optimizer, job_config.lr_scheduler, job_config.training
    optional = {"precision": precision(job_config)} if job_config.model.converters else {}
    return _plain(
        {
            "optimizer": opt.name,
            "lr": opt.lr,
            "betas": [opt.beta1, opt.beta2],
            "eps": opt.eps,
            "weight_decay": opt.weight_decay,
            "weight_decay_output": opt.weight_decay_output,
            "routing_lr_multiplier": job_config.mhar.lr_multiplier,
            "warmup_steps": lr.warmup_steps,
            "decay_end": lr.total_steps if lr.total_steps is not None else t.steps,
            "decay_ratio": lr.decay_ratio,
            "decay_type": lr.decay_type,
            "min_lr_factor": lr.min_lr_factor,
            "global_batch_size": global_batch_size,
            "seq_len": t.seq_len,
            "max_norm": t.max_norm,
            "z_loss": job_config.loss.z_loss,
            "ema": [job_config.ema.enable, job_config.ema.beta, job_config.ema.every],
            **optional,
        }
    )


def fingerprint(
    job_config: JobConfig,
    model_args: Any,
    shards: list[str] | dict[str, list[str]],
    global_batch_size: int,
    contents: dict[str, str] | None = None,
) -> dict[str, Any]:
    return {
        "model": model_group(dataclasses.asdict(model_args)),
        "base": base_group(job_config),
        "data": data_group(job_config, shards, contents),
        "schedule": schedule_group(job_config, global_batch_size),
    }


def differences(recorded: dict[str, Any], current: dict[str, Any]) -> list[tuple[str, str, Any, Any]]:
    """(group, key, recorded value, current value) for every compared key that differs."""
    out = []
    for group in GROUPS:
        was, now = recorded.get(group, {}), current.get(group, {})
        for key in sorted(set(was) | set(now)):
            if (group, key) in _ADDED_LATER and (key not in was or key not in now):
                continue
            if (group, key) not in _INFORMATION and was.get(key, "<absent>") != now.get(key, "<absent>"):
                out.append((group, key, was.get(key, "<absent>"), now.get(key, "<absent>")))
    return out


def _flat(value: Any, prefix: str) -> dict[str, Any]:
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            out.update(_flat(v, f"{prefix}.{k}"))
        return out
    return {prefix: value}


def unchecked(recorded: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """The `_ADDED_LATER` settings that one side lacks, so that a resume does not compare them."""
    return [
        f"{group}.{key}"
        for group, key in sorted(_ADDED_LATER)
        if (key in recorded.get(group, {})) != (key in current.get(group, {}))
    ]


def describe(diffs: list[tuple[str, str, Any, Any]]) -> list[str]:
    """One line per differing leaf setting: `model.mhar.num_blocks: 2 in the run, 4 now`."""
    lines = []
    for group, key, was, now in diffs:
        was_flat, now_flat = _flat(was, f"{group}.{key}"), _flat(now, f"{group}.{key}")
        for name in sorted(set(was_flat) | set(now_flat)):
            a, b = was_flat.get(name, "<absent>"), now_flat.get(name, "<absent>")
            if a != b:
                lines.append(f"{name}: {json.dumps(a)} in the run, {json.dumps(b)} now")
    return lines


def read(folder: str) -> dict[str, Any] | None:
    path = os.path.join(folder, FILE)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            recorded = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: unreadable run fingerprint ({type(e).__name__}: {e})") from e
    if not isinstance(recorded, dict) or not all(isinstance(recorded.get(g), dict) for g in GROUPS):
        raise ValueError(f"{path}: not a run fingerprint (expected the groups {', '.join(GROUPS)})")
    return recorded


def check_allow(allow: list[str]) -> None:
    """`[checkpoint] allow_changes` names only groups that may change, or legacy (checked at every start)."""
    bad_allow = sorted(set(allow) - {*ALLOWABLE, LEGACY})
    if bad_allow:
        raise ValueError(
            f"[checkpoint] allow_changes = {allow}: {', '.join(bad_allow)} cannot be allowed "
            f"(choose from {', '.join((*ALLOWABLE, LEGACY))}; a run's architecture never changes on resume)"
        )


def check(recorded: dict[str, Any], current: dict[str, Any], allow: list[str], where: str) -> list[str]:
    """The lines of the allowed differences; a ValueError listing all of them if any group is not allowed."""
    check_allow(allow)
    diffs = differences(recorded, current)
    refused = sorted({group for group, *_ in diffs if group not in allow})
    if refused:
        lines = describe(diffs)
        lines += [hint for where, hint in _HINTS.items() if any((group, key) == where for group, key, *_ in diffs)]
        allowable = [g for g in refused if g != "model"]
        advice = "Use the run's settings or another dump_folder"
        if "model" in refused:
            advice += "; the architecture ([model], [mhar]) of a run cannot change"
        if allowable:
            groups = ",".join(allowable)
            advice += f"; to change {groups} deliberately: --checkpoint.allow_changes {groups}"
        raise ValueError(
            f"{where} was trained with other settings than this job's; refusing to resume it.\n  "
            + "\n  ".join(lines)
            + f"\n{advice}"
        )
    return describe(diffs)


def record(folder: str, current: dict[str, Any], step: int, changes: list[str]) -> None:
    """Write the fingerprint atomically, keeping the history of allowed changes."""
    path = os.path.join(folder, FILE)
    previous = read(folder) if os.path.exists(path) else None
    history = list(previous.get("history", [])) if previous else []
    if changes:
        history.append({"step": step, "time": time.time(), "changes": changes})
    os.makedirs(folder, exist_ok=True)
    write_text(path, json.dumps({**current, "history": history}, indent=2))
