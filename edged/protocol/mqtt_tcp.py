"""TCP settings both ends of an MQTT link set on their socket, so that replies never wait on delayed ACKs.

The daemon's transport and ``edged.client.mqtt`` share them; paho calls ``no_delay`` when it opens
the socket, ``quick_ack`` is re-armed from the callbacks that follow each read.
"""

from __future__ import annotations

import socket
from typing import Any


def no_delay(client: Any, userdata: Any, sock: Any) -> None:
    """Disable Nagle: a reply written while the previous one is unacknowledged would wait for the
    peer's delayed ACK (40 ms on Linux), which is what pipelined requests hit."""
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except (OSError, AttributeError):
        pass  # not a TCP socket (websockets wrapper, Unix socket)


def quick_ack(client: Any) -> None:
    """Acknowledge what was just read at once instead of after Linux's delayed-ACK timer (~40 ms).

    mosquitto (without ``set_tcp_nodelay``) holds its next write to us behind Nagle's algorithm until
    we ACK its last one; when that last one was a PUBACK or a message we do not answer with data of
    our own, our kernel waits for its timer and every request or reply behind it waits too. Linux
    forgets TCP_QUICKACK after a while, so this is re-armed from the callbacks that follow each read;
    setting it also sends an ACK that is already pending.
    """
    sock = client.socket()
    if sock is None:
        return
    try:
        sock.setsockopt(socket.IPPROTO_TCP, _TCP_QUICKACK, 1)
    except (OSError, AttributeError):
        pass  # not TCP (websockets wrapper) or not Linux


_TCP_QUICKACK = getattr(socket, "TCP_QUICKACK", 12)
