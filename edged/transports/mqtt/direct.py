"""A QoS 0 reply written by paho's own network thread at once, instead of at its loop's next turn.

A request answered inline runs in paho's ``on_message``. There, ``publish()`` queues the packet,
writes a byte to paho's wake-up socket pair and returns; the packet leaves only after the callback
returns and paho's loop has selected again, and for a QoS 0 packet paho then builds a PUBACK reason
code and properties to call ``on_publish``. On the reply path that took about 30 us for
``publish()`` alone (docs/benchmarks.md, issue 41). In threaded mode only paho's thread writes to
its socket, so when this is that thread, nothing is queued before the reply and the socket is plain
TCP, the PUBLISH is built here (the bytes paho would send) and written at once. What the kernel
does not take is queued in paho as a packet of its own, ahead of anything another thread queued
meanwhile, so paho finishes it first. In every other case nothing is written and the caller publishes as before.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any, Literal

import paho.mqtt.client as mqtt

from edged.protocol.protobuf import varint

_PUBLISH_QOS0 = 0x30
_MAX_REMAINING = 268_435_455  # the largest MQTT remaining length (four varint bytes)
_JOIN_BELOW = 16384  # smaller payloads are copied behind the header and sent in one call


Written = Literal[True] | mqtt.MQTTMessageInfo | None


def publish_now(client: Any, topic: str, payload: bytes, properties: Any) -> Written:
    """Write a QoS 0 PUBLISH on ``client``'s socket now.

    True: written whole. A message info: partly written, the rest queued in paho (owed until paho
    says it is published). None: nothing written, because this is not paho's thread, something is
    queued, the socket is not plain TCP, the topic is not one paho would send, or the kernel took
    nothing; the caller uses ``client.publish``. ``properties`` are MQTT 5 ones (their ``pack()``)
    or None.
    """
    if getattr(client, "_thread", None) is not threading.current_thread():
        return None
    sock = getattr(client, "_sock", None)
    queued = getattr(client, "_out_packet", None)
    if type(sock) is not socket.socket or queued is None or queued:
        return None
    name = topic.encode()
    if not name or len(name) > 65535 or b"+" in name or b"#" in name:
        return None  # paho raises its own error for these
    props = b""
    if getattr(client, "_protocol", None) == mqtt.MQTTv5:
        props = properties.pack() if properties is not None else b"\0"
    remaining = 2 + len(name) + len(props) + len(payload)
    if remaining > _MAX_REMAINING:
        return None
    head = b"%c%b%b%b%b" % (_PUBLISH_QOS0, varint(remaining), len(name).to_bytes(2, "big"), name, props)
    whole = None
    try:
        if len(payload) < _JOIN_BELOW:
            whole = head + payload
            sent = sock.send(whole)
        else:
            sent = sock.sendmsg([head, payload])
    except OSError:  # BlockingIOError (a full send buffer), or a broken link paho will find itself
        return None
    client._last_msg_out = time.monotonic()  # paho's keepalive clock (time.monotonic in paho 2)
    total = len(head) + len(payload)
    if sent >= total:
        return True
    if sent == 0:
        return None
    rest = (whole if whole is not None else head + payload)[sent:]
    mid = client._mid_generate()
    info = mqtt.MQTTMessageInfo(mid)
    # At the front: another thread's publish() may have queued a packet since the queue was seen empty,
    # and a packet written before our rest would land inside our PUBLISH on the wire. Only paho's thread
    # (this one) takes from the front, so the rest is what it writes next.
    queued.appendleft({"command": _PUBLISH_QOS0, "mid": mid, "qos": 0, "pos": 0, "to_process": len(rest),
                       "packet": rest, "info": info})
    client._call_socket_register_write()
    return info
