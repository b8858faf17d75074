"""The project's config sections, merged into torchtitan's JobConfig.

`train_cpt.py` passes `--job.custom_config_module=mhar_titan.config` unless the
command line names another module, so every job has these sections.
"""

import importlib.util
import re
from dataclasses import dataclass, field, fields

import fsspec
from torchtitan.config import ConfigManager
from torchtitan.config import JobConfig as TitanJobConfig

from data.config import DataConfig
from data.loader import check_stages
from mhar_titan.components import fingerprint
from mhar_titan.components.alerts import EVENTS as ALERT_EVENTS
from mhar_titan.config_check import check_config_file
from mhar_titan.model.args import MHAR

MODEL_NAME = "llama3_mhar"
CONFIG_MODULE = "mhar_titan.config"
_CONFIG_MODULE_FLAGS = ("--job.custom_config_module", "--job.custom-config-module")
ATTENTION_MASKS = ("causal", "block_causal")
FLOAT8 = "quantize.linear.float8"  # the one model converter tested with both arms (docs/memory.md, "float8")


@dataclass
class Job:
    """Additions to torchtitan's `[job]`: one job per run folder (mhar_titan/components/run_lock.py)."""

    run_lock_stale_s: float = 300.0
    """A run lock (<dump_folder>/run.lock) whose heartbeat is older than this many seconds belongs to a job
    that is gone (a killed job on another host) and is taken over; a live job refreshes it every tenth."""
    run_lock_wait_s: float = 900.0
    """A requeued SLURM job whose earlier run still holds the lock (still writing its last checkpoint) waits
    this many seconds for it; any other job on a locked folder is refused at once."""
    max_restarts: int = 3
    """A crashed or hung job is started again from its last checkpoint at most this many times within
    restart_window_minutes (launch/torchrun.sh relaunches it, launch/slurm.sbatch requeues it; 0: never)."""
    restart_window_minutes: float = 60.0
    """The window max_restarts counts in."""
    restart_backoff_s: float = 30.0
    """The wait before a restart, doubled for each restart already in the window."""


@dataclass
class Model:
    """Additions to torchtitan's `[model]`."""

    attention_mask: str = "causal"
    """causal: each token attends to every token before it in its packed window, across document boundaries
    (as torchtitan's sdpa does); block_causal: only to those of its own document (documents end with the
    tokenizer's eos): flex attention on GPUs, the same mask as an explicit sdpa mask on CPU ranks. Part of the
    architecture in the run's fingerprint: both arms of a pair use the same."""


@dataclass
class Optimizer:
    """Additions to torchtitan's `[optimizer]`."""

    weight_decay_output: bool = True
    """Decay the output projection (embeddings, norms, biases and routing never decay)."""


@dataclass
class Loss:
    """`[loss]`: the training objective."""

    z_loss: float = 1e-4
    """Coefficient of the z-loss, mean over valid tokens of logsumexp(logits)^2 (0: plain CE)."""


@dataclass
class EMA:
    """`[ema]`: an fp32 weight EMA, sharded like the parameters, checkpointed, validated and exportable."""

    enable: bool = True
    """Keep the EMA (false: none is kept, checkpointed or validated; val/ce_ema is not logged)."""
    beta: float = 0.999
    """ema <- beta * ema + (1 - beta) * weights after every applied optimizer step."""
    every: int = 1
    """Update only at steps that are multiples of this, with beta**every: the same horizon at 1/every
    of the cost (each update is an fp32 read-modify-write of every weight shard; its share of an 8B
    step is in docs/performance.md). Between updates the EMA lags the weights by fewer than `every`
    steps; keep validation and checkpoint intervals multiples of it."""


@dataclass
class Training:
    """Additions to torchtitan's `[training]`."""

    max_bad_steps: int = 5
    """Steps with a non-finite loss or gradient norm are skipped; this many in a row stop the run."""


@dataclass
class Checkpoint:
    """Additions to torchtitan's `[checkpoint]`."""

    keep_every: int = 0
    """Besides the last keep_latest_k, keep every checkpoint whose step is a multiple of this (0: none)."""
    interval_minutes: float = 0.0
    """Minutes between temporary checkpoints beside the step interval (0: none): a crash loses at most this much
    work. Only the newest temporary one is kept, until a newer checkpoint is complete; keep_latest_k counts the
    interval's checkpoints alone. Rank 0's clock decides for every rank; nothing computed changes."""
    allow_changes: list[str] = field(default_factory=list)
    """Fingerprint groups a resume may change on purpose: base, data, schedule (applied from the first
    resumed step, logged and recorded in fingerprint.json), or legacy (resume a run folder that has
    checkpoints but no fingerprint.json; its architecture is still checked where model_args.json has it).
    Empty: a resume whose settings differ from the run's is refused."""


@dataclass
class Validation:
    """Additions to torchtitan's `[validation]`."""

    at_start: bool = True
    """A run that starts at step 0 (not a resume) validates the loaded base once before its first update:
    val/ce and val/ce_ema at step 0, the reference for each arm's change in the comparison."""


@dataclass
class Spikes:
    """`[spikes]`: loss and gradient-norm spikes scored as they happen (mhar_titan/components/run_spikes.py)."""

    enable: bool = True
    """Score every step's loss and gradient norm (and any value a hook names in its `spike_scored`)."""
    window: int = 100
    """Each step is scored against the median and MAD of this many steps before it."""
    min_history: int = 20
    """No step is scored before the window holds this many values."""
    threshold: float = 6.0
    """A step whose (value - median) / (1.4826 x MAD) exceeds this is a spike."""
    keep_checkpoint_before: bool = False
    """Keep out of retention (keep_latest_k) the newest complete checkpoint from before the first update that can
    carry each spike (at step s: s - 2 or earlier; step s - 1 updated the weights that spiked), to go back to."""


@dataclass
class Norms:
    """`[norms]`: per-layer weight, gradient and update norms in TensorBoard (mhar_titan/components/param_norms.py)."""

    freq: int = 50
    """At step 1 and every this many steps (0: none); each such step reads its norms back once, after its update."""


@dataclass
class Stragglers:
    """`[stragglers]`: each rank's time at every log step; a rank much slower than the others warned once
    (mhar_titan/components/rank_timing.py)."""

    share: float = 0.1
    """A rank whose data + compute time a step is above the median of the ranks by more than this share straggles."""
    windows: int = 3
    """Warned (once, with its host) after straggling in this many log windows in a row."""


@dataclass
class Watchdog:
    """`[watchdog]`: a job that makes no progress is ended as hung (exit 124) with every rank's stacks written to
    <dump_folder>/hangs (mhar_titan/components/watchdog.py), instead of holding its allocation to the time limit."""

    enable: bool = True
    """Watch every rank from its first step on."""
    floor_s: float = 600.0
    """The shortest timeout: longer than anything between two steps (a validation, a checkpoint write)."""
    factor: float = 20.0
    """The timeout is this many times the median of the recent steps' time, when that is longer than floor_s."""
    first_step_s: float = 1800.0
    """The timeout until the first step is done (compilation, the first collectives)."""


@dataclass
class Alerts:
    """`[alerts]`: a JSON POST in Slack's form ({"text": ...}) to a webhook on the events named
    (mhar_titan/components/alerts.py); rank 0 posts from a thread, training never waits, a failure is logged."""

    webhook: str = ""
    """The webhook's URL (empty: no alerts), e.g. a Slack incoming webhook."""
    events: list[str] = field(
        default_factory=lambda: ["crash", "hang", "spike", "finish", "restart", "restarts_exhausted"]
    )
    """Which events post: crash, hang, spike, finish, restart, restarts_exhausted."""


@dataclass
class JobConfig:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    mhar: MHAR = field(default_factory=MHAR)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: Optimizer = field(default_factory=Optimizer)
    loss: Loss = field(default_factory=Loss)
    ema: EMA = field(default_factory=EMA)
    training: Training = field(default_factory=Training)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    validation: Validation = field(default_factory=Validation)
    spikes: Spikes = field(default_factory=Spikes)
    norms: Norms = field(default_factory=Norms)
    stragglers: Stragglers = field(default_factory=Stragglers)
    watchdog: Watchdog = field(default_factory=Watchdog)
    alerts: Alerts = field(default_factory=Alerts)


def parse_config(argv: list[str]) -> TitanJobConfig:
    """torchtitan's TOML + CLI parsing, with this project's config sections merged in."""
    module_by_default = not any(arg.split("=", 1)[0] in _CONFIG_MODULE_FLAGS for arg in argv)
    if module_by_default:
        argv = [*argv, f"--job.custom_config_module={CONFIG_MODULE}"]
    manager = ConfigManager()
    check_config_file(argv, manager, module_by_default)  # first: tyro keeps a mistyped TOML value, with a warning
    config = manager.parse_args(argv)
    if config.model.name != MODEL_NAME:
        raise ValueError(f"[model] name = {config.model.name!r}: train_cpt.py trains {MODEL_NAME!r}")
    if not config.training.max_norm > 0:  # clipping to 0 zeroes every gradient: a run that does not train
        raise ValueError(f"[training] max_norm = {config.training.max_norm} must be > 0 (inf: no clipping)")
    check_converters(config.model.converters)
    check_local_folders(config)
    if config.model.attention_mask not in ATTENTION_MASKS:
        raise ValueError(
            f"[model] attention_mask = {config.model.attention_mask!r} must be one of {', '.join(ATTENTION_MASKS)}"
        )
    check_spikes(config.spikes)
    check_watchdog(config.watchdog)
    job = config.job
    if not (job.max_restarts >= 0 and job.restart_window_minutes > 0 and job.restart_backoff_s >= 0):
        raise ValueError(
            f"[job] max_restarts = {job.max_restarts}, restart_window_minutes = {job.restart_window_minutes}, "
            f"restart_backoff_s = {job.restart_backoff_s}: need max_restarts >= 0 (0: never), a window > 0 and a "
            "backoff >= 0"
        )
    unknown = sorted(set(config.alerts.events) - set(ALERT_EVENTS))
    if unknown:
        raise ValueError(f"[alerts] events: {', '.join(unknown)} unknown; known: {', '.join(ALERT_EVENTS)}")
    check_unused_validation_loader(config)
    check_stages(config)
    fingerprint.check_allow(config.checkpoint.allow_changes)  # at every start: a typo is seen at once
    if config.checkpoint.last_save_in_hf:
        # torchtitan's writer keys shards by the base's index (no routing tensors: the MHAR arm fails at its
        # last step) and writes no config.json or tokenizer files (the control's folder is not loadable).
        raise ValueError(
            "[checkpoint] last_save_in_hf is not supported: it would write safetensors without config.json, "
            "tokenizer files or (MHAR arm) the routing tensors. Keep the last checkpoint and export it: "
            "python -m mhar_titan.hf export RUN_DIR OUT_DIR [--ema] [--dtype bf16]"
        )
    return config


def check_local_folders(config: TitanJobConfig) -> None:
    """The run folder must be a file system path (os.makedirs would make a folder named `s3:`); checkpoints may be
    kept on a store (components/checkpoint/remote.py), whose fsspec backend must be installed."""
    folders = (("[job] dump_folder", config.job.dump_folder), ("[checkpoint] folder", config.checkpoint.folder))
    for key, value in folders:
        if "://" not in value and re.match(r"[A-Za-z][A-Za-z0-9+.-]+:", value):  # `s3:/bucket`: a folder named `s3:`
            raise ValueError(
                f"{key} = {value!r}: reads as a URL without its `://` (s3://bucket/...); a local path "
                "must not begin with `name:`"
            )
    if "://" in config.job.dump_folder:
        raise ValueError(
            f"[job] dump_folder = {config.job.dump_folder!r} is a URL: the run folder (the run lock, logs, records, "
            "each checkpoint as it is written) must be a local or shared file system path; keep the checkpoints on "
            "the store with [checkpoint] folder = 's3://...'"
        )
    folder = config.checkpoint.folder
    if "://" in folder:
        protocol = folder.split("://", 1)[0]
        try:
            fsspec.get_filesystem_class(protocol)
        except (ImportError, ValueError) as e:
            raise ValueError(
                f"[checkpoint] folder = {folder!r}: no filesystem for {protocol}:// ({e}); "
                "for S3: pip install -e '.[s3]'"
            ) from None


def check_unused_validation_loader(config: TitanJobConfig) -> None:
    """Validation reads its windows in the training process (data/loader.py ValidationLoader): a
    `[validation.dataloader]` setting would change nothing, so it is refused rather than ignored."""
    default = type(config.validation.dataloader)()
    changed = [
        f"{f.name} = {getattr(config.validation.dataloader, f.name)!r}"
        for f in fields(default)
        if getattr(config.validation.dataloader, f.name) != getattr(default, f.name)
    ]
    if changed:
        raise ValueError(
            f"[validation.dataloader] {', '.join(changed)}: validation reads its windows in the training process, "
            "without loader workers; remove the setting ([training.dataloader] sets the training loader's)"
        )


def check_spikes(spikes: Spikes) -> None:
    if not (spikes.window >= spikes.min_history >= 3 and spikes.threshold > 0):
        raise ValueError(
            f"[spikes] window = {spikes.window}, min_history = {spikes.min_history}, threshold = {spikes.threshold}: "
            "need window >= min_history >= 3 and threshold > 0"
        )


def check_watchdog(watchdog: Watchdog) -> None:
    if not (watchdog.floor_s > 0 and watchdog.factor > 0 and watchdog.first_step_s > 0):
        raise ValueError(
            f"[watchdog] floor_s = {watchdog.floor_s}, factor = {watchdog.factor}, first_step_s = "
            f"{watchdog.first_step_s}: each must be > 0 (enable = false turns the watchdog off)"
        )


def check_converters(converters: list[str]) -> None:
    """`[model] converters`: torchtitan's float8 linear layers only (with torchao installed), before any work."""
    others = [c for c in converters if c != FLOAT8]
    if others:
        raise ValueError(
            f"[model] converters = {converters}: {', '.join(others)} not supported (tested with both arms: {FLOAT8})"
        )
    if converters and importlib.util.find_spec("torchao") is None:
        raise ValueError(
            f"[model] converters = {converters} needs torchao, which is not installed: pip install -e '.[float8]'"
        )
