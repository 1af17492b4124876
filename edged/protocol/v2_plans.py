"""Binary v2 requests that repeat their header: checked once, then decoded by plan.

A client that streams frames sends the same JSON header before every tensor (the same names,
shapes, sizes and options); only the bytes after it change. Parsing and checking that header
again for every frame costs more than everything else edged does for the request in Python. A
plan remembers what a header meant, keyed by its exact bytes together with the model, the version
and the length of the tensor bytes, and builds the next request from the new bytes directly; the
answer's header is kept the same way per output signature.

Only headers whose meaning cannot depend on anything but their own bytes are planned: every input
sent as raw bytes of a fixed-size type (BYTES elements are checked against their data), no shared
memory (regions come and go), no request id or reply address (MQTT 3.1.1's ``id`` and ``reply_to``:
a fresh one per request would only churn the cache, and the plan gives the transport neither).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from edged.protocol.types import InferRequest, InferResponse
from edged.protocol.v2 import DecodedRequest, OutputOptions, dumps

# Longer headers are not planned (a key is the header's bytes); a realistic binary header is ~200 bytes.
PLAN_HEADER_MAX = 4096
PLANS_MAX = 64  # per cache; a full cache starts over (a client varying its headers only loses the speed-up)
_REPLIES_MAX = 8  # answer headers kept per plan (output shapes can vary with dynamic axes)

PlanKey = tuple[str, int | None, bytes, int]


@dataclass(frozen=True)
class _Input:
    name: str
    dtype: np.dtype[Any]
    shape: tuple[int, ...]
    start: int
    end: int


class RequestPlan:
    """What one header meant: where each input lies in the tensor bytes, and the request's options."""

    __slots__ = ("binary_default", "inputs", "model", "outputs", "parameters", "replies", "version")

    def __init__(self, model: str, version: int | None, inputs: tuple[_Input, ...], *,
                 outputs: Mapping[str, OutputOptions], binary_default: bool, parameters: Mapping[str, Any]) -> None:
        self.model, self.version, self.inputs = model, version, inputs
        self.outputs = {name: OutputOptions(binary=o.binary) for name, o in outputs.items()}
        self.binary_default = binary_default
        self.parameters = dict(parameters)
        self.replies: dict[tuple[Any, ...], bytes] = {}

    def decode(self, tail: memoryview) -> DecodedRequest:
        """The request for these tensor bytes (the caller keeps them alive for the request's lifetime)."""
        # Loops and one ndarray call per input, not comprehensions of frombuffer().reshape(): this runs on
        # every planned request, on caches the last engine run evicted (the key's tail length is exact).
        arrays: dict[str, np.ndarray] = {}
        for i in self.inputs:
            arrays[i.name] = np.ndarray(i.shape, i.dtype, tail, i.start)
        outputs: dict[str, OutputOptions] = {}
        for name, o in self.outputs.items():
            outputs[name] = OutputOptions(binary=o.binary)
        request = InferRequest(model=self.model, version=self.version, inputs=arrays,
                               outputs=list(outputs) if outputs else None, parameters=dict(self.parameters))
        return DecodedRequest(request, outputs, self.binary_default, plan=self)

    def reply_key(self, resp: InferResponse) -> tuple[Any, ...] | None:
        """The answer header's key when it depends only on the outputs' names, types and shapes: every
        output sent as raw bytes of a fixed-size type, no id. None otherwise."""
        if resp.id is not None:
            return None
        key: list[Any] = [resp.model, resp.version]
        for name, arr in resp.outputs.items():
            opt = self.outputs.get(name)
            # BYTES in any numpy form (objects, fixed-width bytes or text): sized by their contents.
            if not (opt.binary if opt is not None else self.binary_default) or arr.dtype.kind in "OSU":
                return None
            key += (name, arr.dtype, arr.shape)  # the dtype itself: .str builds a string per request
        return tuple(key)

    def keep_reply(self, key: tuple[Any, ...], header: bytes) -> None:
        if len(self.replies) >= _REPLIES_MAX:
            self.replies.clear()
        self.replies[key] = header


def encode_answer(resp: InferResponse, decoded: DecodedRequest,
                  encode: Callable[[], tuple[dict[str, Any], list[bytes]]]) -> tuple[bytes, list[bytes]]:
    """The answer's header bytes and tensor chunks: ``encode()`` (the transport's general encoder) the
    first time, the header the request's plan kept after that, when the outputs' names, types and shapes
    are the same."""
    plan = decoded.plan if isinstance(decoded.plan, RequestPlan) else None
    key = None if plan is None else plan.reply_key(resp)
    if plan is not None and key is not None:
        known = plan.replies.get(key)
        if known is not None:
            return known, [np.ascontiguousarray(a).tobytes() for a in resp.outputs.values()]
    header, chunks = encode()
    head = dumps(header)
    if plan is not None and key is not None:
        plan.keep_reply(key, head)
    return head, chunks


def _plan(model: str, version: int | None, header: Mapping[str, Any], decoded: DecodedRequest) -> RequestPlan | None:
    """A plan for a header that decoded fine, or None when its meaning could change with the tail or the world."""
    if "id" in header or "reply_to" in header or any(o.shm is not None for o in decoded.outputs.values()):
        return None
    inputs: list[_Input] = []
    pos = 0
    for raw in header["inputs"]:  # decode_request accepted them: a list of objects with names
        params = raw.get("parameters")
        # decode_request ignores parameters that are not an object; such an input took its data elsewhere.
        if not isinstance(params, dict) or "shared_memory_region" in params or "binary_data_size" not in params:
            return None
        arr = decoded.request.inputs[raw["name"]]
        if arr.dtype.kind in "OSU":
            return None
        size = params["binary_data_size"]
        inputs.append(_Input(raw["name"], arr.dtype, arr.shape, pos, pos + size))
        pos += size
    return RequestPlan(model, version, tuple(inputs), outputs=decoded.outputs,
                       binary_default=decoded.binary_default, parameters=decoded.request.parameters)


class RequestPlans:
    """A bounded cache of plans, shared by the threads that decode (the event loop and its helpers)."""

    def __init__(self, max_plans: int = PLANS_MAX) -> None:
        self.max_plans = max_plans
        self._plans: dict[PlanKey, RequestPlan] = {}
        self._lock = threading.Lock()
        self.hits = 0

    @staticmethod
    def key(model: str, version: int | None, head: memoryview, tail_bytes: int) -> PlanKey | None:
        return (model, version, bytes(head), tail_bytes) if len(head) <= PLAN_HEADER_MAX else None

    def get(self, key: PlanKey | None) -> RequestPlan | None:
        """The plan for a key (None: the header could not be a key), counting hits."""
        plan = None if key is None else self._plans.get(key)
        if plan is not None:
            self.hits += 1
        return plan

    def learn(self, key: PlanKey, header: Mapping[str, Any], decoded: DecodedRequest) -> None:
        """Remember what a header that just decoded fine meant, if it can be planned."""
        plan = _plan(key[0], key[1], header, decoded)
        if plan is None:
            return
        with self._lock:
            if len(self._plans) >= self.max_plans:
                self._plans.clear()
            self._plans[key] = plan

    def __len__(self) -> int:
        return len(self._plans)
