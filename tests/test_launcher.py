"""The launchers: launch/torchrun.sh, launch/slurm.sbatch and launch/pair.sh, without real training.

Dry runs check the exact commands; a fake interpreter (PYTHON=...) stands in for torchrun to check
the preemption protocol: a signal becomes <dump_folder>/STOP, and a new preempted.json becomes exit 75.
"""

import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time

import pytest
from conftest import REPO
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from mhar_titan import launch

SCRIPT = str(REPO / "launch" / "torchrun.sh")
SBATCH = str(REPO / "launch" / "slurm.sbatch")
PAIR = str(REPO / "launch" / "pair.sh")
CONTROL, MHAR = "configs/tiny_cpu.toml", "configs/tiny_cpu_mhar.toml"

# Stands in for python: `-m mhar_titan.launch ... --job.dump_folder D ...` acts as the launcher
# would under the trainer (FAKE_MODE: wait_stop, preempt, exit0, exit3, exit66); anything else goes to
# the real interpreter.
FAKE_PYTHON = f"""#!/usr/bin/env bash
set -euo pipefail
if [[ "${{1:-}}" != -m || "${{2:-}}" != mhar_titan.launch ]]; then
  exec {shlex.quote(sys.executable)} "$@"
fi
dump="" prev=""
for a in "$@"; do [[ "$prev" != --job.dump_folder ]] || dump="$a"; prev="$a"; done
mkdir -p "$dump"
touch "$dump/launched"
env | grep '^WANDB_' | sort > "$dump/wandb_env" || true
printf '%s\n' "${{MHAR_LAUNCH_ID:-}}" > "$dump/launch_id"
case "$FAKE_MODE" in
  wait_stop)
    for _ in $(seq 400); do [[ -f "$dump/STOP" ]] && break; sleep 0.05; done
    [[ -f "$dump/STOP" ]] || exit 9
    echo '{{"step": 3, "reason": "stop file"}}' > "$dump/preempted.json"
    exit 1 ;;
  preempt) echo '{{"step": 1, "reason": "SIGTERM"}}' > "$dump/preempted.json"; exit 1 ;;
  exit0) exit 0 ;;
  exit3) exit 3 ;;
  exit66) exit 66 ;;
esac
exit 8
"""


def run(*cmd: str, env: dict[str, str] | None = None, check: bool = True) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHON": sys.executable, **(env or {})}
    return subprocess.run(list(cmd), cwd=REPO, env=full_env, capture_output=True, text=True, check=check)


def launch_fake(dump, fake_python: str, mode: str) -> subprocess.CompletedProcess:
    """launch/torchrun.sh on one process of the fake trainer in `mode`, its exit code unchecked."""
    env = {"PYTHON": fake_python, "FAKE_MODE": mode}
    return run(SCRIPT, "--nproc", "1", CONTROL, "--job.dump_folder", str(dump), env=env, check=False)


@pytest.fixture
def fake_python(tmp_path):
    path = tmp_path / "python"
    path.write_text(FAKE_PYTHON)
    path.chmod(0o755)
    return str(path)


# --- launch/torchrun.sh ------------------------------------------------------------------------


def test_dry_run_prints_the_torchrun_command():
    out = subprocess.run(
        [SCRIPT, "--dry-run", "--nproc", "3", "configs/tiny_cpu.toml", "--training.steps", "5"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert out[1:3] == ["-m", "mhar_titan.launch"]
    assert "--nproc-per-node=3" in out
    assert out[-5:] == [str(REPO / "train_cpt.py"), "--job.config_file", "configs/tiny_cpu.toml"] + [
        "--training.steps",
        "5",
    ]


def _tools_without_python(tmp_path) -> str:
    """A PATH directory with the tools the launcher uses and no python: a clean login shell's view."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "dirname", "sed", "cat", "mkdir", "rm", "sleep", "date", "wc", "cksum"):
        found = shutil.which(tool)
        if found:
            (bin_dir / tool).symlink_to(found)
    return str(bin_dir)


def test_without_python_on_path_the_launcher_finds_the_venv_or_says_what_to_set(tmp_path):
    tree = tmp_path / "repo"
    (tree / "launch").mkdir(parents=True)
    shutil.copy(SCRIPT, tree / "launch" / "torchrun.sh")
    shutil.copy(REPO / CONTROL, tree / "control.toml")
    env = {k: v for k, v in os.environ.items() if k != "PYTHON"} | {"PATH": _tools_without_python(tmp_path)}
    cmd = [str(tree / "launch" / "torchrun.sh"), "--dry-run", "--nproc", "1", "control.toml"]
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    assert proc.returncode == 2
    assert "no Python" in proc.stderr and "set PYTHON=/path/to/python" in proc.stderr and "make install" in proc.stderr
    (tree / ".venv" / "bin").mkdir(parents=True)
    (tree / ".venv" / "bin" / "python").symlink_to(sys.executable)
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[0] == str(tree / ".venv" / "bin" / "python")  # and it read the TOML with it
    assert "# dump_folder: runs/tiny/control" in proc.stderr


def test_missing_config_is_refused_by_name():
    proc = subprocess.run([SCRIPT, "configs/nope.toml"], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 2
    assert "configs/nope.toml" in proc.stderr


def test_multi_node_dry_run_uses_c10d():
    proc = run(
        SCRIPT, "--dry-run", "--nnodes", "2", "--rdzv-endpoint", "h:1234", "--rdzv-id", "7", "--nproc", "4", CONTROL
    )
    out = proc.stdout.split()
    assert len(proc.stdout.strip().splitlines()) == 1
    assert "--standalone" not in out
    for arg in ["--rdzv-backend=c10d", "--rdzv-endpoint=h:1234", "--rdzv-id=7", "--nnodes=2", "--nproc-per-node=4"]:
        assert arg in out
    assert "# dump_folder: runs/tiny/control" in proc.stderr


def test_multi_node_without_endpoint_is_refused():
    proc = run(SCRIPT, "--dry-run", "--nnodes", "2", CONTROL, check=False)
    assert proc.returncode == 2
    assert "--rdzv-endpoint" in proc.stderr


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ([], "runs/tiny/control"),
        (["--job.dump_folder", "a/b", "--training.steps", "3"], "a/b"),
        (["--job.dump_folder=c/d"], "c/d"),
    ],
)
def test_dump_folder_from_overrides_then_toml(overrides, expected):
    assert run(SCRIPT, "--print-dump-folder", CONTROL, *overrides).stdout == expected + "\n"


def test_dump_folder_defaults_to_torchtitan_outputs(tmp_path):
    config = tmp_path / "bare.toml"
    config.write_text("[training]\nsteps = 1\n")
    assert run(SCRIPT, "--print-dump-folder", str(config)).stdout == "./outputs\n"


def signal_once_launched(cmd: list[str], env: dict[str, str], dump, sig) -> tuple[subprocess.Popen, str]:
    """Start `cmd`, send `sig` once the fake torchrun has started, and return the process and its stderr."""
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 10
        while not (dump / "launched").exists():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the fake torchrun never started"
            time.sleep(0.02)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=20)
    finally:
        proc.kill()
    return proc, err


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1], ids=["TERM", "USR1"])
def test_signal_becomes_stop_file_and_exit_75(tmp_path, fake_python, sig):
    dump = tmp_path / "run"
    env = {**os.environ, "PYTHON": fake_python, "FAKE_MODE": "wait_stop"}
    cmd = [SCRIPT, "--nproc", "1", CONTROL, "--job.dump_folder", str(dump)]
    proc, err = signal_once_launched(cmd, env, dump, sig)
    launch_id = (dump / "launch_id").read_text().strip()
    assert launch_id and (dump / "STOP").read_text() == launch_id + "\n"  # the trainer obeys it, even before it starts
    assert (dump / "preempted.json").exists()
    assert proc.returncode == 75, err
    assert f"got SIG{sig.name[3:]}" in err


@pytest.mark.parametrize(("mode", "code"), [("exit0", 0), ("exit3", 3), ("exit66", 66)])
def test_stale_marker_does_not_count(tmp_path, fake_python, mode, code):
    dump = tmp_path / "run"
    dump.mkdir()
    stale = dump / "preempted.json"
    stale.write_text('{"step": 1, "reason": "an older job"}')
    (dump / "STOP").touch()  # left by a run killed before its trainer saw it
    old = time.time() - 3600
    os.utime(stale, (old, old))
    proc = launch_fake(dump, fake_python, mode)
    assert proc.returncode == code, proc.stderr
    assert (dump / "launched").exists()
    # left for the trainer, which judges it by the launch id written in it once it holds the run lock: a
    # launcher that removed it could cancel the stop of a live job in the same folder
    assert (dump / "STOP").exists()


def test_new_marker_without_signal_exits_75(tmp_path, fake_python):
    dump = tmp_path / "run"
    proc = launch_fake(dump, fake_python, "preempt")
    assert proc.returncode == 75, proc.stderr


# --- launch/slurm.sbatch -----------------------------------------------------------------------


@pytest.fixture
def fake_slurm(tmp_path):
    """A fake 2-node allocation: SLURM_* variables, and `scontrol` (show hostnames; requeue is logged
    to tmp_path/requeued) and `srun` (runs its command once, here) first on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scripts = {
        "scontrol": f"""#!/usr/bin/env bash
case "$1" in
  show)
    if [[ "$2" == job ]]; then echo "JobId=$3 TimeLimit=${{FAKE_TIME_LIMIT:-UNLIMITED}}"
    else printf "gpu07\\ngpu08\\n"; fi ;;
  requeue) echo "$2" >> {tmp_path}/requeued ;;
  *) exit 1 ;;
esac
""",
        "srun": """#!/usr/bin/env bash
while [[ "$1" == --* ]]; do shift; done
exec "$@"
""",
    }
    for name, text in scripts.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k not in ("MASTER_PORT", "DRY_RUN")}
    env.update(
        PATH=f"{bin_dir}:{os.environ['PATH']}",
        PYTHON=sys.executable,
        SLURM_JOB_ID="4242",
        SLURM_NNODES="2",
        SLURM_JOB_NODELIST="gpu[07-08]",
        SLURM_GPUS_ON_NODE="8",
        MARKER_WAIT_S="0",  # no shared file system to wait for
    )
    return env


def test_sbatch_header_requeues_on_a_warning_signal():
    header = [line.split()[1] for line in open(SBATCH) if line.startswith("#SBATCH")]
    assert "--requeue" in header
    assert any(opt.startswith("--signal=B:USR1@") for opt in header)
    assert "--nodes=1" in header and "--ntasks-per-node=1" in header and "--open-mode=append" in header


@pytest.mark.parametrize("how", ["arg", "env"])
def test_sbatch_dry_run_under_a_fake_allocation(fake_slurm, how):
    args = [SBATCH, "--dry-run"] if how == "arg" else [SBATCH]
    env = fake_slurm if how == "arg" else {**fake_slurm, "DRY_RUN": "1"}
    proc = subprocess.run(
        [*args, CONTROL, "--training.steps", "3"], cwd=REPO, env=env, capture_output=True, text=True, check=True
    )
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1
    out = lines[0].split()
    assert out[:3] == ["srun", "--kill-on-bad-exit=1", "--ntasks-per-node=1"]
    i = out.index("launch/torchrun.sh")
    assert out[i:] == [
        "launch/torchrun.sh",
        "--nnodes",
        "2",
        "--rdzv-endpoint",
        "gpu07:24242",
        "--rdzv-id",
        "4242",
        "--launch-id",
        "slurm-4242-0",  # this run of the job: a requeued run has another SLURM_RESTART_COUNT
        "--nproc",
        "8",
        CONTROL,
        "--training.steps",
        "3",
    ]
    # torchrun.sh turns that into a c10d rendezvous
    inner_run = run(SCRIPT, "--dry-run", *out[i + 1 :])
    inner = inner_run.stdout.split()
    assert "# launch id: slurm-4242-0" in inner_run.stderr  # what the workers get as MHAR_LAUNCH_ID
    assert "--rdzv-backend=c10d" in inner and "--standalone" not in inner
    assert "--rdzv-endpoint=gpu07:24242" in inner and "--nnodes=2" in inner and "--nproc-per-node=8" in inner
    assert "scontrol requeue 4242" in proc.stderr
    assert "runs/tiny/control/STOP" in proc.stderr


def sbatch_dry_run(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([SBATCH, "--dry-run", *args], cwd=REPO, env=env, capture_output=True, text=True)


def test_sbatch_runs_on_the_gpus_and_cpus_a_node_gave_or_on_cpu_ranks(fake_slurm):
    def torchrun_args(env, *args):
        proc = sbatch_dry_run(env, *args, CONTROL)
        assert proc.returncode == 0, proc.stderr
        out = proc.stdout.split()
        return out[: out.index("launch/torchrun.sh")], out[out.index("--nproc") + 1]

    # every CPU of the (exclusive) node to the one task, shared by its ranks
    srun, nproc = torchrun_args({**fake_slurm, "SLURM_GPUS_ON_NODE": "4", "SLURM_CPUS_ON_NODE": "96"})
    assert "--cpus-per-task=96" in srun and nproc == "4"
    cpu = {**fake_slurm, "SLURM_GPUS_ON_NODE": "0", "SLURM_CPUS_ON_NODE": "2"}  # sbatch --gpus-per-node=0
    assert torchrun_args(cpu) == (["srun", "--kill-on-bad-exit=1", "--ntasks-per-node=1", "--cpus-per-task=2"], "2")
    assert torchrun_args(cpu, "--nproc", "3")[1] == "3"
    gpus = {**fake_slurm, "SLURM_GPUS_ON_NODE": "8"}
    refused = sbatch_dry_run(gpus, "--nproc", "4", CONTROL)
    assert refused.returncode == 2 and refused.stderr.strip().splitlines() == [
        "launch/slurm.sbatch: --nproc 4: the job has 8 GPUs a node, one rank each (ask for --gpus-per-node=4 instead)"
    ]


@pytest.mark.parametrize(("limit", "refused"), [("00:10:00", True), ("00:10:01", False), ("1-00:00:00", False)])
def test_sbatch_refuses_a_time_limit_that_leaves_no_time_to_train(fake_slurm, limit, refused):
    proc = sbatch_dry_run({**fake_slurm, "FAKE_TIME_LIMIT": limit}, CONTROL)
    if refused:
        assert proc.returncode == 2 and proc.stdout == ""
        assert proc.stderr.strip().splitlines() == [
            "launch/slurm.sbatch: the time limit 00:10:00 leaves under 300 s to train before the warning 300 s ahead "
            "of it; ask for more than 600 s (sbatch --time), or it would train a step and requeue over and over"
        ]
    else:
        assert proc.returncode == 0, proc.stderr


def test_sbatch_port_from_master_port(fake_slurm):
    proc = subprocess.run(
        [SBATCH, "--dry-run", CONTROL],
        cwd=REPO,
        env={**fake_slurm, "MASTER_PORT": "29500"},
        capture_output=True,
        text=True,
        check=True,
    )
    assert "gpu07:29500" in proc.stdout.split()


def test_sbatch_refuses_outside_slurm_and_missing_config(fake_slurm):
    no_job = {k: v for k, v in fake_slurm.items() if k != "SLURM_JOB_ID"}
    proc = subprocess.run([SBATCH, "--dry-run", CONTROL], cwd=REPO, env=no_job, capture_output=True, text=True)
    assert proc.returncode == 2 and "SLURM_JOB_ID" in proc.stderr
    proc = subprocess.run(
        [SBATCH, "--dry-run", "configs/nope.toml"], cwd=REPO, env=fake_slurm, capture_output=True, text=True
    )
    assert proc.returncode == 2 and "configs/nope.toml" in proc.stderr


# --- launch/pair.sh ----------------------------------------------------------------------------


def test_pair_dry_run_prints_both_arms():
    proc = run(PAIR, "--dry-run", "NAME", CONTROL, MHAR, "--training.steps", "3")
    lines = [line.split() for line in proc.stdout.strip().splitlines()]
    assert lines == [
        ["launch/torchrun.sh", CONTROL, "--job.dump_folder", "runs/NAME/control", "--training.steps", "3"],
        ["launch/torchrun.sh", MHAR, "--job.dump_folder", "runs/NAME/mhar", "--training.steps", "3"],
    ]
    assert "tensorboard --logdir runs/NAME" in proc.stderr
    assert "python -m mhar_titan.compare runs/NAME" in proc.stderr


def test_pair_replicate_adds_a_second_control_with_another_data_seed_or_its_own():
    proc = run(PAIR, "--dry-run", "--replicate", "7", "NAME", CONTROL, MHAR, "--data.seed", "3")
    lines = [line.split() for line in proc.stdout.strip().splitlines()]
    assert [line[3] for line in lines] == ["runs/NAME/control", "runs/NAME/mhar", "runs/NAME/replicate"]
    assert lines[2] == [
        "launch/torchrun.sh",
        CONTROL,
        "--job.dump_folder",
        "runs/NAME/replicate",
        "--data.seed",
        "3",
        "--data.seed",
        "7",
    ]  # fmt: skip  (the last value wins)
    assert "runs/NAME/replicate (the control again, data seed 7)" in proc.stderr
    same = run(PAIR, "--dry-run", "--replicate", "same", "NAME", CONTROL, MHAR).stdout.splitlines()
    assert same[2].split() == ["launch/torchrun.sh", CONTROL, "--job.dump_folder", "runs/NAME/replicate"]
    slurm = run(PAIR, "--slurm", "--dry-run", "--replicate", "1", "NAME", CONTROL, MHAR).stdout.splitlines()
    assert [line.split()[2] for line in slurm] == ["NAME-control", "NAME-mhar", "NAME-replicate"]
    bad = run(PAIR, "--dry-run", "--replicate", "x", "NAME", CONTROL, MHAR, check=False)
    assert bad.returncode == 2 and "--replicate takes a data-order seed" in bad.stderr


def test_wandb_runs_are_one_per_arm_grouped_by_pair_and_resumed():
    def wandb_line(*args, env=None):
        err = run(SCRIPT, "--dry-run", *args, env=env).stderr
        return next(line for line in err.splitlines() if line.startswith("# W&B"))

    control = wandb_line(CONTROL, "--job.dump_folder", "runs/P/control", env={"WANDB_RUN_GROUP": "P"})
    again = wandb_line(CONTROL, "--job.dump_folder", "runs/P/control", env={"WANDB_RUN_GROUP": "P"})
    mhar = wandb_line(MHAR, "--job.dump_folder", "runs/P/mhar", env={"WANDB_RUN_GROUP": "P"})
    assert control == again  # the same id on every restart: W&B resumes the run
    assert "project mhar-titan, group P, run control, id control-" in control and ", run mhar, id mhar-" in mhar
    assert control.split("id ")[1] != mhar.split("id ")[1]


def test_pair_dry_run_passes_nproc():
    proc = run(PAIR, "--dry-run", "--nproc", "2", "NAME", CONTROL, MHAR)
    assert all(line.split()[:3] == ["launch/torchrun.sh", "--nproc", "2"] for line in proc.stdout.splitlines())


def test_pair_slurm_dry_run_submits_two_jobs():
    proc = run(
        PAIR,
        "--slurm",
        "--dry-run",
        "NAME",
        CONTROL,
        MHAR,
        "--training.steps",
        "3",
        env={"SBATCH_ARGS": "--nodes 2 --time 1:00:00"},
    )
    lines = [line.split() for line in proc.stdout.strip().splitlines()]
    for line, arm, config in zip(lines, ["control", "mhar"], [CONTROL, MHAR], strict=True):
        assert line == [
            "sbatch",
            "--job-name",
            f"NAME-{arm}",
            "--nodes",
            "2",
            "--time",
            "1:00:00",
            "launch/slurm.sbatch",
            config,
            "--job.dump_folder",
            f"runs/NAME/{arm}",
            "--training.steps",
            "3",
        ]


@pytest.mark.parametrize("flag", [["--checkpoint.folder", "s3://bucket/runs/x/"], ["--checkpoint.folder=/shared/x"]])
def test_a_checkpoint_folder_outside_the_run_folders_is_split_per_arm(flag):
    """One store prefix (or absolute folder) for both arms would mix their checkpoints: each arm gets its own."""
    proc = run(PAIR, "--slurm", "--dry-run", "NAME", CONTROL, MHAR, *flag, "--training.steps", "3")
    base = flag[-1].split("=")[-1].rstrip("/")
    for line, arm in zip(proc.stdout.strip().splitlines(), ["control", "mhar"], strict=True):
        words = line.split()
        given = words[words.index(flag[0]) + 1] if len(flag) == 2 else words[-3].split("=", 1)[1]
        assert given == f"{base}/{arm}" and words[-2:] == ["--training.steps", "3"], line
    assert f"# checkpoints: {base}/control and {base}/mhar" in proc.stderr
    relative = run(PAIR, "--dry-run", "NAME", CONTROL, MHAR, "--checkpoint.folder", "ck").stdout.split()
    assert relative.count("ck") == 2  # below each arm's own run folder already


def test_two_configs_checkpointing_to_one_folder_are_refused_before_either_arm(tmp_path):
    configs = []
    for name in (CONTROL, MHAR):
        text = (REPO / name).read_text().replace('folder = "checkpoint"', 'folder = "s3://bucket/runs/x"')
        configs.append(tmp_path / name.split("/")[-1])
        configs[-1].write_text(text)
    proc = run(PAIR, "--dry-run", "NAME", *map(str, configs), check=False)
    assert proc.returncode == 2 and proc.stdout == ""
    assert "both checkpoint to s3://bucket/runs/x: one folder for two runs" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["a/b", CONTROL, MHAR], "a/b"),
        (["..", CONTROL, MHAR], ".."),
        (["NAME", CONTROL, "configs/nope.toml"], "configs/nope.toml"),
        (["NAME", "configs/nope.toml", MHAR], "configs/nope.toml"),
        (["NAME", CONTROL, MHAR, "--job.dump_folder", "x"], "--job.dump_folder"),
        (["--slurm", "--nproc", "2", "NAME", CONTROL, MHAR], "--nproc"),
    ],
)
def test_pair_refuses_bad_arguments(args, named):
    proc = run(PAIR, "--dry-run", *args, check=False)
    assert proc.returncode == 2
    assert named in proc.stderr


@pytest.fixture
def pair_name():
    name = f"pytest-launcher-{os.getpid()}"
    yield name
    shutil.rmtree(REPO / "runs" / name, ignore_errors=True)


def test_pair_runs_both_arms_in_order(fake_python, pair_name):
    env = {"PYTHON": fake_python, "FAKE_MODE": "exit0", "WANDB_RUN_ID": "one-for-both"}
    run(PAIR, "--nproc", "1", pair_name, CONTROL, MHAR, env=env)
    ids = set()
    for arm in ["control", "mhar"]:
        assert (REPO / "runs" / pair_name / arm / "launched").exists()
        # W&B: the pair's group, a run per arm named after it (a WANDB_RUN_ID for both is dropped)
        seen = dict(line.split("=", 1) for line in (REPO / "runs" / pair_name / arm / "wandb_env").read_text().split())
        assert (
            seen["WANDB_RUN_GROUP"] == pair_name and seen["WANDB_RUN_NAME"] == arm and seen["WANDB_RESUME"] == "allow"
        )
        assert seen["WANDB_PROJECT"] == "mhar-titan" and seen["WANDB_RUN_ID"].startswith(f"{arm}-")
        ids.add(seen["WANDB_RUN_ID"])
    assert len(ids) == 2


def test_pair_stops_at_a_preempted_arm(fake_python, pair_name):
    proc = run(
        PAIR, "--nproc", "1", pair_name, CONTROL, MHAR, env={"PYTHON": fake_python, "FAKE_MODE": "preempt"}, check=False
    )
    assert proc.returncode == 75, proc.stderr
    assert (REPO / "runs" / pair_name / "control" / "preempted.json").exists()
    assert not (REPO / "runs" / pair_name / "mhar").exists()


# --- launch/slurm.sbatch, run under the fake srun ------------------------------------------------


@pytest.mark.parametrize(
    ("mode", "code", "requeued"),
    [("preempt", 75, True), ("exit0", 0, False), ("exit3", 3, False), ("exit66", 66, False)],
)
def test_sbatch_requeues_only_a_preempted_run(tmp_path, fake_slurm, fake_python, mode, code, requeued):
    dump = tmp_path / "run"
    env = {**fake_slurm, "PYTHON": fake_python, "FAKE_MODE": mode}
    proc = subprocess.run(
        [SBATCH, CONTROL, "--job.dump_folder", str(dump)], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert proc.returncode == code, proc.stderr
    assert (dump / "launched").exists()
    assert (tmp_path / "requeued").exists() == requeued
    if requeued:
        assert (tmp_path / "requeued").read_text() == "4242\n"


@pytest.mark.parametrize(("sig", "requeued"), [(signal.SIGUSR1, True), (signal.SIGTERM, False)], ids=["USR1", "TERM"])
def test_sbatch_signal_stops_the_trainer(tmp_path, fake_slurm, fake_python, sig, requeued):
    dump = tmp_path / "run"
    env = {**fake_slurm, "PYTHON": fake_python, "FAKE_MODE": "wait_stop"}
    cmd = [SBATCH, CONTROL, "--job.dump_folder", str(dump)]
    proc, err = signal_once_launched(cmd, env, dump, sig)
    launch_id = (dump / "launch_id").read_text().strip()
    assert launch_id and (dump / "STOP").read_text() == launch_id + "\n"  # the trainer obeys it, even before it starts
    assert proc.returncode == 75, err
    assert (tmp_path / "requeued").exists() == requeued, err


# --- launch/eval_watch.sbatch ------------------------------------------------------------------

WATCH = str(REPO / "launch" / "eval_watch.sbatch")


@pytest.fixture
def pair_dir(tmp_path):
    for arm in ("control", "mhar"):
        (tmp_path / "pair" / arm).mkdir(parents=True)
    return tmp_path / "pair"


def test_eval_watch_dry_run_prints_the_watcher_on_the_gpu(pair_dir):
    out = run(WATCH, "--dry-run", str(pair_dir), "--suite", "paper", "--dtype", "fp32").stdout.split()
    assert out == [
        *(sys.executable, "-m", "mhar_titan.eval", str(pair_dir), "--watch", "--device", "cuda", "--dtype", "bf16"),
        *("--suite", "paper", "--dtype", "fp32"),  # (the later --dtype wins)
    ]
    out = run(WATCH, "--dry-run", str(pair_dir), "--once", env={"EVAL_SCRATCH": "/local/scratch"}).stdout.split()
    assert out[3:] == [str(pair_dir), "--device", "cuda", "--dtype", "bf16", "--scratch", "/local/scratch", "--once"]
    header = [line.split()[1] for line in open(WATCH) if line.startswith("#SBATCH")]
    assert "--gpus-per-node=1" in header and "--requeue" in header and "--nodes=1" in header
    help_text = run(WATCH, "--help").stdout
    assert help_text.startswith("sbatch [sbatch options] launch/eval_watch.sbatch [--dry-run] PAIR_DIR")


def test_eval_watch_refuses_what_is_not_a_pair_in_one_line(pair_dir):
    for args, named in [
        ([], "usage: sbatch [sbatch options] launch/eval_watch.sbatch PAIR_DIR [eval options]"),
        (
            [str(pair_dir.parent / "nope")],
            f"no pair folder {pair_dir.parent / 'nope'} (relative to {REPO}): expected "
            "runs/NAME, as launch/pair.sh makes it",
        ),
        (
            [str(pair_dir / "control")],
            f"{pair_dir / 'control'}/control: missing; a pair folder holds control/ and mhar/ (launch/pair.sh)",
        ),
    ]:
        proc = run(WATCH, *args, check=False)
        assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [f"launch/eval_watch.sbatch: {named}"]


def test_eval_watch_runs_the_watcher_and_passes_its_exit_code_on(pair_dir, tmp_path):
    fake = tmp_path / "python"
    fake.write_text(f'#!/usr/bin/env bash\nprintf "%s\\n" "$@" > {tmp_path}/argv\nexit 3\n')
    fake.chmod(0o755)
    proc = run(WATCH, str(pair_dir), "--tasks", "mhar_tiny_cloze", env={"PYTHON": str(fake)}, check=False)
    assert proc.returncode == 3
    argv = (tmp_path / "argv").read_text().split()
    assert argv == [
        *("-m", "mhar_titan.eval", str(pair_dir), "--watch", "--device", "cuda", "--dtype", "bf16"),
        *("--tasks", "mhar_tiny_cloze"),
    ]


# --- mhar_titan.launch: torchrun keeping the trainer's exit codes ---------------------------------


def test_the_trainers_exit_codes_are_kept_and_other_failures_stay_torchruns():
    def failed(*codes: int) -> ChildFailedError:
        failures = {rank: ProcessFailure(rank, 100 + rank, code, "/nonexistent") for rank, code in enumerate(codes)}
        for rank, failure in failures.items():
            failure.timestamp = rank  # rank 0 failed first
        return ChildFailedError("train_cpt.py", failures)

    assert [launch.trainer_exit_code(failed(code, -15)) for code in (2, 66, 75)] == [2, 66, 75]
    assert launch.trainer_exit_code(failed(1, 2)) is None  # a crash first: torchrun's summary, exit 1
    assert launch.trainer_exit_code(failed(-9)) is None  # killed by a signal
    agent = logging.LogRecord(
        launch.AGENT_LOGGER, logging.ERROR, "api.py", 1, "failed (exitcode: %s) local_rank: %s", (66, 0), None
    )
    crash = logging.LogRecord(
        launch.AGENT_LOGGER, logging.ERROR, "api.py", 1, "failed (exitcode: %s) local_rank: %s", (1, 0), None
    )
    quiet = launch._TrainerExits()
    assert not quiet.filter(agent) and quiet.filter(crash)


# A worker that checkpoints for a second after a SIGTERM or SIGUSR1, as the trainer does, then exits 75.
SIGNALLED_WORKER = """
import os, signal, sys, time
got = []
for sig in (signal.SIGTERM, signal.SIGUSR1):
    signal.signal(sig, lambda s, _: got.append(signal.Signals(s).name))
open(os.path.join(sys.argv[1], "ready-" + os.environ["RANK"]), "w").close()
while not got:
    time.sleep(0.01)
time.sleep(1)
open(os.path.join(sys.argv[1], "got-" + os.environ["RANK"]), "w").write(" ".join(got))
sys.exit(75)
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1], ids=["TERM", "USR1"])
def test_torchrun_passes_a_cluster_signal_to_the_workers_and_waits_for_their_code(tmp_path, sig):
    """torchrun alone gets the signal: the workers get it from it, checkpoint, and their code 75 comes out, with no
    "death signal" shutdown (SIGTERM) and no death of torchrun (SIGUSR1)."""
    worker = tmp_path / "worker.py"
    worker.write_text(SIGNALLED_WORKER)
    cmd = [sys.executable, "-m", "mhar_titan.launch", "--standalone", "--nproc-per-node=2", str(worker), str(tmp_path)]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not all((tmp_path / f"ready-{rank}").exists() for rank in (0, 1)):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.02)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 75, err
    assert [(tmp_path / f"got-{rank}").read_text() for rank in (0, 1)] == [sig.name, sig.name]
    assert f"mhar_titan.launch: got {sig.name}; passed to the 2 workers, which checkpoint and stop" in err
    assert "death signal" not in err and "Traceback" not in err


def test_the_job_logs_folder_is_in_every_checkout():
    """sbatch does not create the folder of --output, and a job whose log cannot open fails with no log anywhere."""
    outputs = [line.split()[1] for line in open(SBATCH) if line.startswith("#SBATCH --output=")]
    assert outputs == ["--output=logs/%x-%j.out"]
    tracked = subprocess.run(["git", "ls-files", "logs"], cwd=REPO, capture_output=True, text=True, check=True)
    assert tracked.stdout.split() == ["logs/.gitignore"]
