"""The threaded DCP reader: the same bytes in every tensor as torch's reader, its work spread over threads."""

import threading

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from benchmarks import bench_checkpoint_io
from mhar_titan.components.checkpoint.checksums import without_torch_crc32
from mhar_titan.components.checkpoint.dcp_io import (
    STAGE_MIN_BYTES,
    ParallelFileSystemReader,
    PinnedStaging,
    StreamingFileSystemWriter,
    share_by_size,
)
from mhar_titan.components.checkpoint.manager import DataOnlyLoadPlanner


def _state() -> dict:
    gen = torch.Generator().manual_seed(0)
    tensors = {f"layers.{i}.w": torch.randn(3 + 7 * i, 5 + i, generator=gen) for i in range(9)}
    return {
        "model": {**tensors, "bf16": torch.randn(33, generator=gen).to(torch.bfloat16), "ids": torch.arange(11)},
        "step": 17,
        "dataloader": {"stream_00000": "position 12", "betas": (0.9, 0.95)},
    }


def _empty_like(state: dict) -> dict:
    return {
        "model": {k: torch.zeros_like(v) for k, v in state["model"].items()},
        "step": 0,
        "dataloader": {"stream_00000": "", "betas": (0.0, 0.0)},
    }


class ThreadRecorder(DataOnlyLoadPlanner):
    """Each reading thread waits at its first record until `parties` threads are there: records read one thread
    after another would time out instead."""

    def __init__(self, parties: int) -> None:
        super().__init__()
        self.threads: set[str] = set()
        self.barrier = threading.Barrier(parties, timeout=30)

    def resolve_tensor(self, read_item):
        name = threading.current_thread().name
        if name not in self.threads:
            self.threads.add(name)
            self.barrier.wait()
        return super().resolve_tensor(read_item)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "step-3"
    state = _state()
    with without_torch_crc32():  # as our checkpoint manager saves
        dcp.save(state, checkpoint_id=str(path), no_dist=True)
    return path, state


@pytest.mark.parametrize("threads", [1, 3, 8, 64])
def test_parallel_reader_loads_what_torch_reader_loads_bit_for_bit(saved, threads):
    path, state = saved
    stock, ours = _empty_like(state), _empty_like(state)
    dcp.load(stock, checkpoint_id=str(path), planner=DataOnlyLoadPlanner(), no_dist=True)
    planner = ThreadRecorder(min(threads, len(state["model"])))
    dcp.load(ours, storage_reader=ParallelFileSystemReader(path, threads), planner=planner, no_dist=True)
    for key, value in state["model"].items():
        assert ours["model"][key].dtype == value.dtype
        assert torch.equal(ours["model"][key], value) and torch.equal(ours["model"][key], stock["model"][key]), key
    assert ours["step"] == stock["step"] == 17
    assert ours["dataloader"] == stock["dataloader"] == {"stream_00000": "position 12", "betas": (0.9, 0.95)}
    assert len(planner.threads) == min(threads, len(state["model"]))  # read at once, each thread some records
    assert all(name.startswith("dcp-read") for name in planner.threads)


def test_parallel_reader_casts_and_moves_as_torch_reader_does(saved):
    """Exports read fp32 records into bf16 tensors: the cast happens in the copy, the same either way."""
    path, state = saved
    want = {k: torch.empty(v.shape, dtype=torch.bfloat16) for k, v in state["model"].items() if v.is_floating_point()}
    stock = {k: torch.empty_like(v) for k, v in want.items()}
    dcp.load({"model": stock}, checkpoint_id=str(path), no_dist=True)
    dcp.load({"model": want}, storage_reader=ParallelFileSystemReader(path, 4), no_dist=True)
    assert all(torch.equal(want[k], stock[k]) for k in want)
    assert torch.equal(want["layers.8.w"], state["model"]["layers.8.w"].to(torch.bfloat16))


def test_a_damaged_file_fails_the_load_as_with_torch_reader(tmp_path):
    state = _state()
    dcp.save(state, checkpoint_id=str(tmp_path), no_dist=True)
    data = tmp_path / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    with pytest.raises(CheckpointException):
        dcp.load(_empty_like(state), checkpoint_id=str(tmp_path), no_dist=True)
    with pytest.raises(CheckpointException):
        dcp.load(_empty_like(state), storage_reader=ParallelFileSystemReader(tmp_path, 4), no_dist=True)


def test_records_are_shared_by_size_each_once():
    items = [f"r{i}" for i in range(10)]
    sizes = [100, 1, 1, 1, 1, 50, 50, 30, 20, 1]
    parts = share_by_size(items, sizes, 3)
    assert sorted(x for p in parts for x in p) == sorted(items)
    loads = sorted(sum(sizes[items.index(x)] for x in p) for p in parts)
    assert loads == [75, 80, 100]  # the largest alone, each next one to the lightest part
    assert share_by_size(items[:2], sizes[:2], 8) == [["r0"], ["r1"]]  # no empty parts
    assert share_by_size([], [], 4) == []
    with pytest.raises(ValueError, match="threads = 0"):
        ParallelFileSystemReader("anywhere", 0)


def test_a_staged_buffer_is_reused_only_once_nothing_holds_it():
    staging = PinnedStaging(pin=False)
    a, b, c = (torch.full((512, 600), float(i)) for i in range(3))
    first = staging.stage(a)
    second = staging.stage(b)  # `first` is still held: another buffer
    assert first.data_ptr() != second.data_ptr()
    assert torch.equal(first, a) and torch.equal(second, b)
    view = second[3:]  # a view holds the buffer as the copy does
    first_ptr, second_ptr = first.data_ptr(), second.data_ptr()
    del first, second
    third = staging.stage(c)
    assert third.data_ptr() == first_ptr and torch.equal(third, c)
    assert torch.equal(view, b[3:])  # untouched while held
    del view
    assert staging.stage(a).data_ptr() == second_ptr
    assert staging.nbytes == 2 * a.nbytes
    other = staging.stage(torch.ones(600, 512))  # another shape: its own buffer
    assert other.shape == (600, 512) and staging.nbytes == 3 * a.nbytes


class CpuStagingWriter(StreamingFileSystemWriter):
    """Stages CPU tensors too, so that the staging runs on a machine without a GPU."""

    def stages(self, data: torch.Tensor) -> bool:
        return data.numel() * data.element_size() >= STAGE_MIN_BYTES


def test_a_staged_save_writes_the_same_bytes_and_reuses_its_buffers(tmp_path):
    gen = torch.Generator().manual_seed(1)
    big = {f"layers.{i}.w": torch.randn(700, 400, generator=gen) for i in range(5)}  # 1.1 MB each: staged
    view = torch.randn(900, 400, generator=gen)[100:]  # a view's own bytes only
    state = {"model": {**big, "view": view, "norm": torch.randn(64, generator=gen)}, "step": 3, "opt": {"lr": 0.1}}
    staging = PinnedStaging(pin=False)
    with without_torch_crc32():
        dcp.save(state, checkpoint_id=str(tmp_path / "plain"), no_dist=True)
        writer = CpuStagingWriter(str(tmp_path / "staged"), staging)
        dcp.save(state, storage_writer=writer, checkpoint_id=str(tmp_path / "staged"), no_dist=True)
    # the data file byte for byte as torch's writer (.metadata carries each save's own id)
    assert (tmp_path / "plain" / "__0_0.distcp").read_bytes() == (tmp_path / "staged" / "__0_0.distcp").read_bytes()
    assert staging.nbytes == big["layers.0.w"].nbytes + view.nbytes  # five tensors through one buffer
    back = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}, "step": 0, "opt": {"lr": 0.0}}
    dcp.load(back, checkpoint_id=str(tmp_path / "staged"), planner=DataOnlyLoadPlanner(), no_dist=True)
    assert back["step"] == 3 and back["opt"]["lr"] == 0.1
    assert all(torch.equal(back["model"][k], v) for k, v in state["model"].items())


def test_the_checkpoint_io_bench_runs_every_writer_and_checks_what_it_loads(tmp_path, capsys):
    main = bench_checkpoint_io.main
    main(["--gib", "0.01", "--tensor-mib", "2", "--threads", "1,2", "--readers", "2", "--dir", str(tmp_path / "c")])
    rows = capsys.readouterr().out.splitlines()
    names = [r.split("  ")[0] for r in rows[2:]]
    assert names == ["CRC32 (torch's default)"] * 2 + ["no CRC32"] * 4 + ["ours, save 1"] * 2 + ["ours, save 2"] * 2
    main(["--d2h", "--tensor-mib", "2", "--dir", str(tmp_path / "d")])
    assert "write to" in capsys.readouterr().out and not list((tmp_path / "d").iterdir())
