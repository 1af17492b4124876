"""ModelInferRequest's raw input contents taken as views of the received bytes: the rest of the message
parses to exactly what protobuf makes of the whole, the contents are the same bytes in the same order,
and whatever the walk does not take is left to protobuf whole."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edged.errors import InvalidInputError
from edged.protocol.grpc.gen import grpc_service_pb2 as pb
from edged.protocol.grpc.wire import RAW_INPUT_CONTENTS, split_raw_contents
from edged.transports.grpc import codec
from edged.transports.grpc.infer_messages import InferPlans
from edged.transports.shm.sysshm import SystemShmRegions

SHM = SystemShmRegions(max_region_bytes=1 << 20).view("")


def test_the_field_number_is_the_protos() -> None:
    field = pb.ModelInferRequest.DESCRIPTOR.fields_by_name["raw_input_contents"]
    assert field.number == RAW_INPUT_CONTENTS


def _key(number: int, kind: int) -> bytes:
    return _varint(number << 3 | kind)


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    return _key(number, 2) + _varint(len(payload)) + payload


names = st.text(min_size=1, max_size=12)
contents = st.binary(max_size=3000)


@settings(max_examples=150, deadline=None)
@given(model=names, version=st.sampled_from(["", "1", "17"]), rid=st.text(max_size=8),
       inputs=st.lists(st.tuples(names, st.sampled_from(["FP32", "UINT8", "BYTES"]),
                                 st.lists(st.integers(0, 1 << 40), max_size=4), contents), max_size=5),
       outputs=st.lists(names, max_size=3), with_parameters=st.booleans())
def test_the_rest_parses_to_the_whole_message_less_its_contents(
        model: str, version: str, rid: str, inputs: list[tuple[str, str, list[int], bytes]],
        outputs: list[str], with_parameters: bool) -> None:
    req = pb.ModelInferRequest(model_name=model, model_version=version, id=rid)
    for name, dt, shape, data in inputs:
        req.inputs.add(name=name, datatype=dt, shape=shape)
        req.raw_input_contents.append(data)
    for name in outputs:
        req.outputs.add(name=name).parameters["binary_data"].bool_param = True
    if with_parameters:
        req.parameters["priority"].int64_param = 3
    data = req.SerializeToString()
    split = split_raw_contents(data)
    assert split is not None
    rest, raws = split
    assert [bytes(r) for r in raws] == list(req.raw_input_contents)
    assert all(r.obj is data for r in raws)  # views of the received bytes, not copies
    whole = pb.ModelInferRequest.FromString(data)
    del whole.raw_input_contents[:]
    assert pb.ModelInferRequest.FromString(rest) == whole
    assert len(rest) == len(data) - sum(len(r) for r in raws) - sum(
        len(_key(RAW_INPUT_CONTENTS, 2) + _varint(len(r))) for r in raws)


def test_contents_interleaved_with_other_fields_keep_both_orders() -> None:
    """Protobuf lets a sender put fields in any order; repeated ones keep theirs."""
    first = pb.ModelInferRequest.InferInputTensor(name="a", datatype="UINT8", shape=[2]).SerializeToString()
    second = pb.ModelInferRequest.InferInputTensor(name="b", datatype="UINT8", shape=[3]).SerializeToString()
    data = (_field(7, b"\x01\x02") + _field(5, first) + _field(1, b"m") + _field(7, b"\x03\x04\x05")
            + _field(5, second) + _key(99, 0) + _varint(300))  # and an unknown varint field
    split = split_raw_contents(data)
    assert split is not None
    rest, raws = split
    assert [bytes(r) for r in raws] == [b"\x01\x02", b"\x03\x04\x05"]
    msg = pb.ModelInferRequest.FromString(rest)
    assert (msg.model_name, [t.name for t in msg.inputs]) == ("m", ["a", "b"])
    got = codec.decode_infer(msg, SHM, raws).request.inputs
    assert got["a"].tolist() == [1, 2] and got["b"].tolist() == [3, 4, 5]


@pytest.mark.parametrize("data", [
    _field(1, b"m") + _key(7, 2) + _varint(10) + b"short",  # a content longer than the message
    _field(1, b"m") + b"\x80",  # a key cut off
    _field(1, b"m") + _key(3, 1) + b"\x00" * 3,  # a fixed64 cut off
    _field(1, b"m") + _key(9, 3) + _key(9, 4),  # a group: left to protobuf
    _field(1, b"m") + b"\xff" * 11,  # an overlong varint
])
def test_what_the_walk_does_not_take_is_parsed_whole(data: bytes) -> None:
    assert split_raw_contents(data) is None
    try:
        whole = pb.ModelInferRequest.FromString(data)
    except Exception:
        with pytest.raises(InvalidInputError, match="not a valid ModelInferRequest"):
            InferPlans().parse(data)
    else:
        assert InferPlans().parse(data).request == whole


def test_field_7_of_another_wire_type_stays_for_protobuf() -> None:
    data = _field(1, b"m") + _key(7, 0) + _varint(5)
    split = split_raw_contents(data)
    assert split == (data, [])


def test_decoded_inputs_are_views_of_the_received_message() -> None:
    """What the model reads is the message grpcio handed over, not a copy of it (and the reservation
    counts only what parsing made besides)."""
    x = np.arange(3 * 48, dtype=np.float32).reshape(1, 3, 48)
    req = pb.ModelInferRequest(model_name="m")
    req.inputs.add(name="x", datatype="FP32", shape=x.shape)
    req.raw_input_contents.append(x.tobytes())
    data = req.SerializeToString()
    msg = InferPlans().parse(data)
    arr = codec.decode_infer(msg.request, SHM, msg.raw).request.inputs["x"]
    np.testing.assert_array_equal(arr, x)
    assert np.shares_memory(arr, np.frombuffer(data, np.uint8))
    assert msg.held_bytes < 200 < x.nbytes
    whole = InferPlans().parse(data + _key(9, 3) + _key(9, 4))  # unsplittable: held twice more, as before
    assert whole.held_bytes >= 2 * len(data)
