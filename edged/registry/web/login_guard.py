"""Sign-in attempts, bounded: per client address and in what the password checks may cost at once.

An operator's password is checked with scrypt (16 MiB, ~50 ms of a core), so unbounded
guesses are both a way to try passwords and a way to take the registry's memory and CPU
from the devices. An address that failed ``max_failures`` times within ``window_s`` is
refused (429 with Retry-After) without any check until its oldest failure leaves the
window; a success forgets its failures. At most ``concurrent_checks`` password checks run at
once, the rest wait without a thread. The table of addresses is bounded: the least recently
failed address is forgotten first, so addresses made up by the thousand cost a fixed amount
of memory (and each still gets only ``max_failures`` tries before it is refused).

Behind a reverse proxy every request comes from the proxy's address, so failures from anyone
count against everyone there (docs/dashboard.md says so).
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict, deque
from collections.abc import Callable

MAX_FAILURES = 10
WINDOW_S = 300.0
MAX_ADDRESSES = 4096
CONCURRENT_CHECKS = 2


class LoginGuard:
    def __init__(self, *, max_failures: int = MAX_FAILURES, window_s: float = WINDOW_S,
                 max_addresses: int = MAX_ADDRESSES, concurrent_checks: int = CONCURRENT_CHECKS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_failures, self.window_s, self.max_addresses = max_failures, window_s, max_addresses
        self.concurrent_checks = concurrent_checks
        self._clock = clock
        self._failures: OrderedDict[str, deque[float]] = OrderedDict()
        self._checks: asyncio.Semaphore | None = None

    def _recent(self, address: str, now: float) -> deque[float] | None:
        seen = self._failures.get(address)
        while seen and now - seen[0] >= self.window_s:
            seen.popleft()
        if seen is not None and not seen:
            del self._failures[address]
            return None
        return seen

    def retry_after(self, address: str) -> float | None:
        """Seconds until ``address`` may try again, or None when it may try now."""
        now = self._clock()
        seen = self._recent(address, now)
        if seen is None or len(seen) < self.max_failures:
            return None
        return max(0.0, seen[0] + self.window_s - now)

    def failed(self, address: str) -> None:
        now = self._clock()
        seen = self._recent(address, now)
        if seen is None:
            seen = self._failures[address] = deque(maxlen=self.max_failures)
        seen.append(now)
        self._failures.move_to_end(address)
        while len(self._failures) > self.max_addresses:
            self._failures.popitem(last=False)

    def succeeded(self, address: str) -> None:
        self._failures.pop(address, None)

    @property
    def checks(self) -> asyncio.Semaphore:
        """Held while a password is checked (made on first use, inside the server's event loop)."""
        if self._checks is None:
            self._checks = asyncio.Semaphore(self.concurrent_checks)
        return self._checks
