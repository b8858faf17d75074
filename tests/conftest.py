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
    """Run `script` (train_cpt.py) under torchrun on `nproc` local processes; fail with its output."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
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
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo.extend(children.get(p, []))
    return tree
