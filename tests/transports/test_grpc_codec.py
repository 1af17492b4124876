"""The gRPC codec's direct path (every input raw, no parameters: what tritonclient sends) against the
shared v2 codec it bypasses: the same requests, the same answers, the same refusals word for word."""

from __future__ import annotations

import numpy as np
import pytest

from edged.errors import InvalidInputError
from edged.protocol.grpc.gen import grpc_service_pb2 as pb
from edged.protocol.types import InferResponse
from edged.protocol.v2 import DecodedRequest, encode_response
from edged.transports.grpc import codec
from edged.transports.shm.sysshm import SystemShmRegions

SHM = SystemShmRegions(max_region_bytes=1 << 20).view("")


def _request(inputs: list[tuple[str, str, list[int], bytes]], *, outputs: tuple[str, ...] = (),
             rid: str = "", version: str = "") -> pb.ModelInferRequest:
    req = pb.ModelInferRequest(model_name="m", model_version=version, id=rid)
    for name, dt, shape, data in inputs:
        req.inputs.add(name=name, datatype=dt, shape=shape)
        req.raw_input_contents.append(data)
    for name in outputs:
        req.outputs.add(name=name)
    return req


def _through_shared_codec(req: pb.ModelInferRequest) -> pb.ModelInferRequest:
    """The same request with a request parameter the codec ignores: it takes the general path."""
    other = pb.ModelInferRequest()
    other.CopyFrom(req)
    other.parameters["ignored"].bool_param = True
    return other


def _decode(req: pb.ModelInferRequest) -> DecodedRequest | str:
    try:
        return codec.decode_infer(req, SHM)
    except InvalidInputError as e:
        return f"refused: {e}"


def _same(a: DecodedRequest | str, b: DecodedRequest | str) -> None:
    if isinstance(a, str) or isinstance(b, str):
        assert a == b
        return
    ra, rb = a.request, b.request
    assert (ra.model, ra.version, ra.outputs, ra.id, ra.deadline) == (rb.model, rb.version, rb.outputs, rb.id,
                                                                      rb.deadline)
    assert list(ra.inputs) == list(rb.inputs)
    for name in ra.inputs:
        x, y = ra.inputs[name], rb.inputs[name]
        assert (x.dtype, x.shape) == (y.dtype, y.shape)
        assert x.tolist() == y.tolist() if x.dtype == object else x.tobytes() == y.tobytes()
    assert a.outputs == b.outputs
    assert a.binary_default == b.binary_default


x = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
ids = np.array([[1, 2, 3]], dtype=np.int64)
words = b"".join(len(w).to_bytes(4, "little") + w for w in (b"edge", b"", b"d"))
CASES: dict[str, pb.ModelInferRequest] = {
    "one input": _request([("x", "FP32", [2, 3, 4], x.tobytes())]),
    "two inputs, outputs, id, version": _request(
        [("x", "FP32", [2, 3, 4], x.tobytes()), ("ids", "INT64", [1, 3], ids.tobytes())],
        outputs=("b", "a"), rid="req-7", version="3"),
    "BYTES": _request([("s", "BYTES", [3], words)]),
    "empty tensor": _request([("x", "FP32", [0, 4], b"")]),
    "no inputs": _request([]),
    "empty name": _request([("", "FP32", [1], b"\0" * 4)]),
    "twice": _request([("x", "FP32", [1], b"\0" * 4), ("x", "FP32", [1], b"\0" * 4)]),
    "unknown datatype": _request([("x", "FP33", [1], b"\0" * 4)]),
    "negative dimension": _request([("x", "FP32", [-1, 4], b"\0" * 16)]),
    "too many dimensions": _request([("x", "FP32", [1] * 17, b"\0" * 4)]),
    "shape lie": _request([("x", "FP32", [2, 3, 5], x.tobytes())]),
    "BYTES element past the end": _request([("s", "BYTES", [1], (9).to_bytes(4, "little") + b"abc")]),
    "huge element count": _request([("x", "UINT8", [2**40, 2**40], b"")]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_direct_path_decodes_and_refuses_as_the_shared_codec(name: str) -> None:
    req = CASES[name]
    assert codec.plain(req, len(req.raw_input_contents))
    assert not codec.plain(_through_shared_codec(req), len(req.raw_input_contents))
    _same(_decode(req), _decode(_through_shared_codec(req)))


def test_the_direct_path_is_taken_only_without_parameters_or_typed_contents() -> None:
    plain = CASES["one input"]
    assert codec.plain(plain, 1)
    with_input_param = pb.ModelInferRequest()
    with_input_param.CopyFrom(plain)
    with_input_param.inputs[0].parameters["shared_memory_region"].string_param = "r"
    typed = pb.ModelInferRequest(model_name="m")
    typed.inputs.add(name="x", datatype="FP32", shape=[1]).contents.fp32_contents.append(1.0)
    output_param = pb.ModelInferRequest()
    output_param.CopyFrom(plain)
    output_param.outputs.add(name="y").parameters["binary_data"].bool_param = False
    missing_raw = pb.ModelInferRequest()
    missing_raw.CopyFrom(plain)
    missing_raw.inputs.add(name="z", datatype="FP32", shape=[1])
    for req in (with_input_param, typed, output_param, missing_raw):
        assert not codec.plain(req, len(req.raw_input_contents))
    # Typed contents still decode on the general path.
    decoded = codec.decode_infer(typed, SHM)
    assert decoded.request.inputs["x"].tolist() == [1.0]


def test_direct_encoding_matches_the_shared_codec() -> None:
    outs = {"y": np.arange(6, dtype=np.float16).reshape(2, 3), "n": np.array([[7]], dtype=np.uint8),
            "s": np.array([b"ab", b""], dtype=object)}
    decoded = codec.decode_infer(CASES["one input"], SHM)
    for rid in ("req-1", None):
        resp = InferResponse("m", 2, outs, rid)
        out = codec.encode_infer(resp, decoded, SHM)
        header, chunks = encode_response(resp, decoded)
        assert (out.model_name, out.model_version, out.id) == (header["model_name"], header["model_version"],
                                                               header.get("id") or "")
        assert [(o.name, o.datatype, list(o.shape)) for o in out.outputs] == [
            (o["name"], o["datatype"], o["shape"]) for o in header["outputs"]]
        assert list(out.raw_output_contents) == chunks
    assert [o.datatype for o in out.outputs] == ["FP16", "UINT8", "BYTES"]
    assert out.raw_output_contents[0] == outs["y"].tobytes()


def test_a_kept_request_head_serializes_what_the_message_would_with_each_calls_tensors() -> None:
    """GrpcClient.infer's message: the inputs' metadata serialized once per model, version, names, dtypes and
    shapes, the tensors' bytes appended per call; it parses into exactly the message infer_request makes."""
    from edged.client.grpc import infer_message, infer_request

    kept: dict[tuple[object, ...], bytes] = {}
    rng = np.random.default_rng(6)
    for version in (None, 3):
        for _ in range(3):
            inputs = {"image": rng.random((1, 3, 4, 5), dtype=np.float32),
                      "ids": rng.integers(0, 1 << 40, (2, 7), dtype=np.int64)[:, ::2],  # not contiguous
                      "words": np.array([b"", b"a" * 200, "\u00e9".encode()], dtype=object)}
            got = pb.ModelInferRequest.FromString(infer_message("m", inputs, version, kept))
            assert got == infer_request("m", inputs, version)
    assert len(kept) == 2  # one head per version, whatever the contents
