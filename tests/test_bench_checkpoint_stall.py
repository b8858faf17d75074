"""benchmarks/bench_checkpoint_stall.py in one process: one job a mode that differs in async_mode alone, the stall
read from the step times, the checkpoint check, and the table (its GPU run: docs/benchmarks.md)."""

import pytest
import torch
import torch.distributed.checkpoint as dcp

from benchmarks.bench_checkpoint_stall import MODES, check_checkpoints, main, mode_command, stalls, table
from mhar_titan.components.checkpoint.sealed_save import SealedBackgroundWriter


def test_the_modes_run_the_same_job_but_for_async_mode(tmp_path):
    cmds = {
        m: mode_command(m, tmp_path / m, tmp_path / "ckpt", steps=9, interval=3, smoke=False, compile_=False)
        for m in MODES
    }

    def value(cmd, flag):
        return cmd[cmd.index(flag) + 1]

    for mode, cmd in cmds.items():
        assert value(cmd, "--checkpoint.async_mode") == mode
        rest = [a for a in cmd if a not in (mode, str(tmp_path / mode))]
        assert rest == [a for a in cmds["disabled"] if a not in ("disabled", str(tmp_path / "disabled"))]
    cmd = cmds["async"]
    assert value(cmd, "--model.flavor") == "marin8b_8l" and value(cmd, "--training.seq_len") == "4096"
    assert value(cmd, "--checkpoint.interval") == "3" and value(cmd, "--checkpoint.folder") == str(tmp_path / "ckpt")
    assert "--ema.no-enable" in cmd and "--compile.no-enable" in cmd and "--checkpoint.last_save_model_only" in cmd
    smoke = mode_command("async", tmp_path, tmp_path, steps=7, interval=2, smoke=True, compile_=True)
    assert value(smoke, "--model.flavor") == "tiny" and "--compile.enable" in smoke


def test_a_stall_is_the_step_after_a_save_over_the_median_of_the_steps_after_none():
    # saves after steps 3 and 6 fall in steps 4 and 7; step 1 initialises
    times = {1: 9.0, 2: 1.0, 3: 1.2, 4: 3.0, 5: 1.0, 6: 1.1, 7: 1.5, 8: 0.9, 9: 1.0}
    got = stalls(times, steps=9, interval=3)
    assert got["step_s"] == 1.0 and got["stall_s"] == pytest.approx({3: 2.0, 6: 0.5})
    with pytest.raises(ValueError, match="no step after step 1 follows no save"):
        stalls({1: 1.0, 2: 2.0}, steps=3, interval=1)
    rows = [
        {"mode": "disabled", **got, "trainer": 10.0, "other": 0.0, "waits_s": {}},
        {"mode": "async_with_pinned_mem", **got, "trainer": 41.5, "other": 1.2, "waits_s": {3: 0.4}},
    ]
    lines = table(rows).splitlines()
    assert lines[0].split()[:3] == ["mode", "step", "s"]
    assert lines[1].split() == ["disabled", "1.00", "+2.00,", "+0.50", "10.0", "+0.0", "0.0", "-"]
    assert lines[2].split() == [
        "async_with_pinned_mem",
        "1.00",
        "+2.00,",
        "+0.50",
        "41.5",
        "+31.5",
        "1.2",
        "0.4",
        "(step-3)",
    ]


def test_the_checkpoints_must_be_sealed_and_the_last_interval_one_intact(tmp_path):
    state = {"w": torch.arange(1000.0), "step": 3}
    for step in (3, 6):
        dcp.save(state, storage_writer=SealedBackgroundWriter(str(tmp_path / f"step-{step}")), no_dist=True)
    assert check_checkpoints(tmp_path, 3, last=6) == "complete and sealed: steps [3, 6]; step-3 verified"
    dcp.save(state, checkpoint_id=str(tmp_path / "step-9"), no_dist=True)  # torch's own writer: no checksums
    with pytest.raises(RuntimeError, match="step-9: not sealed"):
        check_checkpoints(tmp_path, 3, last=9)


def test_bad_arguments_are_refused_before_any_job(capsys):
    for argv, says in ((["--modes", "sync"], "--modes 'sync'"), (["--steps", "6", "--interval", "3"], "two saves")):
        with pytest.raises(SystemExit) as done:
            main(argv)
        assert done.value.code == 2 and says in capsys.readouterr().err
