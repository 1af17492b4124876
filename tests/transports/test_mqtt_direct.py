"""QoS 0 replies written by paho's thread at once (edged.transports.mqtt.direct) are the bytes paho sends.

A real paho client in the state its network thread runs in (``loop_start``: its thread set, a plain
socket, nothing queued), one end of a socket pair standing for the broker connection; the real
broker path is covered by test_mqtt.py, whose inline answers all take this way now.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from edged.protocol.mqtt_properties import publish_properties
from edged.transports.mqtt.direct import publish_now

TOPIC = "edged/dev1/reply/cam-7"


def _client(protocol: int) -> mqtt.Client:
    return mqtt.Client(CallbackAPIVersion.VERSION2, client_id="direct-test", protocol=protocol)


@pytest.fixture
def link() -> Iterator[tuple[socket.socket, socket.socket]]:
    ours, broker = socket.socketpair()
    ours.setblocking(False)
    try:
        yield ours, broker
    finally:
        ours.close()
        broker.close()


def _on_network_thread(client: mqtt.Client, sock: socket.socket) -> None:
    client._sock = sock  # type: ignore[assignment]  # as after connect()
    client._thread = threading.current_thread()  # as in loop_start(): this test is the network thread


def _paho_bytes(client: mqtt.Client, payload: bytes, props: object) -> bytes:
    """What paho's own publish() queues for the same message (on a connected client)."""
    queued: list[bytes] = []

    def capture(command: int, packet: bytearray, mid: int, qos: int, info: object = None) -> int:
        queued.append(bytes(packet))
        return 0

    client._packet_queue = capture  # type: ignore[method-assign,assignment]
    try:
        client.publish(TOPIC, payload, qos=0, properties=props)  # type: ignore[arg-type]
    finally:
        del client._packet_queue
    return queued[0]


def _read(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        assert chunk, "the connection closed early"
        out += chunk
    return bytes(out)


@pytest.mark.parametrize("protocol", [mqtt.MQTTv5, mqtt.MQTTv311])
@pytest.mark.parametrize("size", [0, 300, 70_000])
def test_a_reply_is_written_at_once_as_the_bytes_paho_sends(link: tuple[socket.socket, socket.socket],
                                                            protocol: int, size: int) -> None:
    ours, broker = link
    client = _client(protocol)
    payload = bytes(range(256)) * (size // 256) + b"x" * (size % 256)
    props = None
    if protocol == mqtt.MQTTv5:
        props = publish_properties(correlation=b"\x00\x01corr", content_type="application/octet-stream",
                                   user=[("edged-header-length", "42")])
    _on_network_thread(client, ours)
    want = _paho_bytes(client, payload, props)
    before = client._last_msg_out
    assert publish_now(client, TOPIC, payload, props) is True
    assert _read(broker, len(want)) == want
    assert not client._out_packet
    assert client._last_msg_out >= before  # paho's keepalive clock saw the write


def test_a_partial_write_leaves_the_rest_to_paho_in_order(link: tuple[socket.socket, socket.socket]) -> None:
    ours, broker = link
    ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    client = _client(mqtt.MQTTv5)
    payload = bytes(range(256)) * 8192  # 2 MB: more than the socket takes at once
    props = publish_properties(correlation=b"abc")
    _on_network_thread(client, ours)
    want = _paho_bytes(client, payload, props)
    info = publish_now(client, TOPIC, payload, props)
    assert isinstance(info, mqtt.MQTTMessageInfo) and not info.is_published()
    assert len(client._out_packet) == 1

    got = bytearray()
    broker.setblocking(False)
    while len(got) < len(want):  # paho's loop would do this when the socket is writable
        client._packet_write()
        try:
            got += broker.recv(1 << 20)
        except BlockingIOError:
            pass
    assert bytes(got) == want
    assert info.is_published() and not client._out_packet


def test_a_packet_another_thread_queues_during_a_partial_write_goes_after_its_rest(
        link: tuple[socket.socket, socket.socket]) -> None:
    """A scheduler thread may publish (queue a packet) between the partial send and the rest being
    queued: the rest must still leave first, or that packet lands inside our PUBLISH on the wire and
    the broker drops the connection (found by review: 4 corrupt replies in 85, mosquitto "malformed
    packet")."""
    ours, broker = link
    ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    client = _client(mqtt.MQTTv5)
    payload = bytes(range(256)) * 8192
    props = publish_properties(correlation=b"abc")
    _on_network_thread(client, ours)
    want = _paho_bytes(client, payload, props)
    theirs = b"\x30\x05\x00\x01tabc"  # another reply, queued by paho's publish() on its caller's thread
    mid_generate = client._mid_generate

    def another_thread_publishes_meanwhile() -> int:
        t = threading.Thread(target=client._packet_queue, args=(0x30, theirs, 0, 0, mqtt.MQTTMessageInfo(0)))
        t.start()
        t.join()
        return mid_generate()
    client._mid_generate = another_thread_publishes_meanwhile  # type: ignore[method-assign]  # the window
    info = publish_now(client, TOPIC, payload, props)
    assert isinstance(info, mqtt.MQTTMessageInfo)
    assert len(client._out_packet) == 2

    got = bytearray()
    broker.setblocking(False)
    while len(got) < len(want) + len(theirs):
        client._packet_write()
        try:
            got += broker.recv(1 << 20)
        except BlockingIOError:
            pass
    assert bytes(got) == want + theirs


def test_nothing_is_written_off_the_network_thread_or_behind_a_queue(
        link: tuple[socket.socket, socket.socket]) -> None:
    ours, broker = link
    broker.setblocking(False)
    client = _client(mqtt.MQTTv5)
    _on_network_thread(client, ours)

    other: list[object] = []
    t = threading.Thread(target=lambda: other.append(publish_now(client, TOPIC, b"x", None)))
    t.start()
    t.join()
    assert other == [None]

    client._out_packet.append({"command": 0x30, "mid": 1, "qos": 0, "pos": 0, "to_process": 1, "packet": b"q",
                               "info": None})
    assert publish_now(client, TOPIC, b"x", None) is None  # would overtake what paho has queued
    client._out_packet.clear()

    assert publish_now(client, "edged/dev1/reply/#", b"x", None) is None  # paho refuses it itself
    with pytest.raises(BlockingIOError):
        broker.recv(1)  # none of these wrote a byte
