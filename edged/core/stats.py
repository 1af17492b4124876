"""Per model-version statistics: the counters Triton's statistics extension reports, and edged's own.

Durations come from ``time.monotonic_ns``; only ``last_inference`` is wall-clock
(milliseconds since the epoch), because that is what clients display.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from edged.latency_buckets import LATENCY_BUCKETS_S  # the buckets the telemetry contract carries
from edged.protocol.v2_models import BatchTimes, Duration, VersionStatistics

# Inline runs waiting to be folded into the counters before the recording thread folds them itself
# (readers fold first, so this only bounds the memory of a model nobody reads).
_FOLD_AT = 256


@dataclass
class Histogram:
    buckets: tuple[float, ...] = LATENCY_BUCKETS_S
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.count += 1

    def cumulative(self) -> list[tuple[float, int]]:
        out, acc = [], 0
        for bound, c in zip([*self.buckets, float("inf")], self.counts, strict=True):
            acc += c
            out.append((bound, acc))
        return out

    def quantile(self, q: float) -> float:
        """Upper bound of the bucket holding the q-quantile (coarse, but cheap and allocation-free)."""
        if self.count == 0:
            return 0.0
        target = q * self.count
        for bound, acc in self.cumulative():
            if acc >= target:
                return bound if bound != float("inf") else self.buckets[-1]
        return self.buckets[-1]


@dataclass
class _Duration:
    count: int = 0
    ns: int = 0

    def add(self, ns: int, n: int = 1) -> None:
        self.count += n
        self.ns += ns

    def frozen(self) -> Duration:
        return Duration(self.count, self.ns)


@dataclass
class _BatchStat:
    compute_input: _Duration = field(default_factory=_Duration)
    compute_infer: _Duration = field(default_factory=_Duration)
    compute_output: _Duration = field(default_factory=_Duration)


class ModelStats:
    """Counters for one model version; every method is cheap and thread-safe."""

    def __init__(self, name: str, version: int, backend: str = "") -> None:
        self.name, self.version, self.backend = name, version, backend
        # One activation: from the version being published until it leaves the table. A reload in
        # place continues it (continue_activation); a version loaded again later starts a new one,
        # so telemetry and /metrics start a new series instead of carrying old counts into it.
        self.activation = uuid.uuid4().hex[:16]
        self.activated_at = time.time()
        self._lock = threading.Lock()
        self.success = _Duration()
        self.fail = _Duration()
        self.queue = _Duration()
        self.compute_input = _Duration()
        self.compute_infer = _Duration()
        self.compute_output = _Duration()
        self.inference_count = 0  # samples (batch elements)
        self.execution_count = 0  # engine runs
        self.failures_by_code: dict[str, int] = {}
        # Requests the daemon sent itself (self-test, watchdog probe), by source: not requests served.
        self.internal: dict[str, int] = {}
        self.batches: dict[int, _BatchStat] = {}
        self._in_flight = 0
        # Inline runs not yet in the counters: (batch, input, infer, output, total ns, monotonic end ns).
        # Appending is all a request pays; every reader folds them in first (``settled``).
        self._inline: collections.deque[tuple[int, int, int, int, int, int]] = collections.deque()
        self.inline_count = 0  # requests that ran on the caller's thread, never queued
        self.last_inference_ms = 0
        self.queue_hist = Histogram()
        self.compute_hist = Histogram()
        self.total_hist = Histogram()
        # The scheduler's batching decision (edged.core.batch_policy), reported beside the counters.
        self.batching: Callable[[], dict[str, Any]] | None = None

    def continue_activation(self, previous: ModelStats) -> None:
        """This object replaces ``previous`` in place (same version reloaded): same series."""
        self.activation, self.activated_at = previous.activation, previous.activated_at

    @property
    def in_flight(self) -> int:
        """Requests queued or running (an inline run counts until it is recorded)."""
        with self._lock:  # both figures as of one moment: an append between them would count it twice
            return self._in_flight - len(self._inline)

    @contextlib.contextmanager
    def settled(self) -> Iterator[int]:
        """Hold the lock with every recorded run in the counters (how a reader takes a consistent copy);
        yields the requests in flight."""
        with self._lock:
            self._fold()
            yield self._in_flight - len(self._inline)

    def busy_ns(self) -> int:
        """Engine time spent on served requests so far (input, infer, output), every recorded run included."""
        with self.settled():
            return self.compute_input.ns + self.compute_infer.ns + self.compute_output.ns

    def latency_counts(self) -> tuple[int, ...]:
        """The end-to-end latency histogram's bucket counts, every recorded request included."""
        with self.settled():
            return tuple(self.total_hist.counts)

    def enter(self) -> None:
        with self._lock:
            self._in_flight += 1

    def record_success(self, *, queue_ns: int, total_ns: int) -> None:
        with self._lock:
            self._success(queue_ns, total_ns)

    def _success(self, queue_ns: int, total_ns: int) -> None:
        """One request answered (the lock is held)."""
        self._in_flight -= 1
        self.success.add(total_ns)
        self.queue.add(queue_ns)
        self.queue_hist.observe(queue_ns / 1e9)
        self.total_hist.observe(total_ns / 1e9)

    def record_failure(self, code: str, *, total_ns: int, started: bool = True) -> None:
        with self._lock:
            if started:
                self._in_flight -= 1
            self.fail.add(total_ns)
            self.failures_by_code[code] = self.failures_by_code.get(code, 0) + 1

    def withdraw(self) -> None:
        """A queued request this copy gave up unstarted (unloaded) and its caller takes on to the copy
        that serves now: out of the in-flight count, counted by the copy that answers it, not here too."""
        with self._lock:
            self._in_flight -= 1

    def record_internal(self, source: str, *, started: bool = True) -> None:
        """One request the daemon sent itself ended (answered or not): counted apart, by source."""
        with self._lock:
            if started:
                self._in_flight -= 1
            self.internal[source] = self.internal.get(source, 0) + 1

    def record_inline(self, batch_size: int, input_ns: int, infer_ns: int, output_ns: int, total_ns: int, *,
                      end_ns: int) -> None:
        """A request that ran on its caller's thread (its one engine run and its success), ended at
        ``end_ns`` (monotonic): noted for the next fold, without the lock or a dozen counter updates."""
        pending = self._inline
        pending.append((batch_size, input_ns, infer_ns, output_ns, total_ns, end_ns))
        if len(pending) >= _FOLD_AT:
            with self._lock:
                self._fold()

    def _fold(self) -> None:
        """Move the noted inline runs into the counters (the lock is held; appends may go on, and
        wait for the next fold: this one takes only what was there when it began)."""
        pending = self._inline
        last = 0
        for _ in range(len(pending)):
            batch_size, input_ns, infer_ns, output_ns, total_ns, end = pending.popleft()
            self._batch(batch_size, 1, input_ns, infer_ns, output_ns, stamp=False)
            self._success(0, total_ns)
            self.inline_count += 1
            last = max(last, end)  # threads append out of order
        if last:  # when the latest of them ended, not when they were folded
            wall_ms = (time.time_ns() - (time.monotonic_ns() - last)) // 1_000_000
            self.last_inference_ms = max(self.last_inference_ms, wall_ms)

    def record_batch(self, batch_size: int, requests: int, input_ns: int, infer_ns: int, output_ns: int) -> None:
        with self._lock:
            self._batch(batch_size, requests, input_ns, infer_ns, output_ns)

    def _batch(self, batch_size: int, requests: int, input_ns: int, infer_ns: int, output_ns: int, *,
               stamp: bool = True) -> None:
        """One engine run (the lock is held); ``stamp``: it ended now (``last_inference``)."""
        self.execution_count += 1
        self.inference_count += batch_size
        self.compute_input.add(input_ns, requests)
        self.compute_infer.add(infer_ns, requests)
        self.compute_output.add(output_ns, requests)
        b = self.batches.get(batch_size)
        if b is None:
            b = self.batches[batch_size] = _BatchStat()
        b.compute_input.add(input_ns)
        b.compute_infer.add(infer_ns)
        b.compute_output.add(output_ns)
        self.compute_hist.observe((input_ns + infer_ns + output_ns) / 1e9)
        if stamp:
            self.last_inference_ms = time.time_ns() // 1_000_000

    def snapshot(self) -> VersionStatistics:
        """Every counter as of one moment (protocol.v2_models puts it into Triton's statistics shape)."""
        batching = self.batching() if self.batching is not None else None
        with self.settled() as in_flight:
            return VersionStatistics(
                name=self.name, version=self.version, last_inference_ms=self.last_inference_ms,
                inference_count=self.inference_count, execution_count=self.execution_count,
                success=self.success.frozen(), fail=self.fail.frozen(), queue=self.queue.frozen(),
                compute_input=self.compute_input.frozen(), compute_infer=self.compute_infer.frozen(),
                compute_output=self.compute_output.frozen(),
                batches=tuple(BatchTimes(bs, b.compute_input.frozen(), b.compute_infer.frozen(),
                                         b.compute_output.frozen()) for bs, b in sorted(self.batches.items())),
                failures_by_code=dict(self.failures_by_code), internal_requests=dict(self.internal),
                in_flight=in_flight, inline_count=self.inline_count, batching=batching)
