"""What the preflight settles before it starts anything: the two configs form a pair, the base, the data, the
depth the GPUs hold and the room for checkpoints. Each problem is a ValueError of one line naming what to change
(the CLI prints it and exits 2), found before any training starts."""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path
from typing import Any

from torchtitan.config import JobConfig

from data.config import DataConfig
from data.mixture import parse_mixture
from data.shards import list_shards
from mhar_titan import plan
from mhar_titan.config import parse_config
from mhar_titan.hf.files import safetensors_header
from mhar_titan.hf.ledger import read_json
from mhar_titan.model.args import FLAVORS, HF_FLAVOR, MHARModelArgs, model_args_from_hf_config

GIB = 2**30
PAIR_KEYS = ("mhar.", "job.dump_folder", "job.description", "job.config_file")  # what may differ between the arms
MARGIN = 0.1  # the memory plan's default margin


@dataclasses.dataclass
class Base:
    """The weights both arms start from: the configs' own HF base, or a random one of its architecture."""

    path: str | None  # the configs' base, when used as it is
    random: bool
    reason: str  # for the report
    arch: str  # a flavor name or the base folder (hf init --flavor)
    args: MHARModelArgs  # the full-depth architecture
    tokenizer: str | None  # the folder whose tokenizer.json the random base gets


def load_arm(path: str, overrides: list[str]) -> JobConfig:
    if not os.path.isfile(path):
        raise ValueError(f"{path}: no such config file")
    try:
        with plan.quiet():  # torchtitan warns of a missing base folder: resolve_base says what that means here
            return parse_config(["--job.config_file", path, *overrides])
    except (ValueError, FileNotFoundError) as e:
        raise ValueError(f"{path}: {e}") from None
    except SystemExit as e:  # torchtitan's parser exits on an unknown option
        raise ValueError(f"{path}: the config or an override was refused by torchtitan's parser ({e})") from None


def _flat(obj: Any, prefix: str = "") -> dict[str, Any]:
    if dataclasses.is_dataclass(obj):
        out: dict[str, Any] = {}
        for f in dataclasses.fields(obj):
            out.update(_flat(getattr(obj, f.name), f"{prefix}{f.name}."))
        return out
    return {prefix[:-1]: obj}


def check_pair(control: JobConfig, mhar: JobConfig, paths: tuple[str, str]) -> None:
    """The arms differ in [mhar] alone (and their run names): otherwise the pair is not schedule-matched."""
    if control.mhar.enable or not mhar.mhar.enable:
        raise ValueError(
            f"{paths[0]} must have [mhar] enable = false and {paths[1]} enable = true "
            f"(they have {control.mhar.enable} and {mhar.mhar.enable}): CONTROL.toml first, then MHAR.toml"
        )
    a, b = _flat(control), _flat(mhar)
    differ = [k for k in sorted(a) if a[k] != b.get(k) and not k.startswith(PAIR_KEYS)]
    if differ:
        shown = "; ".join(f"{k}: {a[k]!r} vs {b.get(k)!r}" for k in differ[:4])
        raise ValueError(
            f"{paths[0]} and {paths[1]} differ outside [mhar] ({shown}{' ...' if len(differ) > 4 else ''}): "
            "the arms of a pair share every other setting; edit both files together"
        )


def _has_weights(folder: Path) -> bool:
    return any(folder.glob("*.safetensors"))


def resolve_base(
    cfg: JobConfig, config_path: str, explicit: bool, arch: str, random_base: bool, tokenizer: str
) -> Base:
    """The configs' base if it is there; a random base of the same architecture if it is not (the report says
    so). A base path given on the command line that is missing, or a folder that is not an HF checkpoint, is an
    error: a typo must not turn into a random base."""
    flavor, path = cfg.model.flavor, cfg.model.hf_assets_path
    folder = Path(path) if path else None
    own_tokenizer = str(folder) if folder and (folder / "tokenizer.json").is_file() else None
    if explicit and (folder is None or not folder.exists()):
        raise ValueError(
            f"--model.hf_assets_path {path}: no such folder; give the HF base's folder (config.json, "
            "*.safetensors, tokenizer.json), or leave the option out to preflight with a random base"
        )
    if flavor != HF_FLAVOR:  # a built-in architecture (the tiny CPU configs): no base of its own
        if flavor not in FLAVORS:
            raise ValueError(f"{config_path}: [model] flavor = {flavor!r}: expected one of {', '.join(FLAVORS)}")
        return Base(
            None,
            True,
            f"[model] flavor = {flavor!r} has no HF base",
            flavor,
            FLAVORS[flavor],
            own_tokenizer or tokenizer,
        )
    if folder is None or not folder.exists():
        if arch not in FLAVORS or arch == HF_FLAVOR:
            raise ValueError(f"--arch {arch!r}: expected one of {', '.join(f for f in FLAVORS if f != HF_FLAVOR)}")
        reason = (
            f"the configs' base {path} is not there: a random base of the {arch} architecture (--arch); "
            "the real run refuses to start until the base is downloaded there"
        )
        return Base(None, True, reason, arch, FLAVORS[arch], tokenizer)
    config = folder / "config.json"
    if not config.is_file() or not _has_weights(folder):
        missing = "config.json" if not config.is_file() else "*.safetensors"
        raise ValueError(
            f"[model] hf_assets_path = {path} (from {config_path}): not an HF checkpoint, it has no {missing}"
        )
    args = model_args_from_hf_config(read_json(str(config)), str(config))  # a field the model lacks: named
    for shard in sorted(folder.glob("*.safetensors")):  # a truncated or damaged shard: named, before anything runs
        safetensors_header(str(shard))
    if random_base:
        return Base(
            None, True, f"--random-base: a random base of {path}'s architecture", str(folder), args, str(folder)
        )
    return Base(str(folder), False, f"the configs' base {path}", str(folder), args, own_tokenizer)


def check_data(cfg: JobConfig, config_path: str, ranks: int) -> dict[str, int]:
    """Every source matches shards, enough for its streams: {source: shards}."""
    data: DataConfig = cfg.data
    counts = {}
    try:
        sources = parse_mixture(data)
    except ValueError as e:
        raise ValueError(f"{config_path}: {e}") from None
    for source in sources:
        try:
            shards = list_shards(list(source.paths), source.manifest)
        except (FileNotFoundError, OSError) as e:
            key = "mixture" if data.mixture else ("manifest" if data.manifest else "paths")
            raise ValueError(
                f"{config_path}: {e}; set [data] {key} to your parquet shards, or pass --data.{key} ... "
                "(python -m data.prepare makes shards from JSON lines, text or parquet)"
            ) from None
        if len(shards) < data.num_streams:
            raise ValueError(
                f"{config_path}: [data] source {source.name!r} has {len(shards)} shards, fewer than num_streams = "
                f"{data.num_streams}; write more shards (python -m data.prepare --shards N) or pass --data.num_streams"
            )
        counts[source.name] = len(shards)
    if data.num_streams % ranks:
        raise ValueError(f"{config_path}: [data] num_streams = {data.num_streams} is not a multiple of {ranks} ranks")
    return counts


def plan_cfg(arm: str, overrides: list[str], base: Base) -> JobConfig:
    """The arm's config as the memory plan should see it: the base's architecture at full depth."""
    arch = ["--model.flavor", base.arch] if base.arch in FLAVORS else ["--model.hf_assets_path", base.arch]
    return load_arm(arm, [*overrides, *arch])


def choose_depth(
    cfg: JobConfig, ranks: int, gpu_memory: float | None, layers: int | None, full: int
) -> tuple[int, dict[str, Any]]:
    """The depth the pair trains at: the full depth if both arms fit in the configs' activation-checkpointing
    mode, else `layers` or one layer a block (every routing source count kept). A GPU that holds no cut: error."""
    mode = cfg.activation_checkpoint.mode
    blocks = cfg.mhar.num_blocks
    if layers is not None and (layers < 1 or layers > full or layers % blocks):
        raise ValueError(f"--layers {layers}: must be a multiple of [mhar] num_blocks = {blocks}, at most {full}")
    if gpu_memory is None:  # CPU ranks: no memory plan
        return layers or full, {"mode": mode, "planned": False}
    deepest, peaks = plan.deepest_fit(cfg, ranks, gpu_memory, MARGIN, mode)
    info = {"mode": mode, "planned": True, "deepest": deepest, "peaks_at_deepest": peaks}
    if deepest is None:
        fits = [m for m in plan.MODES if plan.deepest_fit(cfg, ranks, gpu_memory, MARGIN, m)[0] is not None]
        hint = f"set --activation_checkpoint.mode {fits[0]} in both configs" if fits else "use more or larger GPUs"
        raise ValueError(
            f"a GPU of {gpu_memory / GIB:.1f} GiB is too small for the configs: at {peaks['layers']} layers (the "
            f"shallowest cut) the control and MHAR arms need {peaks['control']:.1f} and {peaks['mhar']:.1f} GiB in "
            f"activation_checkpoint mode {mode!r}, over the {peaks['budget_gib']:.1f} GiB budget; {hint}, or lower "
            "--training.local_batch_size"
        )
    if deepest >= full:
        return full, info
    chosen = layers or blocks
    if chosen > deepest:
        raise ValueError(f"--layers {chosen}: the plan fits at most {deepest} layers on these GPUs")
    return chosen, info


def check_room(folder: Path, needed: float, what: str, option: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(folder).free
    if free < needed:
        raise ValueError(
            f"{folder}: {free / GIB:.1f} GiB free, the preflight's {what} need about {needed / GIB:.1f} GiB; "
            f"pass {option} on a larger file system"
        )
