"""The MQTT transport against a real mosquitto: request/response, bindings, availability, TLS, failures."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import fcntl
import gc
import json
import logging
import signal
import struct
import subprocess
import termios
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from edged.backoff import Backoff
from edged.client.mqtt import MqttClient, MqttServerError
from edged.config import ModelsSection, parse_config
from edged.core.manager import ModelManager
from edged.core.service import InferenceService
from edged.errors import ConfigError, DeadlineExceededError, EdgedError, ErrorCode
from edged.profiles import BackendPreference
from edged.protocol import mqtt as codec
from edged.protocol.types import InferRequest
from edged.protocol.v2 import dumps
from edged.telemetry.prometheus import MetricsRenderer
from edged.transports.mqtt import replies
from edged.transports.mqtt.bindings import BindingBuffer, Item, validate_bindings
from edged.transports.mqtt.connection import MqttOptions
from edged.transports.mqtt.dedup import RecentKeys
from edged.transports.mqtt.stall import STALL_HIGH_S, STALL_LOW_S
from edged.transports.mqtt.transport import MqttTransport
from tests.conftest import EDGED, MODELS, REPO_ROOT
from tests.mqtt_helpers import (
    Broker,
    EdgedRun,
    LoopResult,
    MosquittoCliRequester,
    PahoRequester,
    RefusingBroker,
    TestClient,
    closed_loop,
    make_test_ca,
    mosquitto_sub,
    process_fds,
    publish_properties,
    user_properties,
)
from tests.polling import wait_until
from tests.spying import results_of

ORT_CPU = [BackendPreference(backend="onnxruntime", device="CPU", precisions=["fp32"])]
REPLY = "edged/dev/reply"  # the daemon's default reply namespace ([mqtt] reply_topics) for device "dev"


# ---- fixtures ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def service() -> Iterator[InferenceService]:
    manager = ModelManager(MODELS, ModelsSection(), ORT_CPU)
    manager.load_all()
    yield InferenceService(manager)
    manager.shutdown()


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[Broker]:
    b = Broker(tmp_path / "broker").start()
    yield b
    b.stop()


@pytest.fixture
def transports(service: InferenceService) -> Iterator[Callable[..., MqttTransport]]:
    made: list[MqttTransport] = []

    def make(url: str, extra: str = "", *, device: str = "dev", ready: bool = True,
             metrics: MetricsRenderer | None = None, **options: Any) -> MqttTransport:
        cfg = parse_config(f'[device]\nid = "{device}"\n[mqtt]\nurl = "{url}"\n{extra}')
        opts = dataclasses.replace(MqttOptions.from_config(cfg), **options) if options else None
        t = MqttTransport(cfg, service, "test-profile", options=opts, metrics=metrics)
        asyncio.run(t.start())
        made.append(t)
        if ready:
            assert t.wait_ready(10), "transport did not connect and subscribe"
        return t

    yield make
    for t in made:
        asyncio.run(t.stop())


@pytest.fixture
def client(broker: Broker) -> Iterator[TestClient]:
    c = TestClient(broker.port).wait_connected()
    c.subscribe(f"{REPLY}/#")
    yield c
    c.close()


def _json_request(x: np.ndarray, **extra: Any) -> bytes:
    return dumps({"inputs": [{"name": "pixels", "datatype": "FP32", "shape": list(x.shape), "data": x.ravel()}],
                  **extra})


def _min_publish_size(topic: str, payload: bytes, response_topic: str, correlation: bytes) -> int:
    """The fewest bytes an MQTT 5 PUBLISH of these takes: 2 for its fixed header (or more), 2 for the
    topic's length, 1 for the properties' length, 3 for each property's identifier and length."""
    return 2 + 2 + len(topic.encode()) + 1 + 3 + len(response_topic.encode()) + 3 + len(correlation) + len(payload)


def _readable_bytes(sock: Any) -> int:
    """Bytes waiting in ``sock``'s receive buffer, not yet read by its owner."""
    return int(struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0"))[0])


def _binary_request(x: np.ndarray, **extra: Any) -> tuple[bytes, bytes]:
    header = dumps({"inputs": [{"name": "pixels", "datatype": "FP32", "shape": list(x.shape),
                                "parameters": {"binary_data_size": x.nbytes}}], **extra})
    return header, x.astype(np.float32).tobytes()


@dataclasses.dataclass
class Digits:
    """Held-out digit images, their labels, and what the model answers in-process."""

    x: np.ndarray
    y: np.ndarray
    service: InferenceService

    def expected(self, x: np.ndarray) -> np.ndarray:
        return self.service.infer(InferRequest("digits", {"pixels": x})).outputs["probabilities"]


@pytest.fixture
def digits(service: InferenceService, digits_holdout: tuple[np.ndarray, np.ndarray]) -> Digits:
    return Digits(digits_holdout[0], digits_holdout[1], service)


def _probs(payload: bytes | bytearray, props: dict[str, str] | None = None) -> np.ndarray:
    hlen = int(props[codec.HEADER_LENGTH_PROPERTY]) if props and codec.HEADER_LENGTH_PROPERTY in props else None
    fr = codec.parse(payload, hlen)
    out = fr.header["outputs"][0]
    if "data" in out:
        return np.asarray(out["data"], np.float32).reshape(tuple(out["shape"]))
    return np.frombuffer(bytes(fr.tail), np.float32).reshape(tuple(out["shape"]))


def _correlated(corr: bytes) -> Callable[[Any], bool]:
    return lambda m: prop(m, "CorrelationData") == corr


def prop(msg: Any, name: str) -> Any:
    """An MQTT 5 property of a received message, or None."""
    return getattr(msg.properties, name, None)


# ---- request / response -----------------------------------------------------------------------
def test_mqtt5_json_and_binary_requests_from_python(
        broker: Broker, transports: Callable[..., MqttTransport], client: TestClient, digits: Digits) -> None:
    transports(broker.url)
    x = digits.x[:3]
    want = digits.expected(x)

    client.publish("edged/dev/infer/digits", _json_request(x), ResponseTopic=f"{REPLY}/py", CorrelationData=b"j-1")
    msg = client.get(where=_correlated(b"j-1"))
    assert msg.topic == f"{REPLY}/py"
    assert prop(msg, "ContentType") == codec.CONTENT_TYPE_JSON
    assert json.loads(msg.payload)["model_name"] == "digits"
    np.testing.assert_allclose(_probs(msg.payload), want, rtol=1e-5)

    header, tensor = _binary_request(x)
    client.publish("edged/dev/infer/digits/1", header + tensor, ResponseTopic=f"{REPLY}/py", CorrelationData=b"b-1",
                   UserProperty=[(codec.HEADER_LENGTH_PROPERTY, str(len(header)))])
    msg = client.get(where=_correlated(b"b-1"))
    props = user_properties(msg)
    assert codec.HEADER_LENGTH_PROPERTY in props, "binary request must get a binary-form reply"
    head = json.loads(msg.payload[: int(props[codec.HEADER_LENGTH_PROPERTY])])
    assert head["outputs"][0]["parameters"]["binary_data_size"] == want.nbytes
    np.testing.assert_array_equal(_probs(msg.payload, props), want)


def test_repeated_binary_headers_are_decoded_by_plan(
        broker: Broker, transports: Callable[..., MqttTransport], client: TestClient, digits: Digits) -> None:
    """A publisher streaming frames repeats its header: after the first, requests skip parsing it
    (protocol/v2_plans.py) and get the same answers; a payload that does not fit is judged afresh."""
    t = transports(broker.url)
    header, _ = _binary_request(digits.x[:2])
    hlen = [(codec.HEADER_LENGTH_PROPERTY, str(len(header)))]
    for k in range(4):
        x = digits.x[2 * k:2 * k + 2]
        client.publish("edged/dev/infer/digits", header + x.astype(np.float32).tobytes(), ResponseTopic=f"{REPLY}/py",
                       CorrelationData=f"p-{k}".encode(), UserProperty=hlen)
        msg = client.get(where=_correlated(f"p-{k}".encode()))
        np.testing.assert_array_equal(_probs(msg.payload, user_properties(msg)), digits.expected(x))
    assert t.requests.plans.hits == 3
    client.publish("edged/dev/infer/digits", header + digits.x[:1].astype(np.float32).tobytes(),
                   ResponseTopic=f"{REPLY}/py", CorrelationData=b"p-short", UserProperty=hlen)
    msg = client.get(where=_correlated(b"p-short"))
    props = user_properties(msg)
    error = json.loads(msg.payload[:int(props[codec.HEADER_LENGTH_PROPERTY])])
    assert error["code"] == "invalid_argument" and "goes past the end of the body" in error["error"]
    # A header that names its reply topic (MQTT 3.1.1) is not planned: each request is answered as its own.
    c = TestClient(broker.port, v5=False).wait_connected()
    c.subscribe(f"{REPLY}/#")
    try:
        for k in range(2):
            head, tensor = _binary_request(digits.x[k:k + 1], reply_to=f"{REPLY}/311")
            c.publish("edged/dev/infer/digits", codec.PREFIX.pack(len(head)) + head + tensor)
            np.testing.assert_array_equal(_probs(c.get(where=lambda m: m.payload[:1] == b"\0").payload),
                                          digits.expected(digits.x[k:k + 1]))
    finally:
        c.close()
    assert t.requests.plans.hits == 3


def test_a_lone_request_runs_on_pahos_thread_and_a_burst_is_queued(
        broker: Broker, transports: Callable[..., MqttTransport], client: TestClient, digits: Digits,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Requests one at a time are computed and answered on paho's thread (no scheduler hand-off), their
    QoS 0 replies written to the socket there and then; requests already waiting together on the
    connection are queued for the batcher and their replies published through paho's queue; every
    answer is the in-process one and every request is counted once, whichever path it took."""
    # The run-time bound is the scheduler's to judge (tests/device/test_core.py); here a loaded
    # machine's slow digits run must not queue a lone request.
    bound = 10**9
    monkeypatch.setattr("edged.transports.mqtt.intake.LOOP_INLINE_MAX_NS", bound)
    written = results_of(monkeypatch, replies, "publish_now")
    t = transports(broker.url)
    want = digits.expected(digits.x[:40])
    sched = digits.service.ready_model("digits").scheduler
    assert sched is not None
    # The service is the module's: earlier tests' overlapping traffic, and their runs a host stalled
    # (two over 50 ms keep event loops off the model for minutes, whatever the bound), are theirs.
    wait_until(lambda: time.monotonic() >= sched._concurrent_until, 10, 0.01, "the overlap to be forgotten")
    monkeypatch.setattr(sched, "_off_loop_until", 0.0)
    monkeypatch.setattr(sched, "_last_long_s", float("-inf"))
    before = digits.service.statistics("digits")[0]
    alone: list[bool] = []  # requests paho's thread may run: two stalled runs in this test still count
    for i in range(20):
        x = digits.x[i:i + 1]
        corr = f"one-{i}".encode()
        alone.append(sched.short_enough(x.astype(np.float32).nbytes, bound))
        if i % 2:
            header, tensor = _binary_request(x)
            client.publish("edged/dev/infer/digits", header + tensor, ResponseTopic=f"{REPLY}/py", CorrelationData=corr,
                           UserProperty=[(codec.HEADER_LENGTH_PROPERTY, str(len(header)))])
        else:
            client.publish("edged/dev/infer/digits", _json_request(x), ResponseTopic=f"{REPLY}/py",
                           CorrelationData=corr)
        msg = client.get(where=_correlated(corr))
        np.testing.assert_allclose(_probs(msg.payload, user_properties(msg))[0], want[i], rtol=1e-5, atol=1e-6)
    serial = digits.service.statistics("digits")[0]
    assert alone.count(True) >= 5, "the host stalled the engine through most of the requests"
    assert serial["inline_count"] - before["inline_count"] == alone.count(True)
    assert len(written) == 20 and [w for w, a in zip(written, alone, strict=True) if a] == [True] * alone.count(True), \
        "a lone request's reply was not written at once"
    assert serial["inference_stats"]["success"]["count"] - before["inference_stats"]["success"]["count"] == 20

    # Hold paho's thread at its first request (it takes this lock to read the backlog) until the other
    # requests are waiting on the socket behind it: then none of them is alone.
    requests = t.counters["requests"]
    burst = [_json_request(digits.x[i:i + 1]) for i in range(20, 40)]
    with t.pending.unsent_lock:
        for i, payload in enumerate(burst, 20):
            client.publish("edged/dev/infer/digits", payload, qos=0,
                           ResponseTopic=f"{REPLY}/py", CorrelationData=f"burst-{i}".encode())
        wait_until(lambda: t.counters["requests"] > requests, 10, 0.01, "the first of the burst on paho's thread")
        # The rest wait in the socket: at least their packets' smallest size (all whole but perhaps the
        # last, which may then run alone: the "<= 1" below).
        rest = sum(_min_publish_size("edged/dev/infer/digits", payload, f"{REPLY}/py", f"burst-{i}".encode())
                   for i, payload in enumerate(burst[1:], 21))
        sock = t.session.client.socket() if t.session.client is not None else None
        assert sock is not None
        wait_until(lambda: _readable_bytes(sock) >= rest, 10, 0.01, "the burst on the socket")
        assert t.counters["requests"] == requests + 1, "paho's thread was not held at the first request"
    got: dict[int, np.ndarray] = {}
    while len(got) < 20:
        msg = client.get()
        corr = prop(msg, "CorrelationData") or b""
        if corr.startswith(b"burst-"):
            i = int(corr[6:])
            assert i not in got, f"request {i} was answered twice"
            got[i] = _probs(msg.payload)[0]
    for i, probs in got.items():
        np.testing.assert_allclose(probs, want[i], rtol=1e-5, atol=1e-6)
    after = digits.service.statistics("digits")[0]
    # Each saw another waiting behind it, or a queue (or overlap) on the model: none is alone.
    assert after["inline_count"] - serial["inline_count"] <= 1, "waiting requests ran on paho's thread"
    assert written[20:].count(True) <= 1 and len(written) == 40  # the others answered from the batcher's thread
    assert after["inference_stats"]["success"]["count"] - serial["inference_stats"]["success"]["count"] == 20
    assert after["inference_stats"]["fail"]["count"] == before["inference_stats"]["fail"]["count"]
    assert after["in_flight"] == 0
    settle = time.monotonic() + 5  # a completion callback counts itself out just after publishing
    while t.inflight and time.monotonic() < settle:
        time.sleep(0.01)
    assert t.inflight == 0


@pytest.mark.parametrize("daemon_protocol", ["5", "3.1.1"])
def test_mqtt311_reply_to_with_json_and_prefixed_binary(
        broker: Broker, transports: Callable[..., MqttTransport], digits: Digits, daemon_protocol: str) -> None:
    transports(broker.url, f'protocol = "{daemon_protocol}"')
    c = TestClient(broker.port, v5=False).wait_connected()
    c.subscribe(f"{REPLY}/#")
    x = digits.x[5:7]
    want = digits.expected(x)
    try:
        c.publish("edged/dev/infer/digits", _json_request(x, reply_to=f"{REPLY}/311", id="req-json"))
        msg = c.get(where=lambda m: json.loads(m.payload).get("id") == "req-json")
        np.testing.assert_allclose(_probs(msg.payload), want, rtol=1e-5)

        header, tensor = _binary_request(x, reply_to=f"{REPLY}/311", id="req-bin")
        c.publish("edged/dev/infer/digits", codec.PREFIX.pack(len(header)) + header + tensor)
        msg = c.get(where=lambda m: m.payload[:1] == b"\0")
        assert codec.parse(msg.payload, None).header["id"] == "req-bin"
        np.testing.assert_array_equal(_probs(msg.payload), want)
    finally:
        c.close()


def test_mosquitto_cli_v5_json_request_gets_the_right_digit(
        broker: Broker, transports: Callable[..., MqttTransport], digits: Digits) -> None:
    transports(broker.url)
    x, y = digits.x, digits.y
    # A held-out image the model classifies correctly.
    i = next(i for i in range(len(y)) if int(np.argmax(digits.expected(x[i:i + 1]))) == int(y[i]))
    body = json.dumps({"inputs": [{"name": "pixels", "datatype": "FP32", "shape": [1, 64],
                                   "data": x[i].tolist()}]})
    with mosquitto_sub(broker.port, f"{REPLY}/cli", 1) as sub:
        subprocess.run(["mosquitto_pub", "-V", "mqttv5", "-p", str(broker.port), "-t", "edged/dev/infer/digits",
                        "-D", "publish", "response-topic", f"{REPLY}/cli",
                        "-D", "publish", "correlation-data", "cli-42", "-m", body], check=True)
        out, _ = sub.communicate(timeout=30)
    topic, corr, payload = out.strip().split("|", 2)
    assert (topic, corr) == (f"{REPLY}/cli", "cli-42")
    digit = int(np.argmax(json.loads(payload)["outputs"][0]["data"]))
    print(f"mosquitto_pub digits request -> mosquitto_sub reply: digit {digit} (label {int(y[i])})")
    assert digit == int(y[i])


def test_mosquitto_cli_v311_and_binary_requests(
        broker: Broker, transports: Callable[..., MqttTransport], client: TestClient, tmp_path: Path,
        digits: Digits) -> None:
    transports(broker.url)
    x = digits.x[9:10]
    want = digits.expected(x)
    body = _json_request(x, reply_to=f"{REPLY}/cli311", id="cli-311")
    with mosquitto_sub(broker.port, f"{REPLY}/cli311", 1) as sub:
        subprocess.run(["mosquitto_pub", "-V", "mqttv311", "-p", str(broker.port), "-t", "edged/dev/infer/digits",
                        "-m", body.decode()], check=True)
        out, _ = sub.communicate(timeout=30)
    reply = json.loads(out.strip().split("|", 2)[2])
    assert reply["id"] == "cli-311"
    np.testing.assert_allclose(np.asarray(reply["outputs"][0]["data"]).reshape(1, 10), want, rtol=1e-5)

    header, tensor = _binary_request(x)
    (tmp_path / "req.bin").write_bytes(header + tensor)
    subprocess.run(["mosquitto_pub", "-V", "mqttv5", "-p", str(broker.port), "-t", "edged/dev/infer/digits",
                    "-D", "publish", "response-topic", f"{REPLY}/clibin",
                    "-D", "publish", "correlation-data", "cli-bin",
                    "-D", "publish", "user-property", codec.HEADER_LENGTH_PROPERTY, str(len(header)),
                    "-f", str(tmp_path / "req.bin")], check=True)
    msg = client.get(where=_correlated(b"cli-bin"))
    np.testing.assert_array_equal(_probs(msg.payload, user_properties(msg)), want)


def test_errors_are_correlated_responses_and_serving_continues(
        broker: Broker, transports: Callable[..., MqttTransport], client: TestClient,
        digits_holdout: tuple[np.ndarray, np.ndarray]) -> None:
    t = transports(broker.url, "max_payload_mb = 0.01")  # ~10 KB
    x = digits_holdout[0][:1]

    def ask(topic: str, payload: bytes, corr: bytes, **props: Any) -> tuple[dict[str, Any], dict[str, str]]:
        client.publish(topic, payload, ResponseTopic=f"{REPLY}/err", CorrelationData=corr, **props)
        msg = client.get(where=_correlated(corr))
        hlen = user_properties(msg).get(codec.HEADER_LENGTH_PROPERTY)
        return codec.parse(msg.payload, int(hlen) if hlen else None).header, user_properties(msg)

    cases = [
        ("edged/dev/infer/digits", b"{not json", "invalid_argument", "not valid JSON"),
        ("edged/dev/infer/nosuchmodel", _json_request(x), "not_found", "nosuchmodel"),
        ("edged/dev/infer/digits/zero", _json_request(x), "invalid_argument", "version segment"),
        ("edged/dev/infer/digits/7", _json_request(x), "not_found", "version 7"),
        ("edged/dev/infer/digits", _json_request(x[:, :10]), "invalid_argument", "pixels"),
        ("edged/dev/infer/digits", b"\0\0\0\x50{}", "invalid_argument", "header length prefix"),
        ("edged/dev/infer/digits", b"\0" * 20_000, "resource_exhausted", "max_payload_mb"),
    ]
    for i, (topic, payload, code, text) in enumerate(cases):
        body, props = ask(topic, payload, f"e-{i}".encode())
        assert body["code"] == code, body
        assert text in body["error"], body
        assert props[codec.ERROR_CODE_PROPERTY] == code

    # A binary request that fails gets its error in the binary form, with the same framing.
    header, _ = _binary_request(x)
    body, props = ask("edged/dev/infer/digits", header, b"e-bin",
                      UserProperty=[(codec.HEADER_LENGTH_PROPERTY, str(len(header)))])
    assert body["code"] == "invalid_argument" and codec.HEADER_LENGTH_PROPERTY in props

    # MQTT 3.1.1 without reply_to cannot be answered: dropped and counted, nothing published.
    c311 = TestClient(broker.port, v5=False).wait_connected()
    c311.publish("edged/dev/infer/digits", _json_request(x))
    c311.close()

    body, _ = ask("edged/dev/infer/digits", _json_request(x), b"ok-after")
    assert "outputs" in body
    assert t.counters["dropped"] == 1
    assert t.counters["oversized"] == 1
    assert t.inflight == 0


def test_duplicate_delivery_gets_one_response(
        broker: Broker, transports: Callable[..., MqttTransport], client: TestClient,
        digits_holdout: tuple[np.ndarray, np.ndarray]) -> None:
    t = transports(broker.url)
    x = digits_holdout[0][:1]
    for _ in range(3):
        client.publish("edged/dev/infer/digits", _json_request(x), ResponseTopic=f"{REPLY}/dup", CorrelationData=b"d-1")
    client.publish("edged/dev/infer/digits", _json_request(x), ResponseTopic=f"{REPLY}/dup", CorrelationData=b"d-2")
    got = [client.get(where=lambda m: m.topic == f"{REPLY}/dup") for _ in range(2)]
    assert sorted(prop(m, "CorrelationData") for m in got) == [b"d-1", b"d-2"]
    assert not [m for m in client.drain(0.3) if m.topic == f"{REPLY}/dup"]
    assert t.counters["duplicates"] == 2

    c311 = TestClient(broker.port, v5=False).wait_connected()
    c311.subscribe(f"{REPLY}/#")
    for _ in range(2):
        c311.publish("edged/dev/infer/digits", _json_request(x, reply_to=f"{REPLY}/dup311", id="same"))
    c311.publish("edged/dev/infer/digits", _json_request(x, reply_to=f"{REPLY}/dup311", id="other"))
    ids = [json.loads(c311.get(where=lambda m: m.topic == f"{REPLY}/dup311").payload)["id"] for _ in range(2)]
    assert sorted(ids) == ["other", "same"]
    assert not [m for m in c311.drain(0.3) if m.topic == f"{REPLY}/dup311"]
    c311.close()


def test_persistent_session_and_message_expiry(
        broker: Broker, transports: Callable[..., MqttTransport], client: TestClient, digits: Digits) -> None:
    session = {"clean_start": False, "session_expiry_s": 120, "client_id": "edged-persistent", "qos": 1}
    first = transports(broker.url, **session)
    asyncio.run(first.stop())  # the broker keeps the session and queues QoS 1 requests for it
    before = digits.service.statistics("digits")[0]["inference_count"]
    x = digits.x[:1]
    client.publish("edged/dev/infer/digits", _json_request(x), qos=1, ResponseTopic=f"{REPLY}/q",
                   CorrelationData=b"expires", MessageExpiryInterval=1)
    client.publish("edged/dev/infer/digits", _json_request(x), qos=1, ResponseTopic=f"{REPLY}/q",
                   CorrelationData=b"keeps", MessageExpiryInterval=60)
    time.sleep(2.2)  # sleep-ok: the first request expires while nobody serves it (the broker counts whole s)
    transports(broker.url, **session)
    msg = client.get(where=_correlated(b"keeps"))
    assert "outputs" in json.loads(msg.payload)
    assert 0 < prop(msg, "MessageExpiryInterval") <= 60
    # The expired request is never computed: the broker discards it, or, if it is delivered with no time
    # left, the daemon answers with a deadline error instead of running the model.
    for m in [m for m in client.drain(0.5) if m.topic == f"{REPLY}/q"]:
        assert prop(m, "CorrelationData") == b"expires"
        assert json.loads(m.payload)["code"] == "deadline_exceeded"
    assert digits.service.statistics("digits")[0]["inference_count"] == before + 1


# ---- stream bindings --------------------------------------------------------------------------
def test_binding_flood_is_bounded_and_latest_per_topic_delivers_newest(
        broker: Broker, transports: Callable[..., MqttTransport], client: TestClient, digits: Digits) -> None:
    t = transports(broker.url, """
        [[mqtt.bindings]]
        topic = "sensors/+/pixels"
        model = "digits"
        output_topic = "results/{topic}"
        input_format = "raw"
        input_name = "pixels"
        datatype = "FP32"
        shape = [1, -1]
        policy = "latest_per_topic"
        queue_size = 4
        """)
    x = digits.x
    preds = [int(np.argmax(digits.expected(x[i:i + 1]))) for i in range(40)]
    a = 0
    b = next(i for i in range(40) if preds[i] != preds[a])
    client.subscribe("results/#")
    topics = [f"sensors/cam{k}/pixels" for k in range(3)]
    n = 1500
    for _ in range(n - 1):
        for tp in topics:
            client.publish(tp, x[a].tobytes(), qos=0)
    for tp in topics:
        client.publish(tp, x[b].tobytes(), qos=1)  # the newest message of every topic

    newest: dict[str, int] = {}
    while len(newest) < len(topics):
        msg = client.get(where=lambda m: m.topic.startswith("results/"))
        out = json.loads(msg.payload)
        assert msg.topic == f"results/{out['input_topic']}" and out["timestamp"] > 0
        if int(np.argmax(out["outputs"][0]["data"])) == preds[b]:
            newest[out["input_topic"]] = 1
    st = t.binding_stats()[0]
    deadline = time.monotonic() + 10
    while st.received < n * len(topics) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert st.received == n * len(topics)
    assert st.high_water <= len(topics)  # one waiting message per topic at most
    assert st.processed + st.dropped + st.errors + st.expired == st.received
    assert st.errors == 0
    print(f"binding flood: {st.received} received, {st.processed} computed, {st.dropped} superseded, "
          f"high water {st.high_water}")


def test_binding_buffer_policies() -> None:
    def item(topic: str, i: int) -> Item:
        return Item(topic, bytes([i]), None, 0.0, None)

    q = BindingBuffer("queue", 3)
    for i in range(5):
        q.put(item("t", i))
    assert [q.get(0).payload[0] for _ in range(3)] == [0, 1, 2]  # type: ignore[union-attr]
    assert q.stats.dropped == 2 and q.get(0) is None

    d = BindingBuffer("drop_oldest", 3)
    for i in range(5):
        d.put(item("t", i))
    assert [d.get(0).payload[0] for _ in range(3)] == [2, 3, 4]  # type: ignore[union-attr]

    latest = BindingBuffer("latest_per_topic", 2)
    for i in range(6):
        latest.put(item(f"t{i % 2}", i))
    latest.put(item("t9", 9))  # a third topic pushes out the longest-waiting one
    got = [(it.topic, it.payload[0]) for it in iter(lambda: latest.get(0), None)]
    assert got == [("t1", 5), ("t9", 9)]
    assert latest.stats.high_water == 2


def test_binding_config_errors_name_the_key() -> None:
    with pytest.raises(ConfigError) as e:
        validate_bindings([
            {"topic": "a/#", "model": "digits"},
            {"topic": "a/#/b", "model": "digits", "policy": "newest"},
            {"topic": "x", "model": "digits", "input_format": "raw"},
            {"topic": "x", "model": "digits", "output_topic": "out/{nope}", "colour": 1},
            {"topic": "x", "model": "digits", "output_topic": "out/{topic!x}"},
        ])
    problems = "\n".join(e.value.problems)
    for key in ("mqtt.bindings[1].topic", "mqtt.bindings[1].policy", "mqtt.bindings[2]: ",
                "mqtt.bindings[3].output_topic", "mqtt.bindings[3].colour: unknown key",
                "mqtt.bindings[4].output_topic: Value error, not a valid template"):
        assert key in problems, problems
    assert "mqtt.bindings[0]" not in problems


# ---- availability and failures ----------------------------------------------------------------
def _status(c: TestClient, topic: str, state: str, timeout: float = 20) -> dict[str, Any]:
    msg = c.get(timeout, where=lambda m: bool(m.topic == topic and m.payload
                                              and json.loads(m.payload)["state"] == state))
    return dict(json.loads(msg.payload))


def test_retained_status_on_connect_and_offline_on_clean_stop(
        broker: Broker, transports: Callable[..., MqttTransport]) -> None:
    t = transports(broker.url, device="stat")
    watcher = TestClient(broker.port).wait_connected()
    watcher.subscribe("edged/stat/#")
    online = _status(watcher, "edged/stat/status", "online")
    # The retained status lists every entry of the repository the service holds (models/ may also hold
    # example pipelines and fetched models), each with the state the manager gives it.
    held = {(str(s["name"]), s["state"]) for s in t.service.manager.statuses()}
    assert online["profile"] == "test-profile" and {(m["name"], m["state"]) for m in online["models"]} == held
    assert {("digits", "ready"), ("mobilenet", "ready")} <= held
    model = _status(watcher, "edged/stat/models/mobilenet/status", "ready")
    assert model["backend"] == "onnxruntime" and model["version"] == 1
    asyncio.run(t.stop())
    assert _status(watcher, "edged/stat/status", "offline")["reason"] == "stopped"
    watcher.close()


def test_broker_restart_mid_stream_recovers(
        broker: Broker, transports: Callable[..., MqttTransport],
        digits_holdout: tuple[np.ndarray, np.ndarray]) -> None:
    t = transports(broker.url)
    x = digits_holdout[0][:1]
    stop = threading.Event()
    stream = TestClient(broker.port).wait_connected()

    def keep_sending() -> None:
        i = 0
        while not stop.is_set():
            i += 1
            with contextlib.suppress(Exception):
                stream.publish("edged/dev/infer/digits", _json_request(x), qos=0, ResponseTopic=f"{REPLY}/stream",
                               CorrelationData=str(i).encode())
            time.sleep(0.005)  # sleep-ok: paces the stream

    sender = threading.Thread(target=keep_sending, daemon=True)
    sender.start()
    usage = []
    try:
        for cycle in range(3):
            broker.restart()
            t0 = time.monotonic()
            probe = TestClient(broker.port).wait_connected()
            probe.subscribe(f"{REPLY}/probe")
            got = None
            while got is None and time.monotonic() - t0 < 20:
                probe.publish("edged/dev/infer/digits", _json_request(x), qos=0, ResponseTopic=f"{REPLY}/probe",
                              CorrelationData=f"{cycle}-{time.monotonic()}".encode())
                with contextlib.suppress(AssertionError):
                    got = probe.get(0.25)
            probe.close()
            assert got is not None, "no reply after the broker restarted"
            print(f"broker restart {cycle + 1}: serving again {time.monotonic() - t0:.2f}s after the broker came back")
            del probe
            gc.collect()  # finished test clients hold sockets until collected
            usage.append((process_fds(), threading.active_count()))
    finally:
        stop.set()
        sender.join(5)
        stream.client.loop_stop()
    assert t.link.changes >= 6  # up, down, up, ... logged once per change
    assert usage[-1][0] <= usage[0][0] + 2 and usage[-1][1] <= usage[0][1] + 1, usage
    end = time.monotonic() + 5
    while t.inflight and time.monotonic() < end:
        time.sleep(0.05)
    assert t.inflight == 0


def test_unreachable_broker_at_start_logs_once_and_connects_later(
        tmp_path: Path, transports: Callable[..., MqttTransport], caplog: pytest.LogCaptureFixture) -> None:
    broker = Broker(tmp_path / "late")
    caplog.set_level(logging.INFO, logger="edged.transports.mqtt.transport")
    t = transports(broker.url, ready=False, reconnect_min_s=0.05, reconnect_max_s=0.2)
    end = time.monotonic() + 20
    while t.session.backoff.attempts < 4 and time.monotonic() < end:
        time.sleep(0.05)
    assert t.session.backoff.attempts >= 4 and not t.link.up
    downs = [r for r in caplog.records if "not connected" in r.getMessage()]
    assert len(downs) == 1, [r.getMessage() for r in downs]
    broker.start()
    try:
        assert t.wait_ready(20)
        with MqttClient(broker.url, "dev") as c:
            assert c.infer("digits", {"pixels": np.zeros((1, 64), np.float32)})["probabilities"].shape == (1, 10)
    finally:
        broker.stop()
    assert len([r for r in caplog.records if "connected" in r.getMessage() and r.levelno == logging.INFO]) >= 1


def test_kill_9_of_edged_run_publishes_offline_will(
        broker: Broker, model_repo: Callable[..., Path], write_config: Callable[..., Path], tmp_path: Path,
        digits_holdout: tuple[np.ndarray, np.ndarray]) -> None:
    cfg = write_config(model_repo("digits"), f"""
        [http]
        enabled = false
        [shm]
        enabled = false
        [mqtt]
        url = "{broker.url}"
        keepalive_s = 30
        """)
    watcher = TestClient(broker.port).wait_connected()
    watcher.subscribe("edged/test-device/status")
    for sig, reason in ((signal.SIGTERM, "stopped"), (signal.SIGKILL, "connection lost")):
        log = (tmp_path / f"edged-{sig.name}.log").open("wb")
        proc = subprocess.Popen([*EDGED, "run", "--config", str(cfg)], stdout=log, stderr=subprocess.STDOUT)
        try:
            _status(watcher, "edged/test-device/status", "online", timeout=60)
            with MqttClient(broker.url, "test-device") as c:
                out = c.infer("digits", {"pixels": digits_holdout[0][:2]})
            assert out["probabilities"].shape == (2, 10)
            proc.send_signal(sig)
            offline = _status(watcher, "edged/test-device/status", "offline")
            assert offline["reason"] == reason
            print(f"{sig.name}: retained status turned offline ({reason})")
        finally:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait(10)
            log.close()
    late = TestClient(broker.port).wait_connected()  # a later subscriber sees the retained offline
    late.subscribe("edged/test-device/status")
    assert json.loads(late.get(where=lambda m: m.retain).payload)["state"] == "offline"
    late.close()
    watcher.close()


# ---- security ---------------------------------------------------------------------------------
def test_mutual_tls_with_test_ca(tmp_path: Path, transports: Callable[..., MqttTransport],
                                 digits_holdout: tuple[np.ndarray, np.ndarray]) -> None:
    ca = make_test_ca(tmp_path / "ca")
    broker = Broker(tmp_path / "tlsbroker", ca=ca).start()
    try:
        transports(f"mqtts://127.0.0.1:{broker.tls_port}", f"""
            [mqtt.tls]
            ca_file = "{ca.ca}"
            cert_file = "{ca.client_cert}"
            key_file = "{ca.client_key}"
            """)
        with MqttClient(f"mqtts://127.0.0.1:{broker.tls_port}", "dev", ca_file=ca.ca, cert_file=ca.client_cert,
                        key_file=ca.client_key) as c:
            assert c.infer("digits", {"pixels": digits_holdout[0][:1]})["probabilities"].shape == (1, 10)

        assert broker.tls_port is not None
        anonymous = TestClient(broker.tls_port, tls={"ca_certs": str(ca.ca)})
        assert anonymous.failed.wait(10) and not anonymous.connected.is_set()
        anonymous.client.loop_stop()
        r = subprocess.run(["mosquitto_pub", "-p", str(broker.tls_port), "--cafile", str(ca.ca), "-t", "x",
                            "-m", "y"], capture_output=True, timeout=30)
        assert r.returncode != 0
    finally:
        broker.stop()


def test_tls_config_with_missing_files_refuses_to_start(tmp_path: Path, service: InferenceService) -> None:
    cfg = parse_config(f"""
        [mqtt]
        url = "mqtts://127.0.0.1:8883"
        [mqtt.tls]
        ca_file = "{tmp_path / 'ca.crt'}"
        cert_file = "{tmp_path / 'client.crt'}"
        key_file = "{tmp_path / 'client.key'}"
        """)
    with pytest.raises(ConfigError) as e:
        MqttTransport(cfg, service, "p")
    assert [p.split(":")[0] for p in e.value.problems] == ["mqtt.tls.ca_file", "mqtt.tls.cert_file",
                                                          "mqtt.tls.key_file"]


def test_username_password(tmp_path: Path, transports: Callable[..., MqttTransport],
                           caplog: pytest.LogCaptureFixture) -> None:
    broker = Broker(tmp_path / "auth", passwords={"edge": "s3cret"}).start()
    try:
        transports(broker.url, 'username = "edge"\npassword = "s3cret"', device="good")
        caplog.set_level(logging.INFO, logger="edged.transports.mqtt.transport")
        bad = transports(broker.url, 'username = "edge"\npassword = "wrong"', device="bad", ready=False,
                         reconnect_min_s=0.05, reconnect_max_s=0.1)
        end = time.monotonic() + 10
        while bad.session.backoff.attempts < 3 and time.monotonic() < end:
            time.sleep(0.05)
        assert bad.session.backoff.attempts >= 3, "the refused client did not retry"
        assert not bad.ready.is_set()
        refused = [r for r in caplog.records if "refused" in r.getMessage()]
        assert len(refused) == 1
    finally:
        broker.stop()


@pytest.mark.parametrize("protocol", ["5", "3.1.1"])
def test_refused_request_subscription_is_reported(transports: Callable[..., MqttTransport],
                                                  caplog: pytest.LogCaptureFixture, protocol: str) -> None:
    broker = RefusingBroker()
    try:
        caplog.set_level(logging.INFO, logger="edged.transports.mqtt.transport")
        t = transports(broker.url, f'protocol = "{protocol}"', ready=False)
        with pytest.raises(EdgedError) as e:
            t.wait_ready(10)
        assert e.value.code is ErrorCode.FAILED_PRECONDITION and "infer/+" in e.value.message
        assert not t.ready.is_set() and t.link.up
        assert t.link.subscription_error is not None
        refused = [r for r in caplog.records if "refused the request subscription" in r.getMessage()]
        assert len(refused) == 1
        # The retained device status says why no request will be served.
        end = time.monotonic() + 10
        status: dict[str, Any] = {}
        while "error" not in status and time.monotonic() < end:
            topic, payload = broker.published.get(timeout=max(0.01, end - time.monotonic()))
            if topic == "edged/dev/status":
                status = json.loads(payload)
        assert status["state"] == "online" and "refused" in status["error"]
    finally:
        broker.close()


# ---- the client helper ------------------------------------------------------------------------
@pytest.mark.parametrize(("protocol", "binary"), [("5", True), ("5", False), ("3.1.1", True), ("3.1.1", False)])
def test_client_helper(broker: Broker, transports: Callable[..., MqttTransport], digits: Digits, protocol: str,
                       binary: bool) -> None:
    transports(broker.url)
    x = digits.x[:4]
    with MqttClient(broker.url, "dev", protocol=protocol, binary=binary) as c:  # type: ignore[arg-type]
        np.testing.assert_allclose(c.infer("digits", {"pixels": x})["probabilities"], digits.expected(x),
                                   rtol=1e-5)
        img = np.zeros((1, 3, 48, 192), np.float32)
        assert c.infer("mobilenet", {"image": img}, version=1)["probabilities"].shape == (1, 37)
        with pytest.raises(MqttServerError) as e:
            c.infer("nosuch", {"pixels": x})
        assert e.value.code is ErrorCode.NOT_FOUND
        status = c.model_status("mobilenet")
        assert status["state"] == "ready"
        assert status["inputs"] == [{"name": "image", "datatype": "FP32", "shape": [-1, 3, 48, 192]}]
    with MqttClient(broker.url, "nobody-home") as c, pytest.raises(DeadlineExceededError):
        c.infer("digits", {"pixels": x}, timeout=0.3)


# ---- codec units ------------------------------------------------------------------------------
def test_codec_framing_is_unambiguous() -> None:
    header = {"inputs": [], "id": "x"}
    for form in codec.Form:
        used, payload, hlen = codec.frame(form, header, [b"\1\2\3"], properties=True)
        fr = codec.parse(payload, hlen if used is codec.Form.BINARY_PROPERTY else None)
        assert fr.header == header and bytes(fr.tail) == b"\1\2\3"
    assert codec.frame(codec.Form.JSON, header, [], properties=False)[0] is codec.Form.JSON
    assert codec.frame(codec.Form.JSON, header, [b"x"], properties=False)[0] is codec.Form.BINARY_PREFIX
    assert codec.split(b' {"a": 1}', None)[0] is codec.Form.JSON
    with pytest.raises(Exception, match="header length prefix"):
        codec.split(b"\0\0\0\xff{}", None)
    topics = codec.Topics("site/edged", "d1")
    assert topics.parse_infer("site/edged/d1/infer/m") == ("m", None)
    assert topics.parse_infer("site/edged/d1/infer/m/3") == ("m", 3)
    assert codec.topic_matches("a/+/c", "a/b/c") and codec.topic_matches("a/#", "a")
    assert not codec.topic_matches("a/+", "a/b/c") and not codec.topic_matches("#", "$SYS/x")


def test_recent_keys_and_backoff_are_bounded() -> None:
    keys = RecentKeys(ttl_s=60, max_entries=100)
    assert not keys.seen("a") and keys.seen("a")
    for i in range(1000):
        keys.seen(i)
    assert len(keys) <= 100
    short = RecentKeys(ttl_s=0.0)
    assert not short.seen("a") and not short.seen("a")
    b = Backoff(0.5, 8.0)
    delays = [b.next_delay() for _ in range(12)]
    assert all(0.25 <= d <= 8.0 for d in delays) and max(delays[6:]) > 4.0
    b.reset()
    assert b.next_delay() <= 0.5


def test_packed_properties_match_paho_encoding() -> None:
    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.properties import Properties

    from edged.protocol.mqtt_properties import publish_properties

    slow = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
    slow.MessageExpiryInterval = 42
    slow.ContentType = codec.CONTENT_TYPE_JSON
    slow.ResponseTopic = "a/reply/ü"
    slow.CorrelationData = bytes(range(200))
    slow.UserProperty = [(codec.HEADER_LENGTH_PROPERTY, "1234"), ("k", "v")]
    fast = publish_properties(expiry_s=42, content_type=codec.CONTENT_TYPE_JSON, response_topic="a/reply/ü",
                              correlation=bytes(range(200)),
                              user=[(codec.HEADER_LENGTH_PROPERTY, "1234"), ("k", "v")])
    assert fast.pack() == slow.pack()  # type: ignore[no-untyped-call]
    assert publish_properties().pack() == Properties(PacketTypes.PUBLISH).pack()  # type: ignore[no-untyped-call]


# ---- a stock broker (no set_tcp_nodelay): no delayed-ACK stall that edged can remove ----------------
@pytest.fixture(scope="module")
def stock(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Broker, EdgedRun]]:
    tmp = tmp_path_factory.mktemp("stock")
    broker = Broker(tmp / "broker", stock=True).start()
    try:
        daemon = EdgedRun(tmp / "edged", broker, "stock")
        try:
            yield broker, daemon
        finally:
            daemon.stop()
    finally:
        broker.stop()


def _no_stall(call: Callable[[int], bool], seconds: float = 1.0) -> LoopResult:
    """Round trips at concurrency 1 for ``seconds``: none may sit at the broker's delayed-ACK stall.

    The stall puts *every* QoS 1 round trip at 40-52 ms (23/s); without it they take about a millisecond
    here, a few under load. So the test judges the shape of the latencies, not a rate a busy shared
    machine may miss: the median far below the timer and almost no round trip at it. The rates the
    issue asks for (>= 500/s at QoS 1, >= 1000/s at QoS 0) are measured by bench/mqtt_stall.py."""
    res = closed_loop(call, seconds)
    assert res.errors == 0
    at_timer = sum(1 for ms in res.latencies_ms if STALL_LOW_S * 1e3 <= ms <= STALL_HIGH_S * 1e3)
    print(f"{res.done} round trips in {res.seconds:.1f}s: {res.rate:,.0f}/s, p50 {res.p50_ms:.2f} ms, "
          f"{at_timer} at the delayed-ACK interval")
    assert res.done >= 20, "too few round trips to judge"
    assert res.p50_ms < STALL_LOW_S * 1e3 / 4, f"p50 {res.p50_ms:.1f} ms: round trips wait for a timer"
    assert at_timer <= res.done // 10, f"{at_timer} of {res.done} round trips sat at the delayed-ACK interval"
    return res


@pytest.mark.parametrize("qos", [2, 1, 0])
def test_stock_broker_edged_client_has_no_stall(stock: tuple[Broker, EdgedRun], qos: int,
                                                digits_holdout: tuple[np.ndarray, np.ndarray]) -> None:
    broker, _ = stock
    x = {"pixels": digits_holdout[0][:1]}
    with MqttClient(broker.url, "stock", qos=qos) as c:
        expected = c.infer("digits", x)["probabilities"]

        def call(i: int) -> bool:
            return bool(np.array_equal(c.infer("digits", x)["probabilities"], expected))

        _no_stall(call)


@pytest.mark.parametrize(("qos", "reply_qos"), [(1, 1), (1, 0), (0, 0)])
def test_stock_broker_mosquitto_cli_has_no_stall(stock: tuple[Broker, EdgedRun], qos: int, reply_qos: int) -> None:
    broker, _ = stock
    cli = MosquittoCliRequester(broker.port, "edged/stock/infer/digits", qos=qos, reply_qos=reply_qos)
    try:
        _no_stall(cli)
    finally:
        cli.close()


# ---- overload: a flood gets a reply for every request -----------------------------------------------
@pytest.mark.parametrize("reply_qos", [1, 0])
def test_qos1_flood_gets_a_reply_for_every_request(tmp_path: Path, transports: Callable[..., MqttTransport],
                                                   digits: Digits, reply_qos: int) -> None:
    broker = Broker(tmp_path / "flood-broker", nodelay=True).start()
    try:
        renderer = MetricsRenderer(digits.service)  # the daemon's /metrics, handed to the transport
        t = transports(broker.url, max_pending_replies=16, reply_qos=reply_qos, metrics=renderer)
        c = TestClient(broker.port).wait_connected()
        c.subscribe(f"{REPLY}/flood", qos=1)
        n = 1000  # mosquitto queues at most 1000 QoS 1 messages per client (max_queued_messages): no broker drops
        x = digits.x[:1]
        body = _json_request(x)
        for i in range(n):  # as fast as paho takes them: no waiting for PUBACKs
            props = publish_properties(ResponseTopic=f"{REPLY}/flood", CorrelationData=str(i).encode())
            assert c.client.publish("edged/dev/infer/digits", body, qos=1, properties=props).rc == 0
        answers: dict[int, str] = {}
        end = time.monotonic() + 60
        while len(answers) < n and time.monotonic() < end:
            try:
                msg = c.messages.get(timeout=max(0.1, end - time.monotonic()))
            except Exception:
                break
            i = int(msg.properties.CorrelationData)  # type: ignore[union-attr]
            assert i not in answers, f"request {i} got two replies"
            doc = json.loads(msg.payload)
            answers[i] = doc.get("code", "answer")
            if "code" not in doc:
                assert np.allclose(np.asarray(doc["outputs"][0]["data"], np.float32), digits.expected(x).ravel(),
                                   atol=1e-5)
        c.close()
        kinds = collections.Counter(answers.values())
        print(f"{n} requests at QoS 1 -> {dict(kinds)} (replies at QoS {reply_qos}); counters {dict(t.counters)}")
        assert len(answers) == n, f"{n - len(answers)} requests got no reply: {dict(kinds)}"
        assert set(kinds) <= {"answer", "overloaded"}
        # With QoS 1 replies the backlog holds every reply until the broker acknowledges it, so a flood always
        # reaches the limit; with QoS 0 replies it holds only requests being decoded or computed, and on a
        # machine where digits computes faster than the broker delivers it may not (seen once in CI): there
        # the test still checks one reply per request and the counters, but cannot insist on refusals.
        if reply_qos == 1:
            assert kinds["overloaded"] > 0, "the flood never reached max_pending_replies: the test proves nothing"
        assert t.counters["requests"] == n
        assert t.counters["overloaded"] == kinds["overloaded"]
        assert t.counters["replies_dropped"] == 0
        settle = time.monotonic() + 5  # the last PUBACKs reach the daemon just after the client has the replies
        while t.backlog() and time.monotonic() < settle:
            time.sleep(0.01)
        assert t.backlog() == 0
        metrics = renderer.render().decode()
        assert f"edged_mqtt_overloaded_total {float(kinds['overloaded'])}" in metrics
        assert "edged_mqtt_replies_dropped_total 0.0" in metrics
    finally:
        broker.stop()


def test_stock_broker_stall_edged_cannot_remove_is_detected_once(stock: tuple[Broker, EdgedRun]) -> None:
    """A plain paho client at QoS 1: the broker holds each reply behind its PUBACK for the client's delayed
    ACK. Only the broker (or the client) can fix that; edged says so once, in its log and in edged status."""
    broker, daemon = stock
    watcher = TestClient(broker.port).wait_connected()
    watcher.subscribe("edged/stock/telemetry", qos=0)
    paho = PahoRequester(broker.port, "edged/stock/infer/digits", qos=1, reply_qos=1)
    try:
        res = closed_loop(paho, 4.0)
    finally:
        paho.close()
    print(f"plain paho, QoS 1: {res.rate:.0f}/s, p50 {res.p50_ms:.1f} ms")
    assert 36 <= res.p50_ms <= 60, "expected the broker's delayed-ACK stall on a stock mosquitto"
    end = time.monotonic() + 10
    while True:  # the status file is rewritten every second
        out = subprocess.run([*EDGED, "status", "--config", str(daemon.config)], capture_output=True, text=True)
        if "set_tcp_nodelay true" in out.stdout or time.monotonic() > end:
            break
        time.sleep(0.5)
    print(out.stdout)
    assert "note: MQTT clients wait ~4" in out.stdout and "set_tcp_nodelay true" in out.stdout
    assert "mqtt       " in out.stdout and "0 replies dropped" in out.stdout
    said = [line for line in daemon.log.read_text().splitlines() if "MQTT clients wait" in line]
    assert len(said) == 1, said
    sample = json.loads(watcher.get(timeout=5, where=lambda m: b'"broker_stall"' in m.payload).payload)
    assert sample["mqtt"]["requests"] > 0 and "set_tcp_nodelay" in sample["mqtt"]["broker_stall"]
    watcher.close()


def test_packaged_broker_dropin_removes_the_stall_for_any_client(tmp_path: Path,
                                                                 transports: Callable[..., MqttTransport]) -> None:
    """Debian's stock mosquitto.conf plus the conf.d file the package installs: a plain paho client at QoS 1
    (the case only the broker can fix) no longer waits for delayed ACKs."""
    broker = Broker(tmp_path / "broker", stock=True, include_dir=REPO_ROOT / "packaging" / "mosquitto").start()
    try:
        transports(broker.url)
        paho = PahoRequester(broker.port, "edged/dev/infer/digits", qos=1, reply_qos=1)
        try:
            _no_stall(paho)
        finally:
            paho.close()
    finally:
        broker.stop()


@pytest.mark.parametrize("qos", [1, 0])
def test_perf_over_mqtt_reports_the_qos_on_a_stock_broker(stock: tuple[Broker, EdgedRun], qos: int) -> None:
    _, daemon = stock
    r = subprocess.run([*EDGED, "perf", "--config", str(daemon.config), "-m", "digits", "--transport", "mqtt",
                        "--qos", str(qos), "--concurrency-range", "1:2:1", "-p", "300", "-s", "50", "-r", "3"],
                       capture_output=True, text=True, timeout=120)
    print(r.stdout[-2500:], r.stderr[-1000:])
    assert r.returncode == 0
    assert r.stdout.count(f"MQTT: requests at QoS {qos}, replies delivered at QoS 0") == 2
    assert "delayed-ACK" not in r.stdout  # edged's own client removes every stall on its side


def test_delayed_ack_pattern_recognition() -> None:
    from edged.transports.mqtt.stall import clustered_at_delayed_ack, perf_warning

    assert perf_warning([0.0440, 0.0446], 0.0003) is not None
    assert perf_warning([0.0440, 0.0446], None) is not None
    assert perf_warning([0.0440, 0.0446], 0.030) is None  # the daemon itself is slow: not the stall
    assert perf_warning([0.0440, 0.120], 0.0003) is None  # not clustered
    assert perf_warning([0.0006, 0.0009], 0.0003) is None
    assert clustered_at_delayed_ack([0.044] * 60 + [0.001] * 4)
    assert not clustered_at_delayed_ack([0.044] * 40 + [0.025] * 24)  # a 40-Hz sender with jitter is not it
    assert not clustered_at_delayed_ack([0.044] * 8)  # too few to judge
