"""Inference messages as received and answered: split, decoded by plan, answered without copies.

A client sends the same ModelInferRequest again and again with new tensor bytes: the same model,
names, types and shapes. Its raw input contents are taken out of the received bytes as views
(edged.protocol.grpc.wire); what remains, a few hundred bytes, is a key to what the message meant
the last time: a plan that builds the next request from the new views at once, without parsing
or checking anything again. The key is those bytes exactly, with each content's length (the
lengths are what the checks looked at), and only messages whose meaning depends on nothing else
are planned: every input raw and of a fixed-size type, no parameters (shared memory, timeouts), no
request id (usually fresh per request), which is what tritonclient and perf_analyzer send. The plans
are bounded and start over when full.

A planned message laid out as clients write it (the rest first, then each raw content) is known
again without walking its fields: by its length, the rest as its prefix and each content's header
in its place.

An answer whose outputs are all raw is written by hand: its head (model, version, id, the outputs'
names, types and shapes) kept per signature, then each output's own memory.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from edged import datatypes
from edged.protocol.grpc.gen import grpc_service_pb2 as pb
from edged.protocol.grpc.wire import content_header, raw_output_prefix, response_head, split_raw_contents
from edged.protocol.types import InferRequest, InferResponse
from edged.protocol.v2 import DecodedRequest, OutputOptions
from edged.transports.grpc.codec import encode_infer, parse, plain
from edged.transports.shm.sysshm import ShmView

PLAN_KEY_MAX = 4096  # a longer rest of a message is not planned (its bytes are the key)
PLANS_MAX = 64
HEADS_MAX = 64

PlanKey = tuple[bytes, tuple[int, ...]]


@dataclass(frozen=True, slots=True)
class RawPlan:
    """What a plain message meant: the request to build from its raw contents (a message with a request
    id is never planned, so a planned request has none)."""

    model: str
    version: int | None
    inputs: tuple[tuple[str, np.dtype[Any], tuple[int, ...]], ...]
    outputs: tuple[str, ...]

    def decode(self, raw: Sequence[bytes | memoryview]) -> DecodedRequest:
        # Loops and one ndarray call per input, not comprehensions of frombuffer().reshape(): this runs on
        # every planned message, on caches the last engine run evicted (the plan's lengths are exact).
        arrays: dict[str, np.ndarray] = {}
        for (name, dtype, shape), data in zip(self.inputs, raw, strict=True):
            arrays[name] = np.ndarray(shape, dtype, data)
        opts: dict[str, OutputOptions] = {}
        for name in self.outputs:
            opts[name] = OutputOptions(binary=True)
        request = InferRequest(model=self.model, version=self.version, inputs=arrays,
                               outputs=list(opts) if opts else None, parameters={})
        return DecodedRequest(request, opts, binary_default=True)


@dataclass(frozen=True, slots=True)
class _Tail:
    """A planned message whose raw contents all follow the rest of it, in order."""

    rest: bytes
    headers: tuple[tuple[bytes, int], ...]  # each content's tag and length, and where they start
    spans: tuple[tuple[int, int], ...]  # each content's bytes
    key: PlanKey
    plan: RawPlan

    def match(self, data: bytes) -> InferMessage | None:
        """The message, planned, if ``data`` (of the planned length) is laid out as this; else None."""
        if not data.startswith(self.rest):
            return None
        for header, at in self.headers:
            if not data.startswith(header, at):
                return None
        view = memoryview(data)
        return InferMessage(self.rest, [view[b:e] for b, e in self.spans], len(self.rest), key=self.key,
                            plan=self.plan)


def _tail(msg: InferMessage, plan: RawPlan) -> _Tail | None:
    """The layout of a message whose raw contents followed its rest, else None (its rest is its prefix, and
    its contents' minimal headers and lengths make up the remainder of its ``tail_size`` bytes)."""
    assert msg.key is not None
    at = len(msg.rest)
    headers, spans = [], []
    for n in msg.key[1]:
        header = content_header(n)
        headers.append((header, at))
        at += len(header)
        spans.append((at, at + n))
        at += n
    if at != msg.tail_size:
        return None
    return _Tail(msg.rest, tuple(headers), tuple(spans), msg.key, plan)


class InferMessage:
    """A ModelInferRequest as received: its raw input contents (views of its bytes when it could be split),
    the rest parsed, or not at all when a plan knows what it means (``request`` parses it on demand)."""

    __slots__ = ("_request", "held_bytes", "key", "plan", "raw", "rest", "tail_size")

    def __init__(self, rest: bytes, raw: Sequence[bytes | memoryview], held_bytes: int, *,
                 request: pb.ModelInferRequest | None = None, key: PlanKey | None = None,
                 plan: RawPlan | None = None, tail_size: int = 0) -> None:
        self.rest, self.raw, self.held_bytes = rest, raw, held_bytes  # held: what parsing made besides its bytes
        self._request, self.key, self.plan = request, key, plan
        # an unplanned message's length when its rest is its prefix (its layout may be planned too), else 0
        self.tail_size = tail_size

    @property
    def request(self) -> pb.ModelInferRequest:
        if self._request is None:
            self._request = parse(pb.ModelInferRequest, self.rest)
        return self._request


class InferPlans:
    """Plans by key, shared by the event loop and the threads it decodes large messages on."""

    def __init__(self, max_plans: int = PLANS_MAX) -> None:
        self.max_plans = max_plans
        self._plans: dict[PlanKey, RawPlan] = {}
        self._tails: dict[int, dict[PlanKey, _Tail]] = {}  # by the message's length; each dict replaced whole
        self._heads: dict[tuple[Any, ...], bytes] = {}
        self._lock = threading.Lock()
        self.hits = 0

    def parse(self, data: bytes) -> InferMessage:
        """A received message, its raw contents left where they are and the rest parsed unless planned."""
        tails = self._tails.get(len(data))
        if tails:
            for tail in tails.values():
                msg = tail.match(data)
                if msg is not None:
                    self.hits += 1
                    return msg
        split = split_raw_contents(data)
        if split is None:  # parsed whole: the message, and a copy of its contents at each access
            req = parse(pb.ModelInferRequest, data)
            return InferMessage(data, req.raw_input_contents, 2 * len(data), request=req)
        rest, raw = split
        key = (rest, tuple(len(r) for r in raw)) if len(rest) <= PLAN_KEY_MAX else None
        plan = self._plans.get(key) if key is not None else None
        if plan is not None:
            self.hits += 1
            return InferMessage(rest, raw, len(rest), key=key, plan=plan)
        return InferMessage(rest, raw, 2 * len(rest), request=parse(pb.ModelInferRequest, rest), key=key,
                            tail_size=len(data) if key is not None and data.startswith(rest) else 0)

    def learn(self, msg: InferMessage, decoded: DecodedRequest) -> None:
        """Keep what a message that decoded fine meant, when nothing but its own bytes decides it."""
        req = decoded.request
        if msg.key is None or msg.plan is not None or req.id or not plain(msg.request, len(msg.raw)):
            return  # an id is usually fresh per request: its plans would only churn the cache
        if any(arr.dtype.kind in "OSU" for arr in req.inputs.values()):
            return  # BYTES: their elements are checked against the data every time
        plan = RawPlan(req.model, req.version,
                       tuple((name, arr.dtype, arr.shape) for name, arr in req.inputs.items()),
                       tuple(decoded.outputs))
        tail = _tail(msg, plan)
        with self._lock:
            if len(self._plans) >= self.max_plans:
                self._plans.clear()
                self._tails = {}
            self._plans[msg.key] = plan
            if tail is not None:  # replaced, never changed: parse reads them without the lock
                self._tails[msg.tail_size] = {**self._tails.get(msg.tail_size, {}), msg.key: tail}

    def answer(self, resp: InferResponse, decoded: DecodedRequest, shm: ShmView) -> bytes:
        """The serialized ModelInferResponse: written by hand when every output is raw and of a fixed-size
        type (the head kept per signature, each output's memory joined once), else through protobuf."""
        outs = resp.outputs
        for o in decoded.outputs.values():  # loops, not any(): this runs on caches the engine run evicted
            if o.shm:
                return bytes(encode_infer(resp, decoded, shm).SerializeToString())
        sig: list[Any] = [resp.model, resp.version]
        for name, a in outs.items():
            sig += (name, a.dtype, a.shape)
        key = tuple(sig)
        head = None if resp.id else self._heads.get(key)  # an answer with an id has a head of its own
        if head is None:
            if any(a.dtype.kind in "OSU" for a in outs.values()):  # sized by their contents: never a kept head
                return bytes(encode_infer(resp, decoded, shm).SerializeToString())
            head = response_head(resp.model, str(resp.version), resp.id or "",
                                 [(name, datatypes.from_numpy(a.dtype), a.shape) for name, a in outs.items()])
            if not resp.id:
                with self._lock:
                    if len(self._heads) >= HEADS_MAX:
                        self._heads.clear()
                    self._heads[key] = head
        parts: list[Any] = [head]
        for arr in outs.values():
            data = np.ascontiguousarray(arr)
            parts += (raw_output_prefix(data.nbytes), data)
        return b"".join(parts)
