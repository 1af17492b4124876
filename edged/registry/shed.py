"""Load shedding: when the registry falls behind, device writes wait and polls go first.

A download wave asks more of the API's one event loop than it has: every device that
updates sends its reports, its changed facts and one blob request per file within
seconds, and each costs more than the poll that started it. Queued, they delay every
poll behind them (32 s at the p99 in a 10,000-device wave). The poll is the control plane
(it is how a halt or a rollback reaches devices) and costs least, so it is never shed;
what can wait answers ``503`` with ``Retry-After`` before any parsing, authentication or
database work, and devices keep what they wanted to send (their report outbox, their
telemetry buffer, the download they will resume) and come back later. The wave then takes
longer instead of making the control plane late.

The signal is the loop's own lateness (how late a timer fires) and the report writer's
backlog: both say that work already accepted is waiting. Kinds are shed in order of what
waits best: telemetry first (devices buffer it), then facts, then reports, blob requests
last (they are how an update makes progress).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Callable

import orjson
from starlette.types import ASGIApp, Receive, Scope, Send

from edged.errors import ErrorCode

TICK_S = 0.05
LEVEL_MAX = 2.0
STEP_UP = 0.25  # per late tick
STEP_DOWN = 0.05  # per timely tick: from the top back to nothing in 2 s of a loop that keeps up
HOLD_LEVEL = 1.0  # rollouts let no new devices in while shedding at least this much


class LoadSignal:
    """How far behind the registry is, as a shedding level from 0 (keeping up) to 2.

    Each late tick of a timer on the loop raises the level, each timely one lowers it a little,
    so a burst sheds a share of writes briefly and only a lasting overload sheds them all.
    A request kind of weight ``w`` is refused with probability ``min(1, level * w)``: devices
    that get through make progress while the others wait, instead of all of them retrying
    in step after an all-or-nothing refusal. A report writer backlog over ``max_backlog``
    sheds every write (what is queued is already more than a few seconds of work).
    """

    def __init__(self, *, max_lag_s: float, backlog: Callable[[], int] | None = None,
                 max_backlog: int = 2000) -> None:
        self.max_lag_s = max_lag_s
        self.backlog, self.max_backlog = backlog, max_backlog
        self.lag_s = 0.0
        self.level = 0.0
        self.shed = 0
        self.late_at = float("-inf")  # monotonic time of the last late tick
        self.late_s = 0.0  # and how late it was
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._watch(), name="registry-load-signal")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _watch(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            t0 = loop.time()
            await asyncio.sleep(TICK_S)
            self.note_lag(loop.time() - t0 - TICK_S)

    def note_lag(self, lag_s: float) -> None:
        self.lag_s = lag_s
        if lag_s > self.max_lag_s:
            self.level = min(LEVEL_MAX, self.level + STEP_UP)
            self.late_at, self.late_s = time.monotonic(), lag_s
        else:
            self.level = max(0.0, self.level - STEP_DOWN)

    def busy(self, level: float = HOLD_LEVEL) -> str | None:
        """Why new work should wait (the registry sheds at least at ``level``, i.e. its loop has been late
        again and again, or its report writer is backed up), or None. A late tick now and then, which a
        large fleet's steady state has, is no reason. Called from other threads (the rollout evaluator):
        reads plain attributes only."""
        if self._backlogged():
            return f"the registry is behind (over {self.max_backlog} report writes queued)"
        if self.level >= level:
            ago = time.monotonic() - self.late_at
            return (f"the registry is behind (shedding at level {self.level:.2f} of {LEVEL_MAX:g}; its event loop "
                    f"ran {self.late_s:.2f} s late {ago:.0f} s ago)")
        return None

    def behind(self) -> bool:
        return self.level > 0 or self._backlogged()

    def _backlogged(self) -> bool:
        return self.backlog is not None and self.backlog() > self.max_backlog

    def refuse(self, weight: float) -> bool:
        """Shed one request of this weight now?"""
        if self._backlogged():
            return True
        return self.level > 0 and random.random() < self.level * weight


class ShedDeviceWrites:
    """ASGI middleware: while the registry is behind, the listed device writes may answer 503 + Retry-After.

    ``routes`` are (method, path prefix, weight): the higher the weight, the sooner that kind is
    shed. The request's body is read and dropped (small JSON; uploads are not on the list) so
    the connection stays usable.
    """

    def __init__(self, app: ASGIApp, signal: LoadSignal, routes: list[tuple[str, str, float]],
                 retry_after_s: int) -> None:
        self.app, self.signal, self.routes = app, signal, routes
        self.retry_after_s = retry_after_s

    def retry_after(self) -> int:
        """Longer the further behind: retries that come back sooner than the backlog clears are more load."""
        return round(self.retry_after_s * (1 + 2 * self.signal.level))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.signal.behind():
            method, path = scope["method"], scope["path"]
            for m, prefix, weight in self.routes:
                if method == m and path.startswith(prefix):
                    if self.signal.refuse(weight):
                        self.signal.shed += 1
                        await self._refuse(receive, send)
                        return
                    break
        await self.app(scope, receive, send)

    async def _refuse(self, receive: Receive, send: Send) -> None:
        more = True
        while more:
            msg = await receive()
            more = msg["type"] == "http.request" and bool(msg.get("more_body"))
        wait = self.retry_after()
        body = orjson.dumps({"error": {"code": ErrorCode.OVERLOADED.value,
                                       "message": f"the registry is busy; send this again in {wait} s"}})
        await send({"type": "http.response.start", "status": 503,
                    "headers": [(b"content-type", b"application/json"), (b"retry-after", str(wait).encode()),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
