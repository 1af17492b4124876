"""The asyncio shm client's bound on requests in flight (the daemon's ``max_inflight`` per connection).

Why not :class:`asyncio.Semaphore`: ``async with`` makes two coroutines per request and its ``locked()``
walks the waiters, on every request of a frame loop, on caches the daemon's engine run has evicted on
a small machine. Here a request that finds room takes its place with an increment and no await; only
one that must wait awaits, and a place given back passes straight to the longest waiter (first come,
first served, as with the semaphore).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib


class Inflight:
    """At most ``limit`` places taken at once; :meth:`take_now` first, :meth:`take` when it says no."""

    def __init__(self, limit: int) -> None:
        self.limit = max(1, limit)
        self.used = 0
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    def take_now(self) -> bool:
        """A place at once, or False (then ``await take()``): none is free, or others wait before us."""
        if self.used < self.limit and not self._waiters:
            self.used += 1
            return True
        return False

    async def take(self) -> None:
        """Wait for a place; cancelled meanwhile, nothing is held (a place handed over just then goes on)."""
        if self.take_now():
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await fut
        except BaseException:  # cancelled (or interrupted) while waiting
            if fut.done() and not fut.cancelled():  # the place was ours just before the cancel
                self.give()
            else:
                with contextlib.suppress(ValueError):  # a give() may have dropped it already
                    self._waiters.remove(fut)
            raise

    def give(self) -> None:
        """Give a place back: to the longest waiter still waiting, else to the pool."""
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)  # the place passes to it: ``used`` stays
                return
        self.used -= 1
