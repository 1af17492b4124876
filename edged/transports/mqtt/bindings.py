"""Stream bindings: an input topic feeds a model whose outputs go to an output topic.

A sensor publishing faster than the model runs must never grow the daemon's
memory, so each binding owns a bounded buffer with an explicit overflow policy
and one worker thread; paho's thread only drops a message into the buffer.

Policies (``queue_size`` = N):
- ``queue``: first in, first out; when N messages wait, new ones are dropped.
- ``drop_oldest``: first in, first out; when N wait, the oldest is dropped.
- ``latest_per_topic``: only the newest message of each input topic waits (at
  most N topics; beyond that the longest-waiting topic is dropped).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from pydantic import ValidationError

from edged import datatypes
from edged.config import Policy, StreamBinding
from edged.errors import ConfigError, EdgedError, InternalError, InvalidInputError, format_validation_error
from edged.protocol.mqtt_topics import topic_matches, valid_publish_topic

log = logging.getLogger("edged.transports.mqtt.transport")
RATE_WINDOW_S = 10.0  # a stream's fps and latency are over this many recent seconds
MAX_RECENT = 4096  # answers remembered for that (bounded whatever the rate)

def validate_bindings(raw: Sequence[Any]) -> list[StreamBinding]:
    """Validate ``[mqtt] bindings``; every problem is named ``mqtt.bindings[i].<key>``."""
    out: list[StreamBinding] = []
    problems: list[str] = []
    for i, item in enumerate(raw):
        if isinstance(item, StreamBinding):
            out.append(item)
            continue
        try:
            out.append(StreamBinding.model_validate(item))
        except ValidationError as e:
            problems += format_validation_error(e, f"mqtt.bindings[{i}]")
    if problems:
        raise ConfigError(f"{len(problems)} problem(s) in mqtt.bindings: " + "; ".join(problems), problems)
    return out


@dataclass
class Item:
    topic: str
    payload: bytes | bytearray
    header_length: int | None
    received_at: float  # wall clock, for the output's timestamp
    deadline: float | None  # monotonic; from the message expiry
    frame_timestamp: str | None = None  # the publisher's own (MQTT 5 user property), carried to the output
    content_type: str | None = None  # the message's MQTT 5 content type
    arrived: float = 0.0  # monotonic, for the stream's latency


@dataclass
class BindingStats:
    received: int = 0
    dropped: int = 0
    expired: int = 0
    processed: int = 0
    errors: int = 0
    high_water: int = 0
    # (monotonic end, seconds from arrival to published) of the answers of the last RATE_WINDOW_S
    recent: collections.deque[tuple[float, float]] = field(default_factory=collections.deque)

    def answered(self, now: float, latency: float) -> None:
        self.recent.append((now, latency))
        while self.recent and (self.recent[0][0] < now - RATE_WINDOW_S or len(self.recent) > MAX_RECENT):
            self.recent.popleft()

    def rate(self, now: float) -> tuple[float, float, float]:
        """Answers per second over the last RATE_WINDOW_S, and their latency p50/p99 in ms (0 when none)."""
        lat = sorted(x for t, x in list(self.recent) if t >= now - RATE_WINDOW_S)
        if not lat:
            return 0.0, 0.0, 0.0
        return (len(lat) / RATE_WINDOW_S, lat[len(lat) // 2] * 1e3, lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1e3)


class BindingBuffer:
    """A bounded buffer with one overflow policy; ``put`` never blocks."""

    def __init__(self, policy: Policy, size: int) -> None:
        self.policy, self.size = policy, size
        self.stats = BindingStats()
        self.lock = threading.Lock()  # the stats' window (worker writes, telemetry reads)
        self._cv = threading.Condition()
        self._fifo: collections.deque[Item] = collections.deque()
        self._latest: collections.OrderedDict[str, Item] = collections.OrderedDict()
        self._closed = False

    def __len__(self) -> int:
        return len(self._latest) if self.policy == "latest_per_topic" else len(self._fifo)

    def put(self, item: Item) -> bool:
        """Admit ``item`` under the policy; False when it was dropped itself."""
        with self._cv:
            st = self.stats
            st.received += 1
            if self.policy == "latest_per_topic":
                if item.topic in self._latest:
                    st.dropped += 1  # the older message of this topic is superseded
                    self._latest[item.topic] = item
                else:
                    if len(self._latest) >= self.size:
                        self._latest.popitem(last=False)
                        st.dropped += 1
                    self._latest[item.topic] = item
            elif len(self._fifo) >= self.size:
                st.dropped += 1
                if self.policy == "queue":
                    return False
                self._fifo.popleft()
                self._fifo.append(item)
            else:
                self._fifo.append(item)
            st.high_water = max(st.high_water, len(self))
            self._cv.notify()
            return True

    def get(self, timeout: float | None = None) -> Item | None:
        """The next item, or None on timeout or once closed and empty."""
        with self._cv:
            end = None if timeout is None else time.monotonic() + timeout
            while not len(self):
                if self._closed:
                    return None
                remaining = None if end is None else end - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return None
                self._cv.wait(remaining)
            if self.policy == "latest_per_topic":
                return self._latest.popitem(last=False)[1]
            return self._fifo.popleft()

    def close(self) -> None:
        """Wake the worker; what is still buffered is dropped."""
        with self._cv:
            self._closed = True
            self.stats.dropped += len(self)
            self._fifo.clear()
            self._latest.clear()
            self._cv.notify_all()


def raw_tensor(payload: bytes | bytearray, datatype: str, shape: Sequence[int]) -> np.ndarray:
    dtype = datatypes.to_numpy(datatype)
    if len(payload) % dtype.itemsize:
        raise InvalidInputError(f"raw payload of {len(payload)} bytes is not a whole number of {datatype} values")
    count = len(payload) // dtype.itemsize
    dims = list(shape)
    known = int(np.prod([d for d in dims if d != -1], dtype=np.int64))
    if -1 in dims:
        if known == 0 or count % known:
            raise InvalidInputError(f"raw payload of {count} {datatype} values does not fit shape {dims}")
        dims[dims.index(-1)] = count // known
    elif known != count:
        raise InvalidInputError(f"raw payload has {count} {datatype} values but shape {dims} needs {known}")
    return np.frombuffer(payload, dtype=dtype).reshape(dims)


# publish(topic, payload, qos, header_length or None)
Publish = Callable[[str, bytes, int, "int | None"], None]


class BindingWorker:
    """One binding's buffer and the thread that drains it through the model."""

    def __init__(self, index: int, binding: StreamBinding, *, render: Callable[[StreamBinding, str], str],
                 process: Callable[[StreamBinding, Item], tuple[bytes, int | None]],
                 error_payload: Callable[[StreamBinding, Item, EdgedError], bytes], publish: Publish) -> None:
        self.index, self.binding = index, binding
        self.buffer = BindingBuffer(binding.policy, binding.queue_size)
        self._render, self._process, self._error_payload, self._publish = render, process, error_payload, publish
        self._thread = threading.Thread(target=self._run, name=f"edged-mqtt-binding-{index}", daemon=True)
        self._last_error_log = -1e9

    @property
    def stats(self) -> BindingStats:
        return self.buffer.stats

    def rate(self) -> tuple[float, float, float]:
        """The stream's real answers per second and latency p50/p99 (ms) over the last RATE_WINDOW_S."""
        with self.buffer.lock:
            return self.stats.rate(time.monotonic())

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 2.0) -> None:
        self.buffer.close()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def matches(self, topic: str) -> bool:
        return topic_matches(self.binding.topic, topic)

    def offer(self, item: Item) -> None:
        """Called on paho's thread: buffer and return at once."""
        self.buffer.put(item)

    def _run(self) -> None:
        while True:
            item = self.buffer.get()
            if item is None:
                return
            try:
                self._handle(item)
            except Exception:  # the worker must outlive any one bad message
                log.exception("binding %d (%s): unexpected error", self.index, self.binding.topic)

    def _handle(self, item: Item) -> None:
        b = self.binding
        out_topic = self._render(b, item.topic)
        if not valid_publish_topic(out_topic) or topic_matches(b.topic, out_topic):
            self.stats.errors += 1
            self._log_error(f"output topic {out_topic!r} is invalid or feeds the binding's own input; dropped")
            return
        if item.deadline is not None and time.monotonic() > item.deadline:
            self.stats.expired += 1
            return
        try:
            payload, header_length = self._process(b, item)
            self.stats.processed += 1
        except EdgedError as e:
            self.stats.errors += 1
            self._log_error(f"{e.code.value}: {e}")
            payload, header_length = self._error_payload(b, item, e), None
        except Exception as e:
            self.stats.errors += 1
            log.exception("binding %d (%s): processing failed", self.index, b.topic)
            err = InternalError(f"internal error: {type(e).__name__}")
            payload, header_length = self._error_payload(b, item, err), None
        self._publish(out_topic, payload, b.qos, header_length)
        now = time.monotonic()
        with self.buffer.lock:
            self.stats.answered(now, now - item.arrived if item.arrived else 0.0)

    def _log_error(self, msg: str) -> None:
        # One bad sensor can produce thousands of errors a second: log at most every 30 s.
        now = time.monotonic()
        if now - self._last_error_log >= 30:
            self._last_error_log = now
            log.warning("binding %d (%s -> model %s): %s", self.index, self.binding.topic, self.binding.model, msg)
