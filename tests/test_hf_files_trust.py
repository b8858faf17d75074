"""What the HF tools and data preparation leave on disk, and what they refuse: file modes of an export
and `hf init`, safetensors files whose size differs from their header, an existing `hf init` output
refused before any work, stale temporary folders of killed runs cleaned by the next run, and an
export's tokenizer files from a base folder that holds no weights."""

import json
import os
import stat
import subprocess
import sys

import pytest
import torch
from conftest import REPO
from tiny_runs import write_tiny_run

from data import atomic, prepare
from mhar_titan.components.checkpoint.checksums import write_manifest
from mhar_titan.hf import __main__ as hf_cli
from mhar_titan.hf import export as hf_export
from mhar_titan.hf import run as hf_run
from mhar_titan.hf.export import init_hf
from mhar_titan.hf.ledger import build_ledger, checkpoint_files
from mhar_titan.hf.load import model_shapes
from mhar_titan.hf.run import export_run
from mhar_titan.model.args import FLAVORS, MHAR
from mhar_titan.model.hf_config import hf_config_from_model_args
from mhar_titan.model.model import MHARTransformer
from mhar_titan.model.state_dict_adapter import MHARStateDictAdapter

TINY_ASSETS = REPO / "assets" / "tiny"
HOST = atomic.HOST  # as the writers name it


def _dead_pid() -> int:
    """The PID of a child that has exited and been reaped: no process has it (PIDs are handed out in
    sequence, a reuse needs pid_max more processes first)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _modes(folder):
    """{path relative to folder: permission bits} of the folder and everything below it."""
    out = {".": stat.S_IMODE(os.stat(folder).st_mode)}
    for root, dirs, files in os.walk(folder):
        for name in dirs + files:
            path = os.path.join(root, name)
            out[os.path.relpath(path, folder)] = stat.S_IMODE(os.stat(path).st_mode)
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny base from `hf init` (one shard with an index) and a run's checkpoint that names it."""
    root = tmp_path_factory.mktemp("trust")
    init_hf(str(root / "base"), "tiny", tokenizer_dir=str(TINY_ASSETS))
    write_tiny_run(root / "run", root / "base", MHAR(enable=False), seed=1, step=2)
    write_manifest(str(root / "run" / "checkpoint" / "step-2"), 0)
    return root


# -- 1. modes --------------------------------------------------------------------------------------


@pytest.mark.parametrize("mask", [0o022, 0o027], ids=["umask022", "umask027"])
def test_export_and_init_write_every_file_with_the_mode_open_would_give(tiny, tmp_path, mask):
    old = os.umask(mask)
    try:
        init_hf(str(tmp_path / "init"), "tiny", tokenizer_dir=str(TINY_ASSETS))
        export_run(str(tiny / "run"), str(tmp_path / "export"), dtype=torch.float32, log=lambda _: None)
    finally:
        os.umask(old)
    for out in ("init", "export"):
        modes = _modes(tmp_path / out)
        assert {"tokenizer.json", "config.json", "model-00001-of-00001.safetensors"} <= modes.keys()
        want = {name: (0o777 if name == "." else 0o666) & ~mask for name in modes}
        assert modes == want, out


# -- 2. safetensors files whose size is not what their header describes ---------------------------


def test_a_truncated_or_padded_safetensors_file_is_refused_by_inspect_and_the_ledger(tiny, tmp_path):
    base = tmp_path / "base"
    init_hf(str(base), "tiny")
    shard = base / "model-00001-of-00001.safetensors"
    data = shard.read_bytes()
    expected = None
    args = FLAVORS["tiny"]
    with torch.device("meta"):
        shapes = model_shapes(MHARTransformer(args))
    for size in (len(data) // 2, len(data) + 3):
        shard.write_bytes(data[:size] if size < len(data) else data + b"\0\0\0")
        why = "truncated or still being copied" if size < len(data) else "bytes after the last tensor's data"
        expected = f"{shard}: {size:,} bytes, the header describes {len(data):,}: {why}"
        with pytest.raises(SystemExit) as stop:
            hf_cli.main(["inspect", str(base)])
        assert str(stop.value) == f"python -m mhar_titan.hf inspect: {expected}"  # one line, exit 1
        with pytest.raises(ValueError) as raised:  # what the trainer's HF base load checks before reading
            build_ledger(str(base), shapes, MHARStateDictAdapter(args, str(base)))
        assert str(raised.value) == expected
    # one unsharded model.safetensors: its keys come from the header, so it is checked there too
    os.remove(base / "model.safetensors.index.json")
    single = base / "model.safetensors"
    os.rename(shard, single)
    single.write_bytes(data[:-1])
    with pytest.raises(ValueError) as raised:
        checkpoint_files(str(base))
    assert str(raised.value) == (
        f"{single}: {len(data) - 1:,} bytes, the header describes {len(data):,}: truncated or still being copied"
    )
    assert expected is not None


# -- 3. `hf init` into an existing folder ----------------------------------------------------------


def test_init_refuses_an_existing_output_before_any_work(tmp_path, monkeypatch):
    def no_work(*args, **kwargs):
        raise AssertionError("a model was built for an output that exists")

    monkeypatch.setattr(hf_export, "build_initialised", no_work)
    out = tmp_path / "base"
    out.mkdir()
    with pytest.raises(FileExistsError, match=f"^{out} already exists; write into a new directory$"):
        init_hf(str(out), "tiny")
    with pytest.raises(SystemExit) as stop:
        hf_cli.main(["init", str(out), "--flavor", "tiny"])
    assert str(stop.value) == f"python -m mhar_titan.hf init: {out} already exists; write into a new directory"
    assert os.listdir(tmp_path) == ["base"]  # nothing written beside it


# -- 4. temporary folders left by killed runs -------------------------------------------------------


def test_export_removes_only_its_own_outputs_temporary_folders_left_by_gone_processes(tiny, tmp_path, monkeypatch):
    dead, alive = _dead_pid(), os.getppid()  # pytest's parent runs while the test does
    parent = tmp_path / "exports"
    names = {
        "stale": f".model.export-{dead}@{HOST}",  # ours, its writer gone: removed
        "running": f".model.export-{alive}@{HOST}",  # ours, its writer alive: kept
        "elsewhere": f".model.export-{dead}@other-node.cluster",  # another host: kept, mentioned
        "other": f".model-b.export-{dead}@{HOST}",  # another output's: not touched
        "legacy": ".export-qrst6789",  # no owner recorded: not touched
    }
    for name in names.values():
        (parent / name).mkdir(parents=True)
        (parent / name / "model-00001-of-00002.safetensors").write_bytes(b"partial")
    (parent / f".model.export-{os.getppid()}@{HOST}.x").write_text("not a name of ours")
    seen = []
    write_index = hf_run.write_index

    def spy(tmp, *args):  # the temporary folder of the running export, while it writes
        seen.append(os.path.basename(tmp))
        write_index(tmp, *args)

    monkeypatch.setattr(hf_run, "write_index", spy)
    lines = []
    export_run(str(tiny / "run"), str(parent / "model"), log=lines.append)
    left = sorted(os.listdir(parent))
    assert left == sorted(
        ["model", f".model.export-{os.getppid()}@{HOST}.x", *(v for k, v in names.items() if k != "stale")]
    )
    assert seen == [f".model.export-{os.getpid()}@{HOST}"]  # this process's, named for the output, host and PID
    removed = [line for line in lines if "removed" in line]
    assert removed == [
        f"removed {parent / names['stale']}: a temporary folder of an export to {parent / 'model'} "
        f"left by PID {dead} on this host, which is gone"
    ]
    assert any(str(parent / names["elsewhere"]) in line and "other-node.cluster" in line for line in lines)
    assert any(str(parent / names["running"]) in line and f"PID {alive}" in line for line in lines)
    assert not any(names["other"] in line or names["legacy"] in line for line in lines)


def test_prepare_removes_only_its_own_outputs_temporary_folders_left_by_gone_processes(tmp_path, capsys):
    dead, alive = _dead_pid(), os.getppid()  # pytest's parent runs while the test does
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"text": f"document {i}"}) + "\n" for i in range(4)))
    names = {
        "stale": f".shards.partial-{dead}@{HOST}",
        "stale_old": f".shards.old-{dead}@{HOST}",
        "own_pid": f".shards.partial-{os.getpid()}@{HOST}",  # an earlier process that had this PID: stale
        "running": f".shards.partial-{alive}@{HOST}",
        "elsewhere": f".shards.partial-{dead}@other-node",
        "other": f".shards2.partial-{dead}@{HOST}",
        "legacy": f".shards.partial-{dead}",
    }
    for name in names.values():
        (tmp_path / name).mkdir()
        (tmp_path / name / "shard-00000.parquet").write_bytes(b"partial")
    (tmp_path / "shards").mkdir()  # an earlier output: the .old- folder is what replacing it left behind
    assert prepare.main([str(tmp_path / "shards"), str(tmp_path / "in.jsonl"), "--overwrite"]) == 0
    left = sorted(p.name for p in tmp_path.iterdir())
    keep = [v for k, v in names.items() if k not in ("stale", "stale_old", "own_pid")]
    assert left == sorted(["in.jsonl", "shards", *keep])
    err = capsys.readouterr().err
    what = f"a temporary folder of python -m data.prepare {tmp_path / 'shards'}"
    for key in ("stale", "stale_old"):
        assert f"removed {tmp_path / names[key]}: {what} left by PID {dead} on this host, which is gone" in err
    own = f"left by PID {os.getpid()} on this host, an earlier process with this PID"
    assert f"removed {tmp_path / names['own_pid']}: {what} {own}" in err
    assert str(tmp_path / names["elsewhere"]) in err and "other-node" in err
    assert str(tmp_path / names["running"]) in err and f"PID {alive}" in err
    assert names["other"] not in err and f"{names['legacy']}:" not in err


# -- 5. tokenizer files from a base folder without weights -----------------------------------------


def test_export_copies_the_tokenizer_from_a_base_without_weights_and_warns_only_about_what_is_missing(tmp_path):
    run = tmp_path / "run"
    write_tiny_run(run, TINY_ASSETS, MHAR(enable=False), seed=2, step=2)  # configs/tiny_cpu.toml's base
    write_manifest(str(run / "checkpoint" / "step-2"), 0)
    lines = []
    export_run(str(run), str(tmp_path / "out"), dtype=torch.float32, log=lines.append)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "out" / name).read_bytes() == (TINY_ASSETS / name).read_bytes(), name
    assert not [line for line in lines if line.startswith("warning")], lines
    want = hf_config_from_model_args(FLAVORS["tiny"], torch.float32)
    assert json.loads((tmp_path / "out" / "config.json").read_text()) == want

    # a base folder that has gone: named, with what the export lacks because of it
    write_tiny_run(tmp_path / "run2", tmp_path / "gone", MHAR(enable=False), seed=2, step=2)
    lines = []
    export_run(str(tmp_path / "run2"), str(tmp_path / "out2"), verify=False, log=lines.append)
    assert [line for line in lines if line.startswith("warning")] == [
        f"warning: the run's base {tmp_path / 'gone'} is not there: the export gets no tokenizer files"
    ]
    # a base folder without tokenizer.json: that file is named
    (tmp_path / "bare").mkdir()
    write_tiny_run(tmp_path / "run3", tmp_path / "bare", MHAR(enable=False), seed=2, step=2)
    lines = []
    export_run(str(tmp_path / "run3"), str(tmp_path / "out3"), verify=False, log=lines.append)
    assert [line for line in lines if line.startswith("warning")] == [
        f"warning: the run's base {tmp_path / 'bare'} has no tokenizer.json: the export gets no tokenizer"
    ]
    # a base whose config.json describes another model (only its tokenizer was used): not copied as the export's
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps(hf_config_from_model_args(FLAVORS["marin8b"], torch.bfloat16)))
    (other / "tokenizer.json").write_bytes((TINY_ASSETS / "tokenizer.json").read_bytes())
    write_tiny_run(tmp_path / "run4", other, MHAR(enable=False), seed=2, step=2)
    lines = []
    export_run(str(tmp_path / "run4"), str(tmp_path / "out4"), dtype=torch.float32, verify=False, log=lines.append)
    assert json.loads((tmp_path / "out4" / "config.json").read_text()) == want
    assert (tmp_path / "out4" / "tokenizer.json").is_file()
    why = f"{other}/config.json describes another model (dim 4096 there, 256 in the export;"
    assert f"config.json from the run's model arguments: {why}" in "\n".join(lines)
