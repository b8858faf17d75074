"""`mhar_titan.compare` on synthetic pairs of TensorBoard runs with known deltas, noise and divergences."""

import json
import math
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO
from torch.utils.tensorboard import SummaryWriter

from mhar_titan.compare.pair import compare, main
from mhar_titan.compare.stats import paired_ci, t_quantile
from mhar_titan.components import fingerprint
from mhar_titan.components.tensorboard_scalars import event_files, load_scalars, read_scalars
from mhar_titan.components.val_bands import BANDS
from mhar_titan.config import parse_config

N, SIGMA = 2000, 0.02
FIRST_DELTA = 2.0**-16  # 2.5 and 2.5 + 2**-16 are both exact in float32
VAL_BATCHES = 16
T_975_DF15 = 2.1314495455597757  # Student-t 0.975 quantile, 15 df (incomplete beta via mpmath, 30 digits)
MU_RAW, MU_EMA = -3.0e-4, -5.0e-4


def f32(x: float) -> float:
    return float(np.float32(x))


def write_run(run: Path, scalars: dict[str, dict[int, float]], sub: str = "20260101-0000", t0: float = 0.0) -> None:
    writer = SummaryWriter(log_dir=str(run / "tb" / sub))
    for tag, series in scalars.items():
        for step, value in series.items():
            writer.add_scalar(tag, value, step, walltime=t0 + step)
    writer.close()


def write_val(run: Path, step: int, **kinds: dict[str, list]) -> None:
    (run / "validation").mkdir(parents=True, exist_ok=True)
    (run / "validation" / f"step-{step:08d}.json").write_text(json.dumps({"step": step, **kinds}))


def val_files(run: Path) -> dict[int, Path]:
    return {int(p.stem[5:]): p for p in (run / "validation").glob("step-*.json")}


def batches(ce: np.ndarray, tokens: np.ndarray) -> dict[str, list]:
    return {"ce_sum": (ce * tokens).tolist(), "tokens": tokens.tolist()}


def schedule(steps: range) -> dict[str, dict[int, float]]:
    """Scalars both arms of a pair share: LR, tokens, data counters."""
    return {
        "lr/decay": {s: 4e-4 * (1 - s / (steps[-1] + 1)) for s in steps},
        "tokens_seen": {s: 8 * 4096 * s for s in steps},
        "data/docs": {s: 3 * s for s in steps},
        "data/tokens/a": {s: 5000 * s for s in steps},
        "data/tokens/b": {s: 700 * (s - 9) for s in steps if s >= 10},
    }


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> dict:
    """A pair with known noise, first-step delta and paired validation differences."""
    root = tmp_path_factory.mktemp("pair")
    rng = np.random.default_rng(20261130)
    steps = range(1, N + 1)
    trend = {s: 2.0 + 0.5 * math.exp(-s / 400) for s in steps}
    control = {s: trend[s] + SIGMA * rng.standard_normal() for s in steps}
    control[1] = 2.5
    mhar = {s: control[s] + FIRST_DELTA * (1 + s / N) for s in steps}
    mhar[1] = 2.5 + FIRST_DELTA
    shared = schedule(steps)
    tps = {"control": 10000.0, "mhar": 9000.0}
    arms = {"control": control, "mhar": mhar}
    val_steps = (500, 1000, 1500)
    val_tb: dict[str, dict[str, dict[int, float]]] = {"control": {}, "mhar": {}}
    tokens = rng.integers(3000, 4097, VAL_BATCHES)
    for s in val_steps:
        c_raw, c_ema = 2.3 + 0.05 * rng.standard_normal((2, VAL_BATCHES))
        e_raw, e_ema = rng.standard_normal((2, VAL_BATCHES))
        m_raw = c_raw + MU_RAW + 0.003 * (e_raw - e_raw.mean())  # paired differences with mean exactly MU
        m_ema = c_ema + MU_EMA + 0.002 * (e_ema - e_ema.mean())
        for name, raw, ema in (("control", c_raw, c_ema), ("mhar", m_raw, m_ema)):
            val_tb[name].setdefault("val/ce", {})[s] = float((raw * tokens).sum() / tokens.sum())
            val_tb[name].setdefault("val/ce_ema", {})[s] = float((ema * tokens).sum() / tokens.sum())
            if s != 1500:  # step 1500: aggregate only, as without per-batch files
                write_val(root / name, s, raw=batches(raw, tokens), ema=batches(ema, tokens))
    base = 2.6 + 0.05 * rng.standard_normal(VAL_BATCHES)  # step 0: the same base, the EMA is the weights
    for name in arms:
        for tag in ("val/ce", "val/ce_ema"):
            val_tb[name][tag][0] = float((base * tokens).sum() / tokens.sum())
        write_val(root / name, 0, raw=batches(base, tokens), ema=batches(base, tokens))
    for name, loss in arms.items():
        write_run(
            root / name,
            {
                "train/loss": loss,
                "train/ce": {s: v - 1e-3 for s, v in loss.items()},
                "tokens_per_s": {s: (100.0 if s <= 5 else tps[name]) for s in steps},
                **shared,
                **val_tb[name],
            },
        )
    ended = [  # the MHAR arm crashed once and hung once, each restarted (components/endings.py)
        {"class": "crashed", "step": 700, "rank": 3, "cause": "RuntimeError: NCCL error", "code": 1},
        {"class": "hung", "step": 1200, "rank": 0, "cause": "hung after after_data of step 1200", "code": 124},
        {"class": "finished", "step": N, "rank": 0, "cause": "finished its steps", "code": 0},
    ]
    (root / "mhar" / "endings.jsonl").write_text("".join(json.dumps(e) + "\n" for e in ended))
    (root / "control" / "endings.jsonl").write_text(json.dumps(ended[-1]) + "\n")
    result = compare(root)
    return {"root": root, "result": result, "trend": trend, "tokens": tokens}


def test_delta_run_holds_exact_paired_differences(pair):
    root = pair["root"]
    c, m = read_scalars(root / "control"), read_scalars(root / "mhar")
    delta = read_scalars(root / "delta", "delta/train_loss")
    assert delta == {s: f32(m[s] - c[s]) for s in c}
    assert read_scalars(root / "delta", "delta/abs_train_loss") == {s: f32(abs(m[s] - c[s])) for s in c}
    c_ce, m_ce = read_scalars(root / "control", "train/ce"), read_scalars(root / "mhar", "train/ce")
    assert read_scalars(root / "delta", "delta/train_ce") == {s: f32(m_ce[s] - c_ce[s]) for s in c}


def test_first_step_delta_and_noise(pair):
    r, trend = pair["result"], pair["trend"]
    assert r["first_step"] == 1 and r["steps"] == list(range(1, N + 1))
    assert r["first_step_abs_delta"] == FIRST_DELTA
    assert r["ratio_first"] == FIRST_DELTA / r["noise"]
    # sd(diff)/√2 estimates sqrt(σ² + var(trend diffs)/2); for Gaussian noise the differences are MA(1) with
    # autocovariances 2σ², -σ², so the estimate of σ has sd σ·sqrt(3 / (4 n)) over n differences.
    n = N - 1
    expected = math.sqrt(SIGMA**2 + np.var(np.diff([trend[s] for s in range(1, N + 1)]), ddof=1) / 2)
    assert abs(r["noise"] - expected) < 4 * SIGMA * math.sqrt(3 / (4 * n))


def test_quarters_and_throughput(pair):
    root, r = pair["root"], pair["result"]
    c, m = read_scalars(root / "control"), read_scalars(root / "mhar")
    d = np.array([m[s] - c[s] for s in range(1, N + 1)])
    assert [(q["first"], q["last"]) for q in r["quarters"]] == [(1, 500), (501, 1000), (1001, 1500), (1501, 2000)]
    for q, part in zip(r["quarters"], np.split(d, 4), strict=True):
        assert q["mean_abs_delta"] == pytest.approx(np.abs(part).mean(), rel=1e-12)
        assert q["ratio"] == pytest.approx(np.abs(part).mean() / r["noise"], rel=1e-12)
    assert r["tokens_per_s"] == {"control": 10000.0, "mhar": 9000.0, "ratio": 0.9, "stragglers": None}  # not timed


def test_validation_paired_ci(pair):
    root, r = pair["root"], pair["result"]
    assert [v["step"] for v in r["val"]] == [500, 1000, 1500]
    low_tb = read_scalars(root / "delta", "delta/val_ce_ci_low")
    high_tb = read_scalars(root / "delta", "delta/val_ce_ci_high")
    for v in r["val"][:2]:
        for kind, mu in (("raw", MU_RAW), ("ema", MU_EMA)):
            files = [
                json.loads((root / arm / "validation" / f"step-{v['step']:08d}.json").read_text())
                for arm in ("control", "mhar")
            ]
            (c_sum, t), (m_sum, _) = ((np.array(f[kind]["ce_sum"]), np.array(f[kind]["tokens"])) for f in files)
            diffs = m_sum / t - c_sum / t
            half = T_975_DF15 * diffs.std(ddof=1) / math.sqrt(VAL_BATCHES)
            ci = v[kind]["ci"]
            assert ci["n"] == VAL_BATCHES and ci["mean"] == pytest.approx(diffs.mean(), rel=1e-12)
            assert ci["half_width"] == pytest.approx(half, rel=1e-9)
            assert ci["low"] <= mu <= ci["high"]
            assert v[kind]["delta"] == pytest.approx(m_sum.sum() / t.sum() - c_sum.sum() / t.sum(), rel=1e-12)
        assert low_tb[v["step"]] == f32(v["raw"]["ci"]["low"]) and high_tb[v["step"]] == f32(v["raw"]["ci"]["high"])
    last = r["val"][2]  # no per-batch files: the aggregate from TensorBoard, no CI
    c_val, m_val = read_scalars(root / "control", "val/ce"), read_scalars(root / "mhar", "val/ce")
    assert last["raw"]["source"] == "tensorboard" and last["raw"]["ci"] is None
    assert last["raw"]["delta"] == m_val[1500] - c_val[1500]
    assert read_scalars(root / "delta", "delta/val_ce")[1500] == f32(m_val[1500] - c_val[1500])
    assert 1500 not in low_tb


def test_each_arm_changes_from_the_identical_base_with_a_paired_ci(pair):
    root, r = pair["root"], pair["result"]
    assert r["base_identical"] is True and r["base"]["present"] == {"control": True, "mhar": True}
    assert r["base"]["raw"]["delta"]["delta"] == 0 and r["base"]["raw"]["delta"]["ci"]["half_width"] == 0
    for arm in ("control", "mhar"):
        rows = r["from_base"][arm]
        assert [row["step"] for row in rows] == [500, 1000, 1500]
        files = {s: json.loads(p.read_text()) for s, p in val_files(root / arm).items()}
        base = files[0]
        for row in rows[:2]:
            later = files[row["step"]]
            for kind in ("raw", "ema"):
                (b_sum, t), (v_sum, _) = (
                    (np.array(f[kind]["ce_sum"]), np.array(f[kind]["tokens"])) for f in (base, later)
                )
                diffs = v_sum / t - b_sum / t
                p = row[kind]
                assert p["source"] == "batches" and p["n"] == VAL_BATCHES
                assert p["delta"] == pytest.approx(v_sum.sum() / t.sum() - b_sum.sum() / t.sum(), rel=1e-12)
                assert p["ci"]["mean"] == pytest.approx(diffs.mean(), rel=1e-12)
                assert p["ci"]["half_width"] == pytest.approx(T_975_DF15 * diffs.std(ddof=1) / 4, rel=1e-9)
        last = rows[2]  # no per-batch files at step 1500: from TensorBoard, no CI
        val = read_scalars(root / arm, "val/ce_ema")
        assert last["ema"]["source"] == "tensorboard" and last["ema"]["ci"] is None
        assert last["ema"]["delta"] == val[1500] - val[0]
        tb = read_scalars(root / "delta", f"from_base/{arm}/val_ce_ema")
        assert tb == {s: f32(row["ema"]["delta"]) for s, row in zip((500, 1000, 1500), rows, strict=True)}
    # MHAR − control from the base is MHAR − control: the base cancels
    for c, m, v in zip(r["from_base"]["control"], r["from_base"]["mhar"], r["val"], strict=True):
        assert m["raw"]["delta"] - c["raw"]["delta"] == pytest.approx(v["raw"]["delta"], abs=1e-12)
    text = Path(r["report"]).read_text()
    assert "Both arms' step-0 values are identical (`val/ce` " in text and "WARNING" not in text
    assert "### Change of `control` from the base" in text and "### Change of `mhar` from the base" in text


def test_report_and_plots(pair):
    r = pair["result"]
    report = Path(r["report"])
    assert report == pair["root"] / "compare" / "report.md"
    text = report.read_text()
    for name in ("train_loss.png", "delta_train_loss.png", "val_delta.png"):
        assert (report.parent / name).stat().st_size > 0 and f"]({name})" in text
    assert r["lr_identical"] is True and r["tokens_identical"] is True and r["data_identical"] is True
    assert text.count("identical over the 2000 aligned steps") == 3
    assert "n/a" in text  # the step without per-batch files has no CI


def test_the_report_says_how_each_arms_jobs_ended(pair):
    text = Path(pair["result"]["report"]).read_text()
    section = text.split("## How the jobs ended", 1)[1].split("\n## ", 1)[0]
    assert section.strip().splitlines()[2:] == [
        "| jobs | 1 finished | 1 crashed, 1 finished, 1 hung (step 700: RuntimeError: NCCL error; step 1200: "
        "hung after after_data of step 1200) |"
    ]


def test_t_quantile_matches_tables():
    # 30-digit values from the regularized incomplete beta (mpmath), independent of the finite sums used here
    table = {
        1: 12.706204736174705,
        2: 4.3026527297494639,
        3: 3.1824463052837096,
        4: 2.7764451051977944,
        5: 2.5705818356363155,
        10: 2.2281388519862747,
        15: T_975_DF15,
        30: 2.0422724563012383,
        100: 1.9839715185235523,
        1000: 1.9623390808264085,
    }
    for df, t in table.items():
        assert t_quantile(0.975, df) == pytest.approx(t, rel=1e-12), df
    assert paired_ci([1e-5]) is None and paired_ci([]) is None


def test_single_batch_validation_has_no_ci(tmp_path):
    for arm, ce in (("control", 2.0), ("mhar", 2.001)):
        write_run(tmp_path / arm, {"train/loss": {1: 3.0, 2: 2.9, 3: 2.8}})
        write_val(tmp_path / arm, 2, raw={"ce_sum": [ce * 100], "tokens": [100]})
    v = compare(tmp_path)["val"]
    assert v[0]["step"] == 2 and v[0]["raw"]["ci"] is None and v[0]["ema"] is None
    assert v[0]["raw"]["delta"] == pytest.approx(0.001, rel=1e-9)
    assert "fewer than 2 batches" in (tmp_path / "compare" / "report.md").read_text()


def test_divergences_and_unmatched_steps(tmp_path, capsys):
    steps = range(1, 61)
    shared = schedule(steps)
    mhar = {tag: dict(series) for tag, series in shared.items()}
    for s in range(37, 61):
        mhar["lr/decay"][s] *= 1.5
    for s in range(51, 61):
        mhar["tokens_seen"][s] += 4096
    mhar["data/tokens/b"][44] += 1
    mhar["data/tokens/c"] = {s: 10.0 * s for s in range(50, 61)}
    write_run(tmp_path / "control", {"train/loss": {s: 3 - s / 100 for s in steps if s != 10}, **shared})
    write_run(tmp_path / "mhar", {"train/loss": {s: 3 - s / 100 for s in range(1, 66)}, **mhar})
    out = tmp_path / "out"
    main([str(tmp_path), "--out", str(out)])
    (out / "eval.md").write_text("## Evaluation (lm-evaluation-harness)\n")  # as mhar_titan.eval leaves it
    r = compare(tmp_path, out)  # a second run replaces the delta run's event file
    assert len(event_files(tmp_path / "delta")) == 1
    assert r["only_control"] == [] and r["only_mhar"] == [10, 61, 62, 63, 64, 65]
    assert r["lr_identical"] is False and r["checks"]["lr/decay"]["step"] == 37
    assert r["checks"]["lr/decay"]["mhar"] == f32(4e-4 * (1 - 37 / 61) * 1.5)
    assert r["tokens_identical"] is False and r["checks"]["tokens_seen"]["step"] == 51
    assert r["data_identical"] is False and (r["checks"]["data"]["tag"], r["checks"]["data"]["step"]) == (
        "data/tokens/b",
        44,
    )
    text = (out / "report.md").read_text()
    assert "first at step 37" in text and "first at step 51" in text and "first at step 44" in text
    assert "10, 61, 62, 63, 64, 65" in text
    assert text.endswith("\n## Evaluation (lm-evaluation-harness)\n")  # redoing the comparison keeps it
    printed = capsys.readouterr().out
    assert f"wrote {out / 'report.md'}" in printed and f"wrote {tmp_path / 'delta'}" in printed
    assert not (out / "val_delta.png").exists()


def test_resumed_runs_merge_like_read_scalars(tmp_path):
    write_run(tmp_path / "control", {"train/loss": {s: 3.0 for s in range(1, 31)}}, "a", t0=0)
    write_run(tmp_path / "control", {"train/loss": {s: 2.0 for s in range(21, 41)}}, "b", t0=1000)
    write_run(tmp_path / "mhar", {"train/loss": {s: 2.5 for s in range(1, 41)}})
    assert load_scalars(tmp_path / "control")["train/loss"] == read_scalars(tmp_path / "control")
    delta = compare(tmp_path)["head"]
    assert [h["delta"] for h in delta] == [-0.5] * 5
    assert read_scalars(tmp_path / "delta", "delta/train_loss")[25] == 0.5


def test_missing_arm_is_named(tmp_path):
    write_run(tmp_path / "control", {"train/loss": {1: 3.0}})
    missing = tmp_path / "mhar"
    with pytest.raises(FileNotFoundError, match=re.escape(str(missing))):
        compare(tmp_path)
    with pytest.raises(SystemExit, match=re.escape(str(missing))):
        main([str(tmp_path)])
    missing.mkdir()  # a folder without event files
    with pytest.raises(FileNotFoundError, match=re.escape(str(missing))):
        compare(tmp_path)


def test_series_missing_in_one_arm_diverges(tmp_path):
    steps = range(1, 11)
    shared = schedule(steps)
    control = {**shared, "tokens_seen": {s: v for s, v in shared["tokens_seen"].items() if s != 7}}
    write_run(tmp_path / "control", {"train/loss": {s: 3.0 for s in steps}, **control})
    write_run(tmp_path / "mhar", {"train/loss": {s: 3.0 for s in steps}, **shared, "data/tokens/new": {5: 1.0}})
    r = compare(tmp_path)
    assert r["checks"]["tokens_seen"] == {"identical": False, "step": 7, "control": None, "mhar": f32(8 * 4096 * 7)}
    assert r["checks"]["data"] == {
        "identical": False,
        "step": 5,
        "control": None,
        "mhar": 1.0,
        "tag": "data/tokens/new",
        "tags": 4,
    }
    assert "first at step 5: control missing, mhar 1.0" in (tmp_path / "compare" / "report.md").read_text()


def base_pair(root: Path, control: list[float] | None, mhar: list[float] | None, base_tokens=(100, 120, 90)) -> None:
    """Two arms validated at steps 2 and 4 on three batches, and at step 0 with the given per-batch CE."""
    for arm, base in (("control", control), ("mhar", mhar)):
        write_run(root / arm, {"train/loss": {1: 3.0, 2: 2.9, 3: 2.8, 4: 2.7}})
        t = np.array((100, 120, 90))
        for step, ce in ((2, [2.5, 2.6, 2.4]), (4, [2.4, 2.45, 2.3])):
            write_val(root / arm, step, raw=batches(np.array(ce), t), ema=batches(np.array(ce) + 0.1, t))
        if base is not None:
            b = batches(np.array(base), np.array(base_tokens))
            write_val(root / arm, 0, raw=b, ema=b)


def test_a_different_base_is_reported_loudly(tmp_path, capsys):
    base_pair(tmp_path, [2.7, 2.8, 2.6], [2.7, 2.8, 2.6 + 1e-6])
    main([str(tmp_path)])
    r = compare(tmp_path)
    assert r["base_identical"] is False and r["base"]["raw"]["identical"] is False
    assert r["base"]["raw"]["delta"]["delta"] == pytest.approx(1e-6 * 90 / 310, rel=1e-6)
    text = (tmp_path / "compare" / "report.md").read_text()
    head = text.split("## Training loss")[0]
    assert "**WARNING: the arms' step-0 validation differs" in head  # at the top, before everything else
    assert "not a matched pair" in text and "| `val/ce` | 2.709677 | 2.709678 | +2.903e-07 |" in text
    assert "step-0 validation (the base): DIFFER" in capsys.readouterr().out
    # each arm's change is still from its own base
    assert r["from_base"]["mhar"][0]["raw"]["delta"] == pytest.approx(
        (2.5 * 100 + 2.6 * 120 + 2.4 * 90) / 310 - (2.7 * 100 + 2.8 * 120 + (2.6 + 1e-6) * 90) / 310, rel=1e-9
    )


def test_a_base_in_one_arm_only_or_none(tmp_path):
    base_pair(tmp_path / "one", [2.7, 2.8, 2.6], None)
    r = compare(tmp_path / "one")
    assert r["base"] == {"present": {"control": True, "mhar": False}, "identical": None}
    assert [row["step"] for row in r["from_base"]["control"]] == [2, 4] and r["from_base"]["mhar"] == []
    assert [v["step"] for v in r["val"]] == [2, 4]
    text = (tmp_path / "one" / "compare" / "report.md").read_text()
    assert "**WARNING: only `control` validated the base at step 0; `mhar` did not**" in text.split("## Training")[0]

    base_pair(tmp_path / "none", None, None)
    r = compare(tmp_path / "none")
    assert r["base"]["identical"] is None and r["from_base"] == {"control": [], "mhar": []}
    text = (tmp_path / "none" / "compare" / "report.md").read_text()
    assert "No step-0 validation in either arm" in text and "WARNING" not in text


def test_change_from_a_base_on_other_batches_has_no_ci(tmp_path):
    base_pair(tmp_path, [2.7, 2.8, 2.6], [2.7, 2.8, 2.6], base_tokens=(100, 120, 91))
    r = compare(tmp_path)
    assert r["base_identical"] is True
    row = r["from_base"]["control"][0]
    assert row["raw"]["ci"] is None and "differ from step 0" in row["raw"]["note"]
    assert "differ from step 0: not the same batches" in (tmp_path / "compare" / "report.md").read_text()


def test_arms_that_recorded_other_settings_are_reported(tmp_path, capsys):
    """The arms' fingerprint.json: base, data and schedule (precision included) must agree; [mhar] differs by
    design. A float8 control beside a bf16 MHAR arm is named, in the summary and the report."""
    plain = parse_config(["--job.config_file", str(REPO / "configs" / "tiny_cpu.toml")])
    f8 = parse_config(
        [
            *("--job.config_file", str(REPO / "configs" / "tiny_cpu.toml")),
            *("--model.converters", "quantize.linear.float8", "--quantize.linear.float8.emulate"),
        ]
    )
    for arm in ("control", "mhar"):
        write_run(tmp_path / arm, {"train/loss": {s: 3.0 for s in range(1, 6)}})
    assert compare(tmp_path)["checks"]["recipe"] == {"identical": None, "differences": []}  # none recorded
    groups = {"base": {"init": "random"}, "data": {"seed": 0}}
    for arm, cfg in (("control", f8), ("mhar", plain)):
        model = {"mhar": {"enable": arm == "mhar"}}
        record = {**groups, "model": model, "schedule": fingerprint.schedule_group(cfg, 8)}
        (tmp_path / arm / fingerprint.FILE).write_text(json.dumps(record))
    main([str(tmp_path)])
    printed = capsys.readouterr().out
    assert "identical: lr/decay None, tokens_seen None, data None, recipe False" in printed
    assert 'schedule.precision.converters: ["quantize.linear.float8"] in control, "<absent>" in mhar' in printed
    assert (
        "| recorded settings (`fingerprint.json`: base, data, schedule, precision) | **differ**: "
        in (tmp_path / "compare" / "report.md").read_text()
    )
    (tmp_path / "control" / fingerprint.FILE).write_text((tmp_path / "mhar" / fingerprint.FILE).read_text())
    assert compare(tmp_path)["checks"]["recipe"]["identical"] is True


def test_the_report_draws_the_stage_boundaries_with_the_lr_schedule(tmp_path):
    steps = range(1, 21)
    staged = {
        **schedule(steps),
        "data/stage": {s: 1.0 if s < 16 else 2.0 for s in steps},
        "data/stage_share/web": {s: 0.7 if s < 16 else 0.2 for s in steps},
        "data/stage_share/hq": {s: 0.3 if s < 16 else 0.8 for s in steps},
    }
    data = {
        "mixture": {"web": {"weight": 7.0}, "hq": {"weight": 3.0}},
        "mixture_stages": [{"number": 2, "start": 16, "weights": {"web": 0.2, "hq": 0.8}}],
    }
    for arm in ("control", "mhar"):
        write_run(tmp_path / arm, {"train/loss": {s: 3.0 for s in steps}, **staged})
        record = {"model": {}, "base": {}, "data": data, "schedule": {}}
        (tmp_path / arm / fingerprint.FILE).write_text(json.dumps(record))
    r = compare(tmp_path)
    first, second = r["stages"]["stages"]
    assert (first["number"], first["first_step"], second["number"], second["first_step"]) == (1, 1, 2, 16)
    assert first["weights"] == {"web": 0.7, "hq": 0.3} and second["weights"] == {"web": 0.2, "hq": 0.8}
    assert second["shares"]["mhar"] == pytest.approx({"web": 0.2, "hq": 0.8})
    assert first["shares"]["control"] == pytest.approx({"web": 0.7, "hq": 0.3})  # at step 15, its last
    text = (tmp_path / "compare" / "report.md").read_text()
    assert "## Schedule and mixture stages" in text and "![LR schedule and mixture stages](schedule.png)" in text
    assert "| 2 | 16 | web 20.0%, hq 80.0% | hq 80.0%, web 20.0% | hq 80.0%, web 20.0% |" in text
    assert (tmp_path / "compare" / "schedule.png").read_bytes()[:4] == b"\x89PNG"
    assert str(tmp_path / "compare" / "schedule.png") in r["plots"]
    # a pair without stages gets the LR plot and says it had one stage
    for arm in ("control", "mhar"):
        shutil.rmtree(tmp_path / arm)
        write_run(tmp_path / arm, {"train/loss": {s: 3.0 for s in steps}, **schedule(steps)})
    assert compare(tmp_path)["stages"] is None
    assert "One mixture stage" in (tmp_path / "compare" / "report.md").read_text()


def test_per_layer_norms_are_set_side_by_side_and_the_largest_differences_named(tmp_path):
    """Both arms' norms by layer (exact in float32), the MHAR arm's routing groups on their own; the output layer's
    weight norm growing 10% faster in the MHAR arm is the largest difference, at the last step."""
    steps = range(1, 11)
    shared = {"train/loss": {s: 2.0 for s in steps}, **schedule(steps)}
    control, mhar = dict(shared), dict(shared)
    for kind, base in (("weight", 64.0), ("grad", 2.0), ("update", 0.5)):
        for group in ("embedding", "layer00", "layer01", "final_norm", "output"):
            control[f"norms_{kind}/{group}"] = {s: base for s in (1, 5, 10)}
            mhar[f"norms_{kind}/{group}"] = {s: base for s in (1, 5, 10)}
        mhar[f"norms_{kind}/routing01"] = {s: base / 8 for s in (1, 5, 10)}
    control["norms_weight/output"] = {1: 64.0, 5: 80.0, 10: 96.0}
    mhar["norms_weight/output"] = {1: 64.0, 5: 88.0, 10: 105.6}
    write_run(tmp_path / "control", control)
    write_run(tmp_path / "mhar", mhar)
    result = compare(tmp_path)
    norms = result["norms"]
    assert norms["steps"] == [1, 5, 10] and norms["last"] == 10 and norms["mhar_only"] == ["routing01"]
    first = norms["largest"][0]
    assert (first["kind"], first["group"], first["step"]) == ("weight", "output", 5)  # 88 / 80: +10%, as 105.6 / 96
    assert first["relative"] == pytest.approx(0.1, rel=1e-6) and norms["largest"][1]["relative"] == pytest.approx(0.1)
    assert norms["at_last"]["weight"]["output"] == {"control": 96.0, "mhar": f32(105.6)}
    delta = load_scalars(tmp_path / "delta")
    assert delta["delta_norms_weight/output"][10] == pytest.approx(0.1, rel=1e-6)
    assert delta["delta_norms_grad/layer01"] == {1: 0.0, 5: 0.0, 10: 0.0}
    text = (tmp_path / "compare" / "report.md").read_text()
    assert "## Per-layer norms" in text and "| weight | output | 5 | 80 | 88 | +10.00% |" in text
    assert "![per-layer norms](norms.png)" in text and (tmp_path / "compare" / "norms.png").is_file()


def test_the_speed_ratio_is_also_given_over_the_windows_where_neither_arm_had_a_straggler(tmp_path):
    """The MHAR arm's rank 3 straggled in steps 31-40 at half speed: the plain ratio carries it, the clean one not."""
    steps = range(1, 61)
    shared = {"train/loss": {s: 2.0 for s in steps}, **schedule(steps)}
    straggling = {s: float(31 <= s <= 40) for s in steps}
    control = {**shared, "tokens_per_s": {s: 1000.0 for s in steps}, "ranks/straggling": dict.fromkeys(steps, 0.0)}
    mhar = {
        **shared,
        "tokens_per_s": {s: 480.0 if straggling[s] else 960.0 for s in steps},
        "ranks/straggling": straggling,
        "ranks/stragglers_warned": {s: float(s >= 32) for s in steps},
    }
    write_run(tmp_path / "control", control)
    write_run(tmp_path / "mhar", mhar)
    tps = compare(tmp_path)["tokens_per_s"]
    assert tps["clean"] == {"windows": 50, "control": 1000.0, "mhar": 960.0, "ratio": 0.96}
    assert tps["stragglers"] == {
        "control": {"windows": 0, "of": 60, "warned": 0},
        "mhar": {"windows": 10, "of": 60, "warned": 1},
    }
    text = (tmp_path / "compare" / "report.md").read_text()
    assert "| the same over the 50 log windows where neither arm had a straggling rank | 1,000 | 960 | 0.9600 |" in text
    assert "- mhar: a rank straggled (above the median by more than `[stragglers] share`) in 10 of its 60" in text
    assert "- control: no straggling rank in its 60 log windows." in text


def test_the_arms_are_also_compared_at_equal_gpu_hours(tmp_path):
    """The MHAR arm at twice the control's GPU-hours a step: at equal compute it has made half the steps."""
    steps = range(1, 101)
    shared = schedule(steps)
    control = {**shared, "train/loss": {s: 3.0 for s in steps}, "time/gpu_hours": {s: 0.01 * s for s in steps}}
    mhar = {
        **shared,
        "train/loss": {s: 2.0 if s <= 50 else 1.0 for s in steps},
        "time/gpu_hours": {s: 0.02 * s for s in steps},
    }
    control["val/ce"] = {s: 2.0 - 0.002 * s for s in (0, 50, 100)}
    mhar["val/ce"] = {s: 2.0 - 0.002 * s - (0.01 if s else 0.0) for s in (0, 50, 100)}
    write_run(tmp_path / "control", control)
    write_run(tmp_path / "mhar", mhar)
    result = compare(tmp_path)["equal_compute"]
    assert result["hours"]["ratio"] == pytest.approx(2.0, rel=1e-6)
    quarters = result["quarters"]
    assert [q["control_steps"] for q in quarters] == [(1, 25), (26, 50), (51, 75), (76, 100)]
    assert [q["mhar_steps"] for q in quarters] == [(1, 12), (13, 25), (26, 37), (38, 50)]  # its first 50 steps
    assert all(q["delta"] == -1.0 for q in quarters)  # 2.0 against 3.0: the MHAR arm's later 1.0 is not reached
    val = {v["step"]: v for v in result["val"] if v["kind"] == "raw"}
    assert sorted(val) == [0, 50, 100] and val[0]["delta"] == 0.0
    # step 50 of the control is 0.5 GPU-hours: the MHAR arm's step 25, halfway between its validations at 0 and 50
    assert val[50]["mhar"] == pytest.approx((2.0 + 1.89) / 2, rel=1e-6) and val[50]["delta"] == pytest.approx(0.045)
    assert val[100]["mhar"] == pytest.approx(1.89, rel=1e-6) and val[100]["delta"] == pytest.approx(0.09)
    text = (tmp_path / "compare" / "report.md").read_text()
    assert "## At equal compute" in text and "| 0.76-1 | 76-100 | 3.0000 | 38-50 | 2.0000 | -1.000e+00 |" in text


def test_where_mhar_helps_is_told_by_band_with_a_paired_ci_over_the_same_batches(tmp_path):
    """Early tokens 0.05 lower in every batch: resolved; the next band +-0.01 by turns: within noise; empty bands
    left out."""
    tokens = [100, 120, 90, 110, 100, 95, 105, 115]
    base = [2.0 * t for t in tokens]

    def record(early: list[float], later: list[float]) -> dict:
        bands = {kind: {b: {"ce_sum": [0.0] * 8, "tokens": [0] * 8} for b in names} for kind, names in BANDS.items()}
        bands["position"]["0-63"] = {"ce_sum": early, "tokens": tokens}
        bands["position"]["64-255"] = {"ce_sum": later, "tokens": tokens}
        bands["doc_length"]["cut"] = {
            "ce_sum": [a + b for a, b in zip(early, later, strict=True)],
            "tokens": [2 * t for t in tokens],
        }
        entry = {"ce_sum": [a + b for a, b in zip(early, later, strict=True)], "tokens": [2 * t for t in tokens]}
        return {"sets": {"val": {"raw": {**entry, "bands": bands}}}, "raw": entry}

    steps = range(1, 11)
    for arm, early, later in (
        ("control", base, base),
        ("mhar", [b - 0.05 * t for b, t in zip(base, tokens, strict=True)],
         [b + (0.01 if i % 2 else -0.01) * t for i, (b, t) in enumerate(zip(base, tokens, strict=True))]),
    ):  # fmt: skip
        write_run(tmp_path / arm, {"train/loss": {s: 2.0 for s in steps}, **schedule(steps)})
        write_val(tmp_path / arm, 10, **record(early, later))
    result = compare(tmp_path)["bands"]
    assert result["step"] == 10
    rows = {r["band"]: r for r in result["sets"]["val"]["position"]}
    assert sorted(rows) == ["0-63", "64-255"] and rows["0-63"]["tokens"] == sum(tokens)
    assert rows["0-63"]["delta"] == pytest.approx(-0.05) and rows["0-63"]["ci"]["high"] < 0
    assert rows["64-255"]["ci"]["low"] < 0 < rows["64-255"]["ci"]["high"]
    text = (tmp_path / "compare" / "report.md").read_text()
    assert "## Where MHAR helps" in text and "| 0-63 | 835 | -5.000e-02 |" in text and "| MHAR lower |" in text
    assert "within noise |" in text


@pytest.mark.parametrize("mhar_shift, exceeds", [(-0.02, True), (-0.0005, False)])
def test_a_replicate_run_sets_mhars_delta_against_the_aa_difference(tmp_path, mhar_shift, exceeds):
    """The replicate off the control by +-0.001 a batch by turns (an A/A difference within noise): a -0.02 shift of
    the MHAR arm exceeds it, one of -0.0005 does not."""
    tokens = [100, 120, 90, 110, 100, 95, 105, 115]
    base = [2.0 * t for t in tokens]
    turns = [(0.001 if i % 2 else -0.001) * t for i, t in enumerate(tokens)]
    ce = {
        "control": base,
        "replicate": [b + d for b, d in zip(base, turns, strict=True)],
        "mhar": [b + mhar_shift * t - 0.5 * d for b, t, d in zip(base, tokens, turns, strict=True)],
    }
    steps = range(1, 21)
    for arm, sums in ce.items():
        loss = {s: 2.0 + (0.01 if arm == "replicate" else mhar_shift if arm == "mhar" else 0.0) for s in steps}
        write_run(tmp_path / arm, {"train/loss": loss, **schedule(steps)})
        write_val(tmp_path / arm, 10, raw={"ce_sum": sums, "tokens": tokens})
    result = compare(tmp_path)["replicate"]
    row = result["val"][0]
    assert row["step"] == 10 and row["raw"]["exceeds"] is exceeds and row["ema"]["exceeds"] is None
    assert row["raw"]["aa"]["ci"]["low"] < 0 < row["raw"]["aa"]["ci"]["high"]
    assert row["raw"]["mhar"]["delta"] == pytest.approx(mhar_shift + sum(-0.5 * d for d in turns) / sum(tokens))
    assert [q["aa"] for q in result["quarters"]] == pytest.approx([0.01] * 4)
    assert load_scalars(tmp_path / "delta")["aa/train_loss"][20] == pytest.approx(0.01, rel=1e-5)
    text = (tmp_path / "compare" / "report.md").read_text()
    verdict = "exceeds the A/A difference" if exceeds else "does not exceed the A/A difference"
    assert "## How sure: the A/A difference" in text and f"**At step 10, MHAR's validation delta {verdict}.**" in text


def test_several_pairs_are_pooled_with_a_ci_over_the_pairs(tmp_path, capsys):
    """Three pairs whose MHAR arm is 0.010, 0.012 and 0.014 lower at step 10: mean -0.012, a t-interval over 3."""
    tokens = [100, 120, 90, 110]
    for i, shift in enumerate((-0.010, -0.012, -0.014)):
        pair = tmp_path / f"pair-s{i}"
        for arm, d in (("control", 0.0), ("mhar", shift)):
            write_run(pair / arm, {"train/loss": {s: 2.0 for s in range(1, 11)}, **schedule(range(1, 11))})
            write_val(pair / arm, 10, raw={"ce_sum": [(2.0 + d) * t for t in tokens], "tokens": tokens})
    main([str(tmp_path / f"pair-s{i}") for i in range(3)])
    text = (tmp_path / "pooled" / "pool.md").read_text()
    assert "wrote " in capsys.readouterr().out and "# 3 pairs pooled" in text
    half = 4.302652729911275 * 0.002 / math.sqrt(3)  # t(0.975, 2 df) x sd / sqrt(n)
    assert f"**raw: mean {-0.012:+.3e}, 95% CI over 3 pairs [{-0.012 - half:+.3e}, {-0.012 + half:+.3e}]" in text
    assert "MHAR lower" in text
