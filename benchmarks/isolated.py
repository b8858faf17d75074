"""One measurement per fresh process: what a benchmark times starts as a job's rank starts, with no cache, loaded
module or thread pool of an earlier measurement warm."""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from multiprocessing.context import BaseContext
from typing import Any, TypeVar

T = TypeVar("T")


def forkserver(preload: list[str]) -> BaseContext:
    """The forkserver context, its server importing `preload` once (a measurement process forks from it)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(preload)
    return ctx


def _start_workers_with(method: str) -> None:
    """A measurement process starts its loader workers as a training rank would (the forkserver's
    children would otherwise use the forkserver for them too)."""
    multiprocessing.set_start_method(method, force=True)


def isolated(ctx: BaseContext, fn: Callable[..., T], *args: Any) -> T:
    """fn(*args) in a process of its own, forked from the forkserver (which never tokenised or read a shard)."""
    method = multiprocessing.get_start_method()
    with ProcessPoolExecutor(
        1, mp_context=ctx, initializer=_start_workers_with, initargs=(method,), max_tasks_per_child=1
    ) as pool:
        return pool.submit(fn, *args).result()
