"""Load generators: closed loop (N requests always in flight) and open loop (requests at a set rate).

Threads, one connection each, because every edged client is blocking; the
measurement side only drains a deque of completions, so it never stalls a sender.
Latency is timed from the moment a request is sent; in open-loop mode a request
whose thread was still busy at its scheduled time is counted as delayed (as
perf_analyzer does) so that a saturated client is visible, not hidden.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections import deque
from typing import Literal

import numpy as np

from edged.errors import EdgedError, ErrorCode
from edged.perf.inputs import Inputs
from edged.perf.targets import Connection, Target

DELAY_TOLERANCE_NS = 1_000_000  # an open-loop request sent more than 1 ms late counts as delayed
_JOIN_S = 15.0

Completion = tuple[int, int, bool]  # (end perf_counter_ns, latency ns, succeeded)


class Recorder:
    """Completions from every load thread, drained by the measurement loop."""

    def __init__(self) -> None:
        self._done: deque[Completion] = deque()
        self.first_error: str | None = None

    def success(self, end_ns: int, latency_ns: int) -> None:
        self._done.append((end_ns, latency_ns, True))

    def failure(self, end_ns: int, latency_ns: int, error: BaseException) -> None:
        if self.first_error is None:
            self.first_error = f"{type(error).__name__}: {error}"
        self._done.append((end_ns, latency_ns, False))

    def drain(self) -> list[Completion]:
        out: list[Completion] = []
        pop = self._done.popleft
        try:
            while True:
                out.append(pop())
        except IndexError:
            return out


def _connect_all(target: Target, n: int, requests: list[Inputs]) -> list[Connection]:
    """n connections, each warmed up by one request (connection set-up, slots, first-call caches)."""
    conns: list[Connection] = []
    try:
        for _ in range(n):
            conn = target.connect()
            conns.append(conn)
            conn.call(requests[0])
    except EdgedError:
        for c in conns:
            c.close()
        raise
    return conns


class Load:
    """What the measurement loop needs from either mode."""

    mode: str
    level: float
    recorder: Recorder

    def start(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    @property
    def delayed(self) -> int:
        return 0

    def reset_delayed(self) -> None:
        pass


class ClosedLoop(Load):
    mode = "concurrency"

    def __init__(self, target: Target, requests: list[Inputs], concurrency: int) -> None:
        self.target, self.requests, self.concurrency = target, requests, concurrency
        self.level = float(concurrency)
        self.recorder = Recorder()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._conns: list[Connection] = []

    def start(self) -> None:
        self._conns = _connect_all(self.target, self.concurrency, self.requests)
        gate = threading.Barrier(self.concurrency + 1)
        for k, conn in enumerate(self._conns):
            t = threading.Thread(target=self._run, args=(conn, k, gate), name=f"edged-perf-{k}", daemon=True)
            t.start()
            self._threads.append(t)
        gate.wait()

    def _run(self, conn: Connection, k: int, gate: threading.Barrier) -> None:
        reqs, rec, stop = self.requests, self.recorder, self._stop
        n = len(reqs)
        clock = time.perf_counter_ns
        i = k
        gate.wait()
        while not stop.is_set():
            t0 = clock()
            try:
                conn.call(reqs[i % n])
            except Exception as e:
                t1 = clock()
                rec.failure(t1, t1 - t0, e)
                if isinstance(e, EdgedError) and e.code is ErrorCode.UNAVAILABLE:
                    stop.wait(0.05)  # the daemon went away: do not spin on a dead connection
            else:
                t1 = clock()
                rec.success(t1, t1 - t0)
            i += 1

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(_JOIN_S)
        for c in self._conns:
            c.close()
        self._threads, self._conns = [], []


class OpenLoop(Load):
    mode = "request_rate"

    def __init__(self, target: Target, requests: list[Inputs], rate: float, *,
                 distribution: Literal["constant", "poisson"] = "constant", max_threads: int = 8,
                 seed: int = 0) -> None:
        self.target, self.requests, self.rate = target, requests, rate
        self.level = rate
        self.distribution, self.threads = distribution, max_threads
        self.recorder = Recorder()
        self._rng = np.random.default_rng(seed)
        self._stop = threading.Event()
        self._queue: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        self._workers: list[threading.Thread] = []
        self._scheduler: threading.Thread | None = None
        self._conns: list[Connection] = []
        self._delayed = 0
        self._lock = threading.Lock()
        self._next = itertools.count()

    @property
    def delayed(self) -> int:
        return self._delayed

    def reset_delayed(self) -> None:
        with self._lock:
            self._delayed = 0

    def start(self) -> None:
        self._conns = _connect_all(self.target, self.threads, self.requests)
        for k, conn in enumerate(self._conns):
            t = threading.Thread(target=self._work, args=(conn,), name=f"edged-perf-{k}", daemon=True)
            t.start()
            self._workers.append(t)
        self._scheduler = threading.Thread(target=self._schedule, name="edged-perf-schedule", daemon=True)
        self._scheduler.start()

    def _gaps_ns(self, n: int) -> list[int]:
        mean = 1e9 / self.rate
        if self.distribution == "poisson":
            return [max(1, int(g)) for g in self._rng.exponential(mean, n)]
        return [int(mean)] * n

    def _schedule(self) -> None:
        clock = time.perf_counter_ns
        due = clock()
        put, stop = self._queue.put, self._stop
        while not stop.is_set():
            for gap in self._gaps_ns(256):
                wait = due - clock()
                # Sleep, never spin: a spinning thread would hold the GIL the senders need.
                if wait > 50_000 and stop.wait(wait / 1e9):
                    return
                put(due)
                due += gap
                if stop.is_set():
                    return

    def _work(self, conn: Connection) -> None:
        reqs, rec, get = self.requests, self.recorder, self._queue.get
        n = len(reqs)
        clock = time.perf_counter_ns
        while True:
            due = get()
            if due is None or self._stop.is_set():
                return
            t0 = clock()
            if t0 - due > DELAY_TOLERANCE_NS:
                with self._lock:
                    self._delayed += 1
            try:
                conn.call(reqs[next(self._next) % n])
            except Exception as e:
                t1 = clock()
                rec.failure(t1, t1 - t0, e)
            else:
                t1 = clock()
                rec.success(t1, t1 - t0)

    def stop(self) -> None:
        self._stop.set()
        if self._scheduler is not None:
            self._scheduler.join(_JOIN_S)
        for _ in self._workers:
            self._queue.put(None)
        for t in self._workers:
            t.join(_JOIN_S)
        for c in self._conns:
            c.close()
        self._workers, self._conns, self._scheduler = [], [], None
