"""HF exports on object storage (a real S3 server, moto's, through s3fs): the bytes of the same export on disk,
read back; a prefix already used, or left by a killed export, is refused in one line before any work."""

import json
import subprocess
import sys

import pytest
from s3_server import SERVERS, s3_server
from tiny_runs import write_tiny_run

from data.atomic import HOST
from mhar_titan.hf import __main__ as hf_cli
from mhar_titan.hf.files import EXPORTING
from mhar_titan.hf.load import load_hf_model
from mhar_titan.model.args import MHAR


@pytest.fixture(scope="module", params=SERVERS)
def s3(request):
    with s3_server(request.param) as fs:
        fs.mkdir("exports")
        yield fs


@pytest.mark.parametrize("enable", [False, True], ids=["control", "mhar"])
def test_an_export_to_s3_holds_the_bytes_of_the_same_export_on_disk_and_reads_back(s3, tmp_path, enable, capsys):
    run, local, back, url = tmp_path / "run", tmp_path / "local", tmp_path / "back", f"s3://exports/{enable}/step-4"
    mhar = MHAR(enable=True, num_blocks=2, backend="torch") if enable else MHAR(enable=False)
    write_tiny_run(run, tmp_path / "no-base", mhar, seed=1, step=4)
    hf_cli.main(["export", str(run), str(local), "--dtype", "fp32"])
    hf_cli.main(["export", str(run), url, "--dtype", "fp32"])
    names = sorted(p.name for p in local.iterdir())
    assert f"uploaded {len(names)} files to {url}" in capsys.readouterr().out
    assert sorted(s3.ls(url, refresh=True)) == [f"{url[5:]}/{n}" for n in names]  # and no marker left
    s3.get(f"{url}/", f"{back}/", recursive=True)
    for name in names:
        assert (back / name).read_bytes() == (local / name).read_bytes(), name
    ours, theirs = (dict(load_hf_model(str(p)).named_parameters()) for p in (local, back))
    assert all((ours[k] == theirs[k]).all() for k in ours) and ours.keys() == theirs.keys()


def test_an_export_to_a_used_or_unfinished_prefix_is_refused_in_one_line(s3, tmp_path):
    run = tmp_path / "run"
    write_tiny_run(run, tmp_path / "no-base", MHAR(enable=False), seed=0, step=4)
    s3.pipe("exports/used/config.json", b"{}")
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    owner = {"pid": int(gone.stdout), "host": HOST, "started": "2026-12-06T00:00:00Z"}
    s3.pipe(f"exports/killed/{EXPORTING}", json.dumps(owner).encode())
    for url, message in [
        ("s3://exports/used", "s3://exports/used already exists (1 entries, e.g. config.json); export into a new"),
        (
            "s3://exports/killed",
            f"s3://exports/killed: left incomplete by a killed hf export (PID {owner['pid']} on "
            f"host {HOST}, started 2026-12-06T00:00:00Z); delete s3://exports/killed and export "
            "again",
        ),
        ("s3://no-such-bucket/out", "s3://no-such-bucket/out"),
    ]:
        with pytest.raises(SystemExit) as stop:
            hf_cli.main(["export", str(run), url])
        assert str(stop.value).startswith("python -m mhar_titan.hf export: ") and message in str(stop.value)
        assert "\n" not in str(stop.value)
    assert s3.ls("exports/killed", refresh=True) == [f"exports/killed/{EXPORTING}"]  # nothing written
