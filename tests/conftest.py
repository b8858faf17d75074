import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]

# Without a GPU the Triton kernels run in Triton's interpreter; it is chosen when a
# kernel is decorated, so before anything imports kernels.triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import kernels.triton.launch as rt  # noqa: E402  (after TRITON_INTERPRET is set)
from mhar_titan.components.lifetime import descendants  # noqa: E402

# The files that take longest on two CPU cores (`pytest --durations=0`, docs/performance.md), longest first.
# `make test` runs `--dist loadfile --no-loadscope-reorder`: the workers take whole files in collection order,
# so starting with the longest leaves the short ones to fill the end (the suite takes as long as its slower
# worker); xdist's own reorder goes by the number of tests in a file, not by their time.
SLOWEST_FIRST = (
    "test_preflight.py",
    "test_train_resume.py",
    "test_cluster_run.py",
    "test_slurm_real.py",
    "test_preflight_verdicts.py",
    "test_checkpoint_s3.py",
    "test_s3_store_errors.py",
    "test_routing_triton.py",
    "test_float8.py",
    "test_train_mhar.py",
    "test_hook_extension.py",
    "test_watchdog.py",
    "test_recipe_train.py",
    "test_train_stages.py",
    "test_hf_distributed.py",
    "test_pair_demo.py",
    "test_preflight_exports.py",
    "test_routing_pair.py",
    "test_eval_watch.py",
    "test_mhar_compile.py",
    "test_data_mixture.py",
    "test_eval_suites.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The slowest files first, every other file after them in its usual order (a stable sort)."""
    gone = [name for name in SLOWEST_FIRST if not (REPO / "tests" / name).is_file()]
    if gone:
        raise pytest.UsageError(f"tests/conftest.py SLOWEST_FIRST names files that are not in tests/: {gone}")
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


@pytest.fixture
def own_signal_handlers():
    """PreemptionWatch takes over SIGTERM/SIGUSR1: give pytest's back afterwards."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


@pytest.fixture
def poisoned(monkeypatch):
    """Every buffer the routing kernels allocate starts as NaN, so an unwritten element shows."""
    monkeypatch.setattr(rt, "empty", lambda *a, **k: torch.full(*a, float("nan"), **k))
    monkeypatch.setattr(rt, "empty_like", lambda t: torch.full_like(t, float("nan")))


def torchrun(
    dump_folder: Path,
    *overrides: str,
    nproc: int = 2,
    config: str = "configs/tiny_cpu.toml",
    script: str = "train_cpt.py",
    env: dict[str, str] | None = None,
    check: bool = True,
    timeout: int = 600,
):
    """Run `script` (train_cpt.py) under torchrun (mhar_titan.launch) on `nproc` local processes; fail with its
    output."""
    cmd = [
        sys.executable,
        "-m",
        "mhar_titan.launch",  # torchrun keeping the trainer's exit codes, as launch/torchrun.sh runs it
        "--standalone",
        f"--nproc-per-node={nproc}",
        str(REPO / script),
        "--job.config_file",
        config,
        "--job.dump_folder",
        str(dump_folder),
        *overrides,
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return proc


def process_tree(pid: int) -> list[int]:
    """pid and its descendants, from /proc (torchrun starts each worker in a session of its own)."""
    return [pid, *descendants(pid)]
