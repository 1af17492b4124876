"""edged's MQTT and gRPC clients given answers they cannot decode: the caller learns at once that the
answer was wrong (INTERNAL, an EdgedError), not a timeout, not a bare ValueError, not "your request was
invalid"."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import orjson
import pytest

from edged.client.grpc import infer_outputs
from edged.client.mqtt import MqttClient
from edged.errors import EdgedError, ErrorCode
from edged.protocol import mqtt as codec
from edged.protocol.grpc.gen import grpc_service_pb2 as pb
from tests.mqtt_helpers import Broker, TestClient, running_broker

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Broker]:
    with running_broker(tmp_path_factory.mktemp("mqtt-client-review"), nodelay=True) as b:
        yield b


def answer_with(broker: Broker, payload: bytes, header_length: int | None) -> TestClient:
    """A stand-in daemon that answers the next request on its response topic with ``payload``."""
    daemon = TestClient(broker.port).wait_connected()
    daemon.subscribe("edged/dev/infer/#")

    def on_message(client: object, userdata: object, msg: object) -> None:
        props = msg.properties  # type: ignore[attr-defined]
        users = [(codec.HEADER_LENGTH_PROPERTY, str(header_length))] if header_length is not None else []
        daemon.publish(props.ResponseTopic, payload, qos=0, CorrelationData=props.CorrelationData,
                       UserProperty=users)
    daemon.client.on_message = on_message
    return daemon


@pytest.mark.parametrize("payload", [
    b'{"outputs": [',  # not JSON
    orjson.dumps({"outputs": [{"name": "y", "datatype": "FP32", "shape": [4],
                               "parameters": {"binary_data_size": 16}}]}) + b"\0" * 6,  # tail too short
    orjson.dumps({"outputs": [{"name": "y", "datatype": "BYTES", "shape": [3],
                               "parameters": {"binary_data_size": 4}}]}) + b"\1\0\0\0",  # BYTES cut
    orjson.dumps({"outputs": [{"name": "y", "shape": [1], "data": [1]}]}),  # no datatype
], ids=["not-json", "short-tail", "short-bytes", "no-datatype"])
def test_mqtt_an_answer_it_cannot_decode_is_internal_at_once(broker: Broker, payload: bytes) -> None:
    hlen = payload.index(b"}]}") + 3 if b"binary_data_size" in payload else None
    daemon = answer_with(broker, payload, hlen)
    try:
        with MqttClient(broker.url, "dev") as c, pytest.raises(EdgedError) as e:
            c.infer("m", {"x": np.zeros(4, np.float32)}, timeout=30)
    finally:
        daemon.close()
    assert e.value.code is ErrorCode.INTERNAL, e.value


def grpc_answer(outputs: list[tuple[str, str, list[int]]], raw: list[bytes]) -> object:
    resp = pb.ModelInferResponse(model_name="m", model_version="1")
    for name, dt, shape in outputs:
        resp.outputs.add(name=name, datatype=dt, shape=shape)
    resp.raw_output_contents.extend(raw)
    return resp


@pytest.mark.parametrize(("outputs", "raw"), [
    ([("y", "FP32", [4])], [b"\0" * 6]),  # raw contents of the wrong size
    ([("y", "FP32", [2])], []),  # no raw contents at all
    ([("y", "BYTES", [2])], [b"\1\0\0\0a"]),  # BYTES that end early
    ([("y", "BF17", [1])], [b"\0\0"]),  # a datatype the client does not know
], ids=["wrong-size", "missing", "short-bytes", "unknown-datatype"])
def test_grpc_an_answer_it_cannot_decode_is_internal(outputs: list[tuple[str, str, list[int]]],
                                                     raw: list[bytes]) -> None:
    with pytest.raises(EdgedError) as e:
        infer_outputs(grpc_answer(outputs, raw))
    assert e.value.code is ErrorCode.INTERNAL, e.value


def test_grpc_scalars_and_fp16_decode() -> None:
    got = infer_outputs(grpc_answer([("s", "FP16", []), ("b", "BYTES", [])],
                                    [np.float16(1.5).tobytes(), b"\2\0\0\0hi"]))
    assert got["s"].shape == () and got["s"].dtype == np.float16 and got["s"] == 1.5
    assert got["b"].shape == () and got["b"][()] == b"hi"
