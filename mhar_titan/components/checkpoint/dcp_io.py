"""Reading a DCP checkpoint on several threads, and saving one through reused page-locked buffers.

DCP's file system reader takes the records one after another: each goes through torch.load and then a
pageable copy to its tensor's device. One thread does that at about a gigabyte a second
(docs/performance.md), which at one GPU's 45 GB share is most of a resume's start and of each export's read.
`ParallelFileSystemReader` runs torch's own reader over several parts of the load plan at once, the
tensor records shared out by size, so every tensor receives the same bytes as with one thread; the
non-tensor records (data loader, counters) are read first, in the calling thread.

A save: torch's file system writer copies each GPU tensor into fresh page-locked host memory and keeps every
copy until its file is closed, so one rank's save held its whole share (45 GB on the preflight's GPU) in newly
allocated page-locked memory, and the allocation cost about as much as the writes (docs/performance.md).
`StreamingFileSystemWriter` writes each record as soon as it is copied and lets it go; large GPU tensors are
copied into page-locked buffers of their shape that `PinnedStaging` keeps from save to save. The files are
DCP's own format, read by any DCP reader.
"""

from __future__ import annotations

import dataclasses
import io
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX as _DCP_SUFFIX
from torch.distributed.checkpoint.filesystem import _write_item
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

READ_THREADS = 8
STAGE_MIN_BYTES = 1 << 20  # smaller tensors take DCP's own path: the host allocator's cache serves them


def share_by_size(items: list[ReadItem], sizes: list[int], parts: int) -> list[list[ReadItem]]:
    """`items` in at most `parts` lists of nearly equal bytes (largest first, each to the lightest list)."""
    loads, lists = [0] * parts, [[] for _ in range(parts)]
    for size, item in sorted(zip(sizes, items, strict=True), key=lambda pair: pair[0], reverse=True):
        i = loads.index(min(loads))
        loads[i] += size
        lists[i].append(item)
    return [x for x in lists if x]


class ParallelFileSystemReader(dcp.FileSystemReader):
    """torch's FileSystemReader with its tensor reads on `threads` threads."""

    def __init__(self, path: str | os.PathLike, threads: int = READ_THREADS):
        if threads < 1:
            raise ValueError(f"threads = {threads}: at least 1")
        super().__init__(path)
        self.threads = threads

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        objects = [r for r in plan.items if r.type == LoadItemType.BYTE_IO]
        tensors = [r for r in plan.items if r.type != LoadItemType.BYTE_IO]
        if objects:
            super().read_data(dataclasses.replace(plan, items=objects), planner).wait()
        where = [self.storage_data[r.storage_index] for r in tensors]
        parts = share_by_size(tensors, [w.length for w in where], self.threads)
        for part in parts:  # each thread reads its records in file order
            part.sort(
                key=lambda r: (
                    self.storage_data[r.storage_index].relative_path,
                    self.storage_data[r.storage_index].offset,
                )
            )
        read = super().read_data
        with ThreadPoolExecutor(max_workers=max(1, len(parts)), thread_name_prefix="dcp-read") as pool:
            futures = [pool.submit(read, dataclasses.replace(plan, items=part), planner) for part in parts]
            for f in futures:  # the first failure raises, after every thread has stopped
                f.result().wait()
        done: Future[None] = Future()
        done.set_result(None)
        return done


def _users(storage: torch.UntypedStorage) -> int:
    """How many tensors (and storage objects) hold this storage: a copy handed to DCP, or a view of it, counts."""
    return torch._C._storage_Use_Count(storage._cdata)


class PinnedStaging:
    """Host buffers, one set per (shape, dtype), reused from save to save. Each `stage` returns a new tensor on
    a buffer that nothing else holds, so a buffer is never overwritten while DCP still has to write it."""

    def __init__(self, pin: bool | None = None):
        self.pin = torch.cuda.is_available() if pin is None else pin
        self._buffers: dict[tuple, list[tuple[torch.Tensor, torch.UntypedStorage, int]]] = {}
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for entries in self._buffers.values() for b, _, _ in entries)

    def stage(self, tensor: torch.Tensor) -> torch.Tensor:
        with self._lock:
            entries = self._buffers.setdefault((tuple(tensor.shape), tensor.dtype), [])
            free = [b for b, storage, idle in entries if _users(storage) == idle]
            if free:
                buf = free[0]
            else:
                buf = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=self.pin)
                storage = buf.untyped_storage()
                entries.append((buf, storage, _users(storage)))
            staged = buf.detach()  # holds the storage until DCP has written it and let it go
        staged.copy_(tensor)
        return staged


class StreamingFileSystemWriter(dcp.FileSystemWriter):
    """torch's FileSystemWriter (one file per rank), writing each record as soon as it is copied and letting it
    go: torch's own loop (torch/distributed/checkpoint/filesystem.py, _write_files_from_queue) keeps every
    tensor it wrote until the file is closed, so a save held the rank's whole share in fresh page-locked host
    memory. Device tensors of at least STAGE_MIN_BYTES go through `staging`. Records are written in the plan's
    order, the byte records first, as torch's one-thread writer on a machine without a GPU does."""

    def __init__(self, path: str | os.PathLike, staging: PinnedStaging):
        super().__init__(path, single_file_per_rank=True, thread_count=1)
        self.staging = staging

    def stages(self, data: torch.Tensor) -> bool:
        return data.device.type not in ("cpu", "meta") and data.numel() * data.element_size() >= STAGE_MIN_BYTES

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        storage_key = f"{plan.storage_data.prefix}0{_DCP_SUFFIX}"
        path = self.fs.concat_path(self.path, storage_key)
        objects = [w for w in plan.items if w.type == WriteItemType.BYTE_IO]
        tensors = [w for w in plan.items if w.type != WriteItemType.BYTE_IO]
        results = []
        with self.fs.create_stream(path, "wb") as stream:
            for item in objects + tensors:
                data = planner.resolve_data(item)
                if isinstance(data, torch.Tensor):
                    data = self.staging.stage(data) if self.stages(data) else data.detach().cpu()
                    if data.untyped_storage().size() != data.nbytes:  # a view: its own bytes only
                        data = data.clone()
                results.append(_write_item(self.transforms, stream, data, item, storage_key, self.serialization_format))
                del data
            if self.sync_files:
                stream.flush()
                try:
                    os.fsync(stream.fileno())
                except (AttributeError, io.UnsupportedOperation):  # as torch's writer: a stream without a file
                    os.sync()
        done: Future[list[WriteResult]] = Future()
        done.set_result(results)
        return done
