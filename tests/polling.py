"""Wait for a condition by polling it against a deadline, never by sleeping a guessed time.

A fixed ``time.sleep`` before an assertion is either too short on a loaded machine (a flaky test) or
too long everywhere else (a slow suite). Poll the thing awaited instead; on timeout the error says what
was awaited and the last value seen, so a failure reads without a rerun. tests/test_sleep_lint.py
fails on a sleep outside such a loop unless its line says why it must be a sleep (``# sleep-ok: ...``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

_NOTHING = object()


class _Poll:
    """One wait: each :meth:`done` calls the predicate once; past the deadline it raises instead."""

    def __init__(
        self, predicate: Callable[[], Any], timeout: float, what: str, ignore: tuple[type[BaseException], ...]
    ) -> None:
        self.predicate, self.timeout, self.what, self.ignore = predicate, timeout, what, ignore
        self.deadline = time.monotonic() + timeout
        self.value: Any = _NOTHING
        self.error: BaseException | None = None

    def done(self) -> bool:
        try:
            self.value = self.predicate()
            if self.value:
                return True
        except self.ignore as e:
            self.error = e
        if time.monotonic() >= self.deadline:
            seen = "nothing (the predicate never returned)" if self.value is _NOTHING else repr(self.value)
            seen = seen if len(seen) <= 500 else seen[:500] + "..."
            msg = f"gave up after {self.timeout:g} s waiting for {self.what}; last value seen: {seen}"
            raise AssertionError(msg + (f"; last error: {self.error!r}" if self.error is not None else ""))
        return False


def wait_until(
    predicate: Callable[[], T],
    timeout: float,
    interval: float = 0.05,
    what: str = "the condition",
    ignore: tuple[type[BaseException], ...] = (),
) -> T:
    """Call ``predicate`` every ``interval`` s until it returns something truthy, and return that.

    An exception of a type in ``ignore`` counts as "not yet" (a server not listening yet); any other
    propagates. After ``timeout`` s: AssertionError naming ``what``, the last value and the last error.
    """
    poll = _Poll(predicate, timeout, what, ignore)
    while not poll.done():
        time.sleep(interval)  # sleep-ok: the shared poll; _Poll.done raises past the deadline
    result: T = poll.value
    return result


async def wait_until_async(
    predicate: Callable[[], T],
    timeout: float,
    interval: float = 0.05,
    what: str = "the condition",
    ignore: tuple[type[BaseException], ...] = (),
) -> T:
    """:func:`wait_until` inside a coroutine: the event loop runs between polls (``predicate`` must not block)."""
    poll = _Poll(predicate, timeout, what, ignore)
    while not poll.done():
        await asyncio.sleep(interval)  # sleep-ok: the shared poll; _Poll.done raises past the deadline
    result: T = poll.value
    return result
