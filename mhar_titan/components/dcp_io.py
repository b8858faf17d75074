"""Reading a DCP checkpoint on several threads.

DCP's file system reader takes the records one after another: each goes through torch.load and then a
pageable copy to its tensor's device. One thread does that at about a gigabyte a second
(docs/performance.md), which at one GPU's 45 GB share is most of a resume's start and of each export's read.
`ParallelFileSystemReader` runs torch's own reader over several parts of the load plan at once, the
tensor records shared out by size, so every tensor receives the same bytes as with one thread; the
non-tensor records (data loader, counters) are read first, in the calling thread.
"""

from __future__ import annotations

import dataclasses
import os
from concurrent.futures import ThreadPoolExecutor

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

READ_THREADS = 8


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
            part.sort(key=lambda r: (self.storage_data[r.storage_index].relative_path,
                                     self.storage_data[r.storage_index].offset))  # fmt: skip
        read = super().read_data
        with ThreadPoolExecutor(max_workers=max(1, len(parts)), thread_name_prefix="dcp-read") as pool:
            futures = [pool.submit(read, dataclasses.replace(plan, items=part), planner) for part in parts]
            for f in futures:  # the first failure raises, after every thread has stopped
                f.result().wait()
        done: Future[None] = Future()
        done.set_result(None)
        return done
