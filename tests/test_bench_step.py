"""make bench-step's arms: the same geometry and data for all four, MHAR settings only where they apply."""

import json

import pytest

from benchmarks.bench_step import AC_MODES, ARMS, aggregate, arm_command, fitting_flavor
from mhar_titan.plan import GIB


def test_arms_share_everything_but_the_trainer_and_mhar(tmp_path):
    cmds = {arm: arm_command(arm, tmp_path / arm, nproc=1, steps=12, smoke=False) for arm in ARMS}

    def settings(cmd):
        start = cmd.index("--job.config_file")
        pairs = {}
        for i in range(start, len(cmd)):
            if cmd[i].startswith("--"):
                pairs[cmd[i]] = tuple(v for v in cmd[i + 1 :][:2] if not v.startswith("--"))[:1]
        return pairs

    stock, control = settings(cmds["stock"]), settings(cmds["control"])
    assert not any(k.startswith("--mhar.") for k in stock)
    shared = {k: v for k, v in control.items() if not k.startswith("--mhar.") and k != "--job.dump_folder"}
    assert {k: v for k, v in stock.items() if k != "--job.dump_folder"} == shared
    assert control["--model.flavor"] == ("marin8b_16l",) and control["--training.seq_len"] == ("4096",)
    # 8 blocks over 16 layers: sites see 2 to 9 sources, as the marin8b configs' 8 blocks over 32 layers
    assert "--compile.enable" in control and control["--mhar.num_blocks"] == ("8",)
    assert control["--activation_checkpoint.mode"] == ("full",)
    assert "--mhar.enable" not in control
    assert cmds["mhar_triton"][cmds["mhar_triton"].index("--mhar.backend") + 1] == "triton"
    assert cmds["mhar_compile"][cmds["mhar_compile"].index("--mhar.backend") + 1] == "torch"
    assert cmds["stock"][cmds["stock"].index("-m", 3) + 1] == "benchmarks.stock_titan"


@pytest.mark.parametrize("float8", [False, True], ids=["bf16", "float8"])
def test_the_depth_is_the_deepest_cut_both_arms_fit_on_this_gpu(float8):
    """An 80 GB H100 (79.2 GiB as torch sees it) runs the 8-layer cut for full and none alike (16 layers under full
    AC peaked at 84.9 GiB on an H200); an H200 keeps 16; a GPU that holds no cut is refused, naming the mode."""
    flavor, why = fitting_flavor(["full", "none"], 1, 79.2 * GIB, None, float8)
    assert flavor == "marin8b_8l" and why.startswith("marin8b_8l (8 layers): the deepest cut") and "79.2 GiB" in why
    assert fitting_flavor(["full", "none"], 1, 139.8 * GIB, None, float8)[0] == "marin8b_16l"
    with pytest.raises(ValueError, match="a GPU of 30.0 GiB holds no cut of the 8B in AC mode none"):
        fitting_flavor(["full", "none"], 1, 30 * GIB, None, float8)


def test_ac_modes_reach_every_arm_and_nothing_else_changes(tmp_path):
    def mode_args(cmd):
        return [
            a
            for i, a in enumerate(cmd)
            if a.startswith("--activation_checkpoint") or (i and cmd[i - 1].startswith("--activation_checkpoint"))
        ]

    for arm in ARMS:
        full = arm_command(arm, tmp_path, nproc=1, steps=12, smoke=False, ac="full")
        for mode, want in AC_MODES.items():
            cmd = arm_command(arm, tmp_path, nproc=1, steps=12, smoke=False, ac=mode)
            assert mode_args(cmd) == want
            assert [a for a in cmd if a not in want] == [a for a in full if a not in AC_MODES["full"]]
    sel = AC_MODES["selective"]
    assert sel[sel.index("--activation_checkpoint.selective_ac_option") + 1] == "op"
    blocks = arm_command("mhar_triton", tmp_path, nproc=1, steps=12, smoke=False, num_blocks=4)
    assert blocks[blocks.index("--mhar.num_blocks") + 1] == "4"


def test_throughput_is_tokens_over_time_and_memory_the_peak():
    # two timed steps at 100 and 300 tokens/s: 2 steps of equal tokens take 1/100 + 1/300 s
    series = {1: 5.0, 2: 100.0, 3: 300.0}
    assert aggregate(series, warmup=1, how="rate") == pytest.approx(150.0, rel=1e-12)
    assert aggregate({1: 9.0, 2: 3.0, 3: 4.0}, warmup=1, how="peak") == 4.0
    with pytest.raises(ValueError, match="no steps after the 3 warm-up steps"):
        aggregate(series, warmup=3, how="rate")


def test_profiled_arms_trace_their_last_step(tmp_path):
    cmd = arm_command("mhar_triton", tmp_path, nproc=1, steps=14, smoke=False, profile=True)
    assert cmd[cmd.index("--profiling.profile_freq") + 1] == "14" and "--profiling.enable_profiling" in cmd
    assert "--profiling.enable_profiling" not in arm_command("control", tmp_path, nproc=1, steps=14, smoke=False)


def test_trace_summary_sums_gpu_time_by_kernel_kind(tmp_path):
    from benchmarks.trace_summary import summarise

    events = [
        {"ph": "X", "cat": "kernel", "name": "route_fwd_kernel", "ts": 0, "dur": 1500},
        {"ph": "X", "cat": "kernel", "name": "route_bwd_mix_kernel", "ts": 2000, "dur": 500},
        {"ph": "X", "cat": "kernel", "name": "nvjet_hsh_256x128_gemm", "ts": 3000, "dur": 4000},
        {"ph": "X", "cat": "kernel", "name": "triton_per_fused_add_0", "ts": 7000, "dur": 250},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoD", "ts": 7500, "dur": 500},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 99999},  # CPU: not GPU time
    ]
    path = tmp_path / "rank0_trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    s = summarise(path)
    assert s["by_kind"] == {"routing": 2.0, "matmul": 4.0, "compiled (triton)": 0.25, "copies/memset": 0.5}
    assert s["gpu_ms"] == 6.75 and s["span_ms"] == 8.0
    # idle: 1.5-2.0 and 2.5-3.0 ms (two gaps of 0.5 ms), 7.25-7.5 (0.25 ms)
    assert s["idle"] == {"idle": 1.25, "idle in gaps >= 0.1 ms": 1.25}


def test_gap_report_names_the_longest_gap_its_launching_op_and_the_blocking_host_call(tmp_path):
    from benchmarks.trace_summary import gap_report, label

    events = [
        {"ph": "X", "cat": "kernel", "name": "nvjet_gemm", "ts": 0, "dur": 1000, "args": {"External id": 1}},
        {"ph": "X", "cat": "kernel", "name": "triton_poi_add", "ts": 1050, "dur": 100, "args": {"External id": 2}},
        # a 0.6 ms gap, during which the host waits in a synchronisation, then a routing kernel
        {"ph": "X", "cat": "kernel", "name": "route_fwd_kernel", "ts": 1750, "dur": 200, "args": {"External id": 3}},
        # a 0.3 ms gap
        {"ph": "X", "cat": "kernel", "name": "nvjet_gemm", "ts": 2250, "dur": 100, "args": {"External id": 4}},
        {"ph": "X", "cat": "cpu_op", "name": "MHARRoutePair", "ts": 1100, "dur": 700, "args": {"External id": 3}},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 2000, "dur": 100, "args": {"External id": 4}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 1200, "dur": 400},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 1300, "dur": 5},
    ]
    path = tmp_path / "mhar_triton" / "profile_traces" / "iteration_14" / "rank0_trace.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"traceEvents": events}))
    gaps = gap_report(path, top=5)
    assert [(g["ms"], g["at_ms"]) for g in gaps] == [(0.6, 1.15), (0.3, 1.95)]  # the 50 us gap is under 0.1 ms
    assert gaps[0]["after"] == "triton_poi_add" and gaps[0]["before"] == "route_fwd_kernel"
    assert gaps[0]["launched_by"] == "MHARRoutePair" and gaps[0]["host_blocking"] == "cudaStreamSynchronize 0.40 ms"
    assert gaps[1]["launched_by"] == "aten::mm" and gaps[1]["host_blocking"] == ""
    assert label(path) == "mhar_triton"


def test_trace_summary_refuses_what_is_not_a_trace_and_keeps_two_traces_of_one_folder_apart(tmp_path, capsys):
    import gzip

    from benchmarks.trace_summary import main

    bad = tmp_path / "bad.json"
    bad.write_text('{"traceEvents": 5}')
    with pytest.raises(SystemExit):
        main([str(bad)])
    assert f"{bad}: not a profiler chrome trace" in capsys.readouterr().err
    events = {"traceEvents": [{"ph": "X", "cat": "kernel", "name": "route_fwd_kernel", "ts": 0, "dur": 1000}]}
    plain, zipped = tmp_path / "a.json", tmp_path / "a.json.gz"
    plain.write_text(json.dumps(events))
    zipped.write_bytes(gzip.compress(json.dumps(events).encode()))
    main([str(plain), str(zipped)])  # one folder: each column named by its path, none dropped
    head = capsys.readouterr().out.splitlines()[0]
    assert str(plain) in head and str(zipped) in head


def test_block_causal_runs_on_documents_of_the_asked_length_and_not_on_the_stock_arm(tmp_path, capsys):
    from benchmarks.bench_step import _parse, document_corpus

    data, measured = document_corpus(tmp_path, 1024, 60_000)
    assert 0.9 * 1024 < measured < 1.1 * 1024  # lengths uniform in [512, 1536], counted with their eos
    assert data[0] == "--data.mixture" and data[1].startswith("docstrings=0.7:") and ",code=0.3:" in data[1]
    assert [len(list((tmp_path / "documents" / s).glob("*.parquet"))) for s in ("docstrings", "code")] == [4, 4]
    with pytest.raises(SystemExit):
        _parse(["--attention-mask", "block_causal"])  # the stock arm is among the default arms
    assert "the stock arm is torchtitan's llama3" in capsys.readouterr().err
    args, arms, _ = _parse(["--arms", "control,mhar_triton", "--attention-mask", "causal,block_causal"])
    assert args.masks == ["causal", "block_causal"] and arms == ["control", "mhar_triton"]
