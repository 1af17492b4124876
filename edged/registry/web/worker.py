"""Where the dashboard's pages are read and rendered: a process of their own, or the registry's threads.

A fleet page over 10,000 devices is hundreds of milliseconds of Python. Run in the registry's
process, that time holds the interpreter lock the event loop needs to answer device polls,
and each poll waits for the lock by switch intervals: with only 200 devices one open fleet
page took the device poll p99 from 6 to 49 ms (bench/dashboard_cost.py). In a child
process the two share only the cores, which the kernel divides finely, and the registry's
process does nothing for a page but check the session and pass bytes on.

The child is started (``spawn``: the registry has threads) on the first page an operator
asks for or at a login, so that a registry nobody looks at pays nothing; it reads through
its own read-only engine, keeps the shared reads that open pages reuse, ends with the
registry or when its parent is gone, and is started again if it dies.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import signal
import threading
import time
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Protocol

from fastapi.concurrency import run_in_threadpool

from edged.errors import ErrorCode
from edged.registry.service import RegistryError
from edged.registry.web.pages import PageAsk, Pages, Rendered

log = logging.getLogger(__name__)


class PageRenderer(Protocol):
    async def render(self, ask: PageAsk) -> Rendered: ...

    def warm(self) -> None: ...

    def close(self) -> None: ...


class InProcess:
    """Pages rendered in the registry's own thread pool (``dashboard_process = false``)."""

    def __init__(self, pages: Pages) -> None:
        self.pages = pages

    async def render(self, ask: PageAsk) -> Rendered:
        return await run_in_threadpool(self.pages.render, ask)

    def warm(self) -> None:
        pass

    def close(self) -> None:
        pass


class PageProcess:
    """Pages rendered in one child process, asked for without blocking the event loop."""

    def __init__(self, database_url: str, *, poll_s: float, online_s: float) -> None:
        self._args = (database_url, poll_s, online_s)
        self._lock = threading.Lock()
        self._pool: ProcessPoolExecutor | None = None
        self._closed = False

    def _executor(self) -> ProcessPoolExecutor:
        with self._lock:
            if self._closed:
                raise RegistryError("the registry is stopping", 503, ErrorCode.UNAVAILABLE)
            if self._pool is None:
                self._pool = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"),
                                                 initializer=_child_start, initargs=(*self._args, os.getpid()))
            return self._pool

    def _drop(self, pool: ProcessPoolExecutor) -> None:
        with self._lock:
            if self._pool is pool:
                self._pool = None
        pool.shutdown(wait=False, cancel_futures=True)

    def warm(self) -> None:
        """Start the child now (a login: the first page follows)."""
        with contextlib.suppress(RegistryError, RuntimeError):
            self._executor().submit(_child_ready)

    async def render(self, ask: PageAsk) -> Rendered:
        try:
            return await self._submit(ask)
        except BrokenProcessPool:
            # the child died (killed, out of memory): the ask goes once more, to a new one
            log.warning("the dashboard's page process ended; starting another")
        try:
            return await self._submit(ask)
        except BrokenProcessPool:
            raise RegistryError("the dashboard's page process failed twice; see the registry's log", 503,
                                ErrorCode.UNAVAILABLE) from None

    async def _submit(self, ask: PageAsk) -> Rendered:
        pool = self._executor()  # 503 once the registry is stopping
        try:
            fut: Future[Rendered] = pool.submit(_child_render, ask)
        except RuntimeError:  # broken, or shut down by a concurrent ask that found it broken
            self._drop(pool)
            raise BrokenProcessPool("the dashboard's page process is gone") from None
        try:
            return await asyncio.wrap_future(fut)
        except BrokenProcessPool:
            self._drop(pool)
            raise

    def pid(self) -> int:
        """The child's process id, starting it if needed (for logs and tests)."""
        return self._executor().submit(os.getpid).result(timeout=120)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)


# ---- in the child -----------------------------------------------------------------------------------
_pages: Pages | None = None


def _child_start(database_url: str, poll_s: float, online_s: float, parent: int) -> None:
    global _pages
    from edged.registry.db import make_engine, make_sessionmaker, readonly
    from edged.registry.desired import SnapshotCache

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C reaches the registry, which ends this child
    engine = readonly(make_engine(database_url))
    _pages = Pages(make_sessionmaker(engine), SnapshotCache(), poll_s=poll_s, online_s=online_s)
    threading.Thread(target=_orphan_watch, args=(parent,), name="parent-watch", daemon=True).start()


def _orphan_watch(parent: int) -> None:
    """End the child when the registry is gone without saying so (killed)."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(0)


def _child_ready() -> bool:
    return _pages is not None


def _child_render(ask: PageAsk) -> Rendered:
    assert _pages is not None, "initializer did not run"
    return _pages.render(ask)
