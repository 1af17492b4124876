"""Repeated gRPC inference messages decoded by plan, and answers written by hand: the same requests and
the same bytes as the general codec and protobuf produce, and only for messages nothing else decides."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edged.errors import InvalidInputError
from edged.protocol.grpc.gen import grpc_service_pb2 as pb
from edged.protocol.grpc.wire import content_header, split_raw_contents
from edged.protocol.types import InferRequest, InferResponse
from edged.protocol.v2 import DecodedRequest, OutputOptions
from edged.transports.grpc import codec, infer_messages
from edged.transports.grpc.infer_messages import InferPlans
from edged.transports.shm.sysshm import SystemShmRegions

SHM = SystemShmRegions(max_region_bytes=1 << 20).view("")


def _message(x: np.ndarray, *, rid: str = "", version: str = "", outputs: tuple[str, ...] = ("y",),
             datatype: str = "FP32") -> bytes:
    req = pb.ModelInferRequest(model_name="m", model_version=version, id=rid)
    req.inputs.add(name="x", datatype=datatype, shape=x.shape)
    req.raw_input_contents.append(x.tobytes())
    for name in outputs:
        req.outputs.add(name=name)
    return req.SerializeToString()


def _same(a: DecodedRequest, b: DecodedRequest) -> None:
    ra, rb = a.request, b.request
    assert (ra.model, ra.version, ra.id, ra.outputs, ra.parameters) == (rb.model, rb.version, rb.id, rb.outputs,
                                                                         rb.parameters)
    assert list(ra.inputs) == list(rb.inputs)
    for name in ra.inputs:
        assert ra.inputs[name].dtype == rb.inputs[name].dtype
        np.testing.assert_array_equal(ra.inputs[name], rb.inputs[name])
    assert a.outputs == b.outputs and a.binary_default == b.binary_default


def _decode(plans: InferPlans, data: bytes) -> DecodedRequest:
    msg = plans.parse(data)
    if msg.plan is not None:
        return msg.plan.decode(msg.raw)
    decoded = codec.decode_infer(msg.request, SHM, msg.raw)
    plans.learn(msg, decoded)
    return decoded


def test_a_repeated_message_is_decoded_by_plan_as_the_codec_decodes_it() -> None:
    plans = InferPlans()
    rng = np.random.default_rng(0)
    for rid, version in (("", ""), ("", "3")):
        first = rng.random((2, 3), dtype=np.float32)
        _same(_decode(plans, _message(first, rid=rid, version=version)),
              codec.decode_infer(pb.ModelInferRequest.FromString(_message(first, rid=rid, version=version)), SHM))
        hits = plans.hits
        for _ in range(3):
            x = rng.random((2, 3), dtype=np.float32)
            data = _message(x, rid=rid, version=version)
            got = _decode(plans, data)
            _same(got, codec.decode_infer(pb.ModelInferRequest.FromString(data), SHM))
            assert np.shares_memory(got.request.inputs["x"], np.frombuffer(data, np.uint8))
        assert plans.hits == hits + 3


def test_only_messages_that_decide_their_own_meaning_are_planned() -> None:
    plans = InferPlans()
    x = np.ones((1, 4), np.float32)
    with_timeout = pb.ModelInferRequest.FromString(_message(x))
    with_timeout.parameters["timeout"].int64_param = 5000  # a deadline from now: not part of a plan
    text = pb.ModelInferRequest(model_name="m")
    text.inputs.add(name="s", datatype="BYTES", shape=[1])
    text.raw_input_contents.append(b"\x02\x00\x00\x00hi")  # BYTES: elements checked against the data each time
    with_id = _message(x, rid="r1")  # a request id is usually fresh per request: planning it would churn
    for data in (with_timeout.SerializeToString(), text.SerializeToString(), with_id):
        for _ in range(2):
            _decode(plans, data)
    assert plans.hits == 0
    assert _decode(plans, with_timeout.SerializeToString()).request.parameters == {"timeout_us": 5000}


def test_a_message_that_fails_is_not_planned_and_other_lengths_are_checked_again() -> None:
    plans = InferPlans()
    good = np.ones((1, 4), np.float32)
    req = pb.ModelInferRequest.FromString(_message(good))
    req.raw_input_contents[0] = b"\x00" * 12  # 3 floats for a shape of 4
    for _ in range(2):
        with pytest.raises(InvalidInputError, match="needs 16"):
            _decode(plans, req.SerializeToString())
    _decode(plans, _message(good))
    _decode(plans, _message(good))
    assert plans.hits == 1
    with pytest.raises(InvalidInputError, match="needs 16"):  # the planned header, another length: checked
        _decode(plans, req.SerializeToString())


def test_a_planned_layout_is_known_by_its_bytes_and_any_other_is_walked(monkeypatch: pytest.MonkeyPatch) -> None:
    """A planned message written rest first, contents last (as clients write it) is known by its length,
    its rest and its contents' headers, without walking its fields; a message of the same length that
    differs in any of them, or lays the same fields out otherwise, is walked and decoded as the codec
    decodes it."""
    walked: list[int] = []

    def walk(data: bytes) -> object:
        walked.append(len(data))
        return split_raw_contents(data)
    monkeypatch.setattr(infer_messages, "split_raw_contents", walk)
    plans = InferPlans()
    x = np.arange(4, dtype=np.float32).reshape(1, 4)
    _decode(plans, _message(x))
    y = x + 10
    rest = pb.ModelInferRequest(model_name="m")
    rest.inputs.add(name="x", datatype="FP32", shape=y.shape)
    rest.outputs.add(name="y")
    contents_first = content_header(y.nbytes) + y.tobytes() + rest.SerializeToString()
    same_length_other_model = pb.ModelInferRequest.FromString(_message(y))
    same_length_other_model.model_name = "n"
    longer_header = _message(y)[:-(y.nbytes + 2)] + b"\x3a\x90\x00" + y.tobytes()  # 16 as a two-byte varint
    for data, walks in ((_message(y), 0), (contents_first, 1), (same_length_other_model.SerializeToString(), 1),
                        (longer_header, 1)):
        want = codec.decode_infer(pb.ModelInferRequest.FromString(data), SHM)
        walked.clear()
        got = _decode(plans, data)
        _same(got, want)
        assert len(walked) == walks, (data, walked)
        assert np.shares_memory(got.request.inputs["x"], np.frombuffer(data, np.uint8))
    assert _decode(plans, same_length_other_model.SerializeToString()).request.model == "n"


def test_a_planned_message_still_says_which_request_it_was() -> None:
    plans = InferPlans()
    data = _message(np.ones((1, 2), np.float32), version="2")
    _decode(plans, data)
    msg = plans.parse(data)
    assert msg.plan is not None
    assert codec.error_response(msg.request) == pb.ModelInferResponse(model_name="m", model_version="2")


shapes = st.lists(st.integers(0, 200), max_size=3).filter(lambda s: int(np.prod(s)) <= 5000).map(tuple)
dtypes = st.sampled_from([np.float32, np.float16, np.int64, np.uint8, np.bool_, np.int8, np.float64])


@settings(max_examples=120, deadline=None)
@given(outputs=st.lists(st.tuples(st.text(min_size=1, max_size=10), dtypes, shapes), min_size=1, max_size=3,
                        unique_by=lambda o: o[0]),
       rid=st.one_of(st.none(), st.text(max_size=6)), version=st.integers(1, 1000), model=st.text(min_size=1))
def test_answers_written_by_hand_are_protobufs_bytes(outputs: list[tuple[str, type, tuple[int, ...]]],
                                                     rid: str | None, version: int, model: str) -> None:
    rng = np.random.default_rng(1)
    outs = {name: (rng.random(shape) * 100).astype(dt) for name, dt, shape in outputs}
    resp = InferResponse(model, version, outs, rid)
    decoded = DecodedRequest(InferRequest(model=model, inputs={}), {n: OutputOptions(binary=True) for n in outs},
                             binary_default=True)
    plans = InferPlans()
    want = codec.encode_infer(resp, decoded, SHM).SerializeToString()
    assert plans.answer(resp, decoded, SHM) == want
    assert plans.answer(resp, decoded, SHM) == want  # the kept head


def test_answers_with_bytes_or_a_transposed_output_go_through_protobuf_alike() -> None:
    decoded = codec.decode_infer(pb.ModelInferRequest.FromString(_message(np.ones(1, np.float32))), SHM)
    plans = InferPlans()
    for outs in ({"t": np.array([b"ab", b"c"], dtype=object)}, {"y": np.arange(6, dtype=np.float32).reshape(2, 3).T}):
        resp = InferResponse("m", 1, outs, None)
        assert plans.answer(resp, decoded, SHM) == codec.encode_infer(resp, decoded, SHM).SerializeToString()
