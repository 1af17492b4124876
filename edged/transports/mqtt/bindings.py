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
import string
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from edged import datatypes
from edged.errors import ConfigError, EdgedError, InternalError, InvalidInputError
from edged.transports.mqtt.topics import topic_matches, valid_publish_topic

log = logging.getLogger("edged.transports.mqtt.transport")

Policy = Literal["drop_oldest", "latest_per_topic", "queue"]
PLACEHOLDERS = frozenset({"topic", "device", "model", "version", "prefix"})


class StreamBinding(BaseModel):
    """One ``[[mqtt.bindings]]`` entry."""

    model_config = ConfigDict(extra="forbid")

    topic: str = Field(description="input topic filter; '+' and '#' wildcards allowed")
    model: str
    version: int | None = Field(default=None, ge=1, description="pin a version; default: the newest ready")
    output_topic: str = Field(
        default="{prefix}/{device}/results/{model}",
        description="template with {topic} (the input topic), {device}, {model}, {version}, {prefix}")
    input_format: Literal["v2", "raw"] = Field(
        default="v2", description="v2: a v2 JSON (or binary-form) request; raw: bare tensor bytes")
    input_name: str | None = Field(default=None, description="raw: the model input the bytes feed")
    datatype: str | None = Field(default=None, description="raw: the v2 datatype of the bytes")
    shape: list[int] | None = Field(default=None, description="raw: full shape incl. batch; one -1 allowed")
    policy: Policy = "latest_per_topic"
    queue_size: int = Field(default=8, ge=1, le=65536)
    qos: Literal[0, 1] = Field(default=0, description="subscription and output QoS")

    @field_validator("topic")
    @classmethod
    def _filter(cls, v: str) -> str:
        levels = v.split("/")
        if not v or "\0" in v:
            raise ValueError("must be a non-empty topic filter")
        for i, level in enumerate(levels):
            if ("#" in level and (level != "#" or i != len(levels) - 1)) or ("+" in level and level != "+"):
                raise ValueError("'+' must fill a whole level and '#' must be the whole last level")
        return v

    @field_validator("output_topic")
    @classmethod
    def _template(cls, v: str) -> str:
        try:
            fields = [f for _, f, _, _ in string.Formatter().parse(v) if f is not None]
            static = "".join(lit for lit, _, _, _ in string.Formatter().parse(v))
        except ValueError as e:
            raise ValueError(f"not a valid template: {e}") from None
        unknown = sorted(set(fields) - PLACEHOLDERS)
        if unknown:
            raise ValueError(f"unknown placeholder(s) {unknown}; use {sorted(PLACEHOLDERS)}")
        try:
            v.format(**dict.fromkeys(PLACEHOLDERS, "x"))
        except (ValueError, IndexError, KeyError, AttributeError) as e:
            raise ValueError(f"not a valid template: {e}") from None
        if not v or any(c in static for c in "+#\0"):
            raise ValueError("must be a topic name without wildcards")
        return v

    @field_validator("datatype")
    @classmethod
    def _datatype(cls, v: str | None) -> str | None:
        if v is not None and (v not in datatypes.ALL_DATATYPES or v == "BYTES"):
            raise ValueError(f"must be one of {sorted(set(datatypes.ALL_DATATYPES) - {'BYTES'})}")
        return v

    @field_validator("shape")
    @classmethod
    def _shape(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and (not v or any(d == 0 or d < -1 for d in v) or v.count(-1) > 1):
            raise ValueError("must be a non-empty list of positive sizes with at most one -1")
        return v

    @model_validator(mode="after")
    def _raw_fields(self) -> StreamBinding:
        raw = (self.input_name, self.datatype, self.shape)
        if self.input_format == "raw" and any(x is None for x in raw):
            raise ValueError("input_format 'raw' needs input_name, datatype and shape")
        if self.input_format == "v2" and any(x is not None for x in raw):
            raise ValueError("input_name, datatype and shape are only for input_format 'raw'")
        return self


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
            for err in e.errors():
                loc = "".join(f".{p}" for p in err["loc"])
                msg = "unknown key" if err["type"] == "extra_forbidden" else err["msg"]
                problems.append(f"mqtt.bindings[{i}]{loc}: {msg}")
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


@dataclass
class BindingStats:
    received: int = 0
    dropped: int = 0
    expired: int = 0
    processed: int = 0
    errors: int = 0
    high_water: int = 0


class BindingBuffer:
    """A bounded buffer with one overflow policy; ``put`` never blocks."""

    def __init__(self, policy: Policy, size: int) -> None:
        self.policy, self.size = policy, size
        self.stats = BindingStats()
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

    def _log_error(self, msg: str) -> None:
        # One bad sensor can produce thousands of errors a second: log at most every 30 s.
        now = time.monotonic()
        if now - self._last_error_log >= 30:
            self._last_error_log = now
            log.warning("binding %d (%s -> model %s): %s", self.index, self.binding.topic, self.binding.model, msg)
