"""Binary v2 requests decoded by plan: the same requests as the general decoder, and only where a
header's meaning cannot change with its tensor bytes or with the world."""

from __future__ import annotations

from typing import Any

import numpy as np
import orjson
import pytest

from edged.protocol.types import InferResponse
from edged.protocol.v2 import DecodedRequest, decode_request
from edged.protocol.v2_json import loads_request
from edged.protocol.v2_plans import PLAN_HEADER_MAX, RequestPlan, RequestPlans

x = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
ids = np.array([[1, 2, 3]], dtype=np.int64)


def _binary(inputs: list[tuple[str, np.ndarray]], **extra: Any) -> tuple[bytes, bytes]:
    header = {"inputs": [{"name": n, "datatype": {"float32": "FP32", "int64": "INT64", "uint8": "UINT8"}[str(a.dtype)],
                          "shape": list(a.shape), "parameters": {"binary_data_size": a.nbytes}} for n, a in inputs],
              **extra}
    return orjson.dumps(header), b"".join(a.tobytes() for _, a in inputs)


def _learned(head: bytes, tail: bytes, plans: RequestPlans) -> DecodedRequest:
    decoded = decode_request(loads_request(head), memoryview(tail), model="m", version=2)
    key = plans.key("m", 2, memoryview(head), len(tail))
    assert key is not None
    plans.learn(key, loads_request(head), decoded)
    return decoded


def _same(a: DecodedRequest, b: DecodedRequest) -> None:
    ra, rb = a.request, b.request
    assert (ra.model, ra.version, ra.outputs, ra.id, ra.parameters) == (rb.model, rb.version, rb.outputs, rb.id,
                                                                        rb.parameters)
    assert list(ra.inputs) == list(rb.inputs)
    for name, arr in ra.inputs.items():
        assert arr.dtype == rb.inputs[name].dtype and arr.shape == rb.inputs[name].shape
        assert arr.tobytes() == rb.inputs[name].tobytes()
    assert a.outputs == b.outputs and a.binary_default == b.binary_default


@pytest.mark.parametrize("extra", [
    {},
    {"parameters": {"binary_data_output": True, "timeout": 5000}},
    {"outputs": [{"name": "b", "parameters": {"binary_data": False}}, {"name": "a"}]},
], ids=["plain", "request parameters", "outputs"])
def test_a_plan_decodes_new_tensor_bytes_as_the_general_decoder(extra: dict[str, Any]) -> None:
    plans = RequestPlans()
    head, tail = _binary([("x", x), ("ids", ids)], **extra)
    _learned(head, tail, plans)
    key = plans.key("m", 2, memoryview(head), len(tail))
    assert key is not None
    plan = plans.get(key)
    assert plan is not None and plans.hits == 1
    # The next frame: the same header, other numbers.
    tail2 = (x + 100).tobytes() + (ids * 7).tobytes()
    by_plan = plan.decode(memoryview(tail2))
    general = decode_request(loads_request(head), memoryview(tail2), model="m", version=2)
    _same(by_plan, general)
    assert by_plan.plan is plan and general.plan is None
    assert by_plan.request.inputs["x"][0, 0, 0] == 100
    # Each request gets its own options and parameters: a change to one does not leak into the next.
    by_plan.request.parameters["seen"] = True
    for opt in by_plan.outputs.values():
        opt.binary = not opt.binary
    _same(plan.decode(memoryview(tail2)), general)


@pytest.mark.parametrize("what", ["id", "reply_to", "BYTES input", "JSON data", "shared memory input",
                                  "shared memory output", "parameters not an object"])
def test_headers_whose_meaning_can_change_are_not_planned(what: str) -> None:
    head, tail = _binary([("x", x)])
    header = orjson.loads(head)
    if what == "id":
        header["id"] = "r-1"
    elif what == "reply_to":
        header["reply_to"] = "replies/311"
    elif what == "BYTES input":
        tail = (2).to_bytes(4, "little") + b"ok"
        header["inputs"] = [{"name": "s", "datatype": "BYTES", "shape": [1],
                             "parameters": {"binary_data_size": len(tail)}}]
    elif what == "JSON data":
        header["inputs"][0] = {"name": "x", "datatype": "FP32", "shape": [2], "data": [1.0, 2.0]}
        tail = b""
    elif what == "parameters not an object":  # the decoder ignores them; the input's data is JSON
        header["inputs"][0] = {"name": "x", "datatype": "FP32", "shape": [2], "data": [1.0, 2.0],
                               "parameters": "binary_data_size"}
        tail = b""
    elif what == "shared memory input":
        header["inputs"][0]["parameters"] = {"shared_memory_region": "r", "shared_memory_byte_size": x.nbytes}
        tail = b""
    else:
        header["outputs"] = [{"name": "y", "parameters": {"shared_memory_region": "r",
                                                          "shared_memory_byte_size": 64}}]
    head = orjson.dumps(header)
    plans = RequestPlans()
    decoded = decode_request(loads_request(head), memoryview(tail), model="m", version=None,
                             shm=lambda *a: memoryview(bytearray(x.nbytes)))
    key = plans.key("m", None, memoryview(head), len(tail))
    assert key is not None
    plans.learn(key, loads_request(head), decoded)
    assert len(plans) == 0 and plans.get(key) is None


def test_long_headers_are_not_keys_and_the_cache_is_bounded() -> None:
    plans = RequestPlans(max_plans=4)
    assert plans.key("m", None, memoryview(b" " * (PLAN_HEADER_MAX + 1)), 0) is None
    for n in range(1, 7):
        a = np.zeros((n, 4), dtype=np.float32)
        head, tail = _binary([("x", a)])
        _learned(head, tail, plans)
        assert 1 <= len(plans) <= 4


def _plan_for(head: bytes, tail: bytes) -> RequestPlan:
    plans = RequestPlans()
    _learned(head, tail, plans)
    key = plans.key("m", 2, memoryview(head), len(tail))
    plan = None if key is None else plans.get(key)
    assert plan is not None
    return plan


def test_answer_headers_are_kept_only_for_raw_fixed_size_outputs() -> None:
    plan = _plan_for(*_binary([("x", x)], parameters={"binary_data_output": True}))
    y = np.zeros((2, 5), dtype=np.float32)
    assert plan.reply_key(InferResponse("m", 2, {"y": y})) == ("m", 2, "y", np.dtype("<f4"), (2, 5))
    # the same names, types and shapes: the same key; another type or shape: another key
    assert plan.reply_key(InferResponse("m", 2, {"y": y.astype(np.float64)})) != plan.reply_key(
        InferResponse("m", 2, {"y": y}))
    assert plan.reply_key(InferResponse("m", 2, {"y": y[:1]})) != plan.reply_key(InferResponse("m", 2, {"y": y}))
    assert plan.reply_key(InferResponse("m", 3, {"y": y})) != plan.reply_key(InferResponse("m", 2, {"y": y}))
    assert plan.reply_key(InferResponse("m", 2, {"y": y}, "an-id")) is None
    assert plan.reply_key(InferResponse("m", 2, {"s": np.array([b"a"], dtype=object)})) is None
    # OpenVINO hands string outputs over as fixed-width numpy bytes or text: BYTES on the wire all the same.
    assert plan.reply_key(InferResponse("m", 2, {"s": np.array([b"ab", b"c"], dtype="S2")})) is None
    assert plan.reply_key(InferResponse("m", 2, {"s": np.array(["ab"], dtype="<U2")})) is None
    # Outputs as JSON numbers (the default without binary_data_output) have no fixed header.
    assert _plan_for(*_binary([("x", x)])).reply_key(InferResponse("m", 2, {"y": y})) is None
