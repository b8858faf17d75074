"""Workers die with their torchrun agent (mhar_titan/components/lifetime.py): a parent-death SIGKILL, armed first
thing in train_cpt.py, and an orphan that missed it exits at once. Linux only (prctl)."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import REPO, process_tree

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")

# Loads lifetime.py by path, as train_cpt.py does: without the package's multi-second import.
LIFETIME = REPO / "mhar_titan" / "components" / "lifetime.py"
LOAD = textwrap.dedent(f"""
    import importlib.util, os, sys, time
    spec = importlib.util.spec_from_file_location("lifetime", {str(LIFETIME)!r})
    lifetime = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lifetime)
""")
DEATH_WAIT_S = 15.0


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, start time) of a process, None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0], int(fields[19])


def alive(procs: dict[int, int]) -> list[int]:
    """The processes of {pid: start time} still running (a zombie or a reused pid counts as dead)."""
    return [p for p, start in procs.items() if (s := _stat(p)) is not None and s[0] != "Z" and s[1] == start]


def wait_until_dead(procs: dict[int, int]) -> list[int]:
    """Poll /proc for up to DEATH_WAIT_S seconds; the processes still alive then."""
    deadline = time.monotonic() + DEATH_WAIT_S
    while (left := alive(procs)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def kill_all(pids) -> None:
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def snapshot(pid: int) -> dict[int, int]:
    return {p: s[1] for p in process_tree(pid) if (s := _stat(p)) is not None}


def test_child_gets_sigkill_when_its_parent_is_killed():
    # parent -> child; the child arms the signal and reports; SIGKILL the parent: the child must go.
    child = LOAD + "print(lifetime.die_with_parent(os.getppid()), lifetime.parent_death_signal(), flush=True)\n"
    child += "time.sleep(120)\n"
    parent = f"import subprocess, sys, time\nsubprocess.Popen([sys.executable, '-c', {child!r}])\ntime.sleep(120)\n"
    proc = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().split() == ["True", str(int(signal.SIGKILL))]
        procs = snapshot(proc.pid)
        assert len(procs) == 2
        proc.kill()
        proc.wait()
        assert wait_until_dead(procs) == []
    finally:
        kill_all(process_tree(proc.pid))
        proc.wait()


def test_worker_whose_parent_died_before_arming_exits_at_once(tmp_path):
    # The fork race: the parent dies after the worker read its pid but before the signal is armed.
    log = tmp_path / "orphan.log"
    orphan = (
        "_parent = __import__('os').getppid()\nprint('ready', flush=True)\n"
        + LOAD
        + "for _ in range(600):\n    if os.getppid() != _parent: break\n    time.sleep(0.05)\n"
        + "lifetime.die_with_parent(_parent)\nprint('still running after die_with_parent', file=sys.stderr)\n"
    )
    # The middle process exits once the orphan has read its parent's pid: the orphan is reparented.
    middle = "import subprocess, sys\n"
    middle += f"p = subprocess.Popen([sys.executable, '-c', {orphan!r}], stdout=subprocess.PIPE,"
    middle += f" stderr=open({str(log)!r}, 'w'))\n"
    middle += "assert p.stdout.readline() == b'ready\\n'\n"
    subprocess.run([sys.executable, "-c", middle], check=True, timeout=60)
    deadline = time.monotonic() + DEATH_WAIT_S
    while "exiting before training" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.1)
    text = log.read_text()
    assert "is gone (parent now pid" in text and "exiting before training" in text
    assert "still running" not in text


def test_launcher_process_group_sigkill_takes_the_workers_with_it(tmp_path):
    # As a scheduler ends a job: SIGKILL to the launcher's process group, once training runs.
    cmd = [str(REPO / "launch" / "torchrun.sh"), "--nproc", "2", "configs/tiny_cpu.toml"]
    cmd += ["--job.dump_folder", str(tmp_path / "run"), "--training.steps", "50", "--validation.no-enable"]
    env = {**os.environ, "PYTHON": sys.executable, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    procs: dict[int, int] = {}
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if "step 1/" in line:
                break
        else:
            pytest.fail(f"training never started:\n{''.join(lines)[-4000:]}")
        procs = snapshot(proc.pid)
        workers = [p for p in procs if "train_cpt.py" in Path(f"/proc/{p}/cmdline").read_text()]
        assert len(workers) >= 2, f"expected 2 workers in the tree {procs}"
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        left = wait_until_dead(procs)
        assert left == [], f"still running {DEATH_WAIT_S} s after the launcher's group was killed: {left}"
    finally:
        kill_all(list(alive(procs)) + process_tree(proc.pid))
        proc.wait()
        proc.stdout.close()
