"""Recognising the broker-side delayed-ACK stall from what edged can see.

A broker without ``set_tcp_nodelay`` writes a reply behind its PUBACK for the client's QoS 1
request and, by Nagle's algorithm, holds it until the client's kernel ACKs the PUBACK: the
delayed-ACK timer, 40 ms on Linux (plus scheduling, ~44 ms). edged cannot remove that one from its
side (it is the client's socket and the broker's), but it can notice it: a client working at
concurrency 1 sends its next request as soon as the reply arrives, so the gap between edged's reply
and that client's next QoS 1 request sits at the timer while edged's own time per request is well
under a millisecond. ``edged perf`` sees the same thing directly in its round trips.
"""

from __future__ import annotations

import collections
import statistics
import threading
import time
from collections.abc import Sequence

STALL_LOW_S = 0.036  # Linux's minimum delayed-ACK time is 40 ms (HZ/25); a little slack below...
STALL_HIGH_S = 0.052  # ...and above, for scheduling on a busy device
FAST_OWN_S = 0.005  # edged's own time per request (median) under which a 40 ms gap cannot be edged's doing
WINDOW = 64  # recent samples judged
SHARE = 0.75  # this share of them at the timer is a pattern, not chance

FIX = ("set 'set_tcp_nodelay true' in the broker's configuration (for mosquitto a conf.d file; the edged "
       "package installs /etc/mosquitto/conf.d/edged-nodelay.conf for a local mosquitto, then restart "
       "mosquitto), or let clients publish requests at QoS 0 or set TCP_NODELAY and TCP_QUICKACK on their "
       "sockets as edged's own client does")


def at_delayed_ack(seconds: float) -> bool:
    """One round trip or gap of about the delayed-ACK interval."""
    return STALL_LOW_S <= seconds <= STALL_HIGH_S


def clustered_at_delayed_ack(seconds: Sequence[float]) -> bool:
    """Most of ``seconds`` (round trips or gaps) sit at the delayed-ACK interval."""
    if len(seconds) < 16:
        return False
    return sum(1 for s in seconds if at_delayed_ack(s)) >= SHARE * len(seconds)


def perf_warning(percentiles_s: Sequence[float], own_s: float | None) -> str | None:
    """What ``edged perf`` says when its round trips (e.g. p50 and p90) all sit at the timer while the
    daemon's own time per request (when known) is sub-millisecond; None otherwise."""
    if not percentiles_s or not all(at_delayed_ack(s) for s in percentiles_s):
        return None
    if own_s is not None and own_s >= FAST_OWN_S:
        return None
    own = f" while the daemon spends {own_s * 1e3:.2f} ms per request" if own_s is not None else ""
    return (f"round trips cluster at ~{percentiles_s[0] * 1e3:.0f} ms{own}: the broker's delayed-ACK stall "
            f"(Nagle's algorithm on its socket). Fix: {FIX}")


class StallDetector:
    """Watches reply -> next-request gaps per reply topic; says so once when the pattern shows."""

    MAX_TOPICS = 256

    def __init__(self) -> None:
        self._last_reply: collections.OrderedDict[str, float] = collections.OrderedDict()
        self._gaps: collections.deque[float] = collections.deque(maxlen=WINDOW)
        self._own: collections.deque[float] = collections.deque(maxlen=WINDOW)
        self._lock = threading.Lock()
        self.message: str | None = None  # set once the pattern was seen; never cleared (said once)

    def replied(self, reply_topic: str, own_s: float) -> None:
        """An answer went out on ``reply_topic``; ``own_s``: from the request's arrival to its reply."""
        now = time.monotonic()
        with self._lock:
            self._own.append(own_s)
            self._last_reply[reply_topic] = now
            self._last_reply.move_to_end(reply_topic)
            if len(self._last_reply) > self.MAX_TOPICS:
                self._last_reply.popitem(last=False)

    def request(self, reply_topic: str | None, qos: int) -> str | None:
        """A request arrived; returns the message the first time the pattern is recognised."""
        if reply_topic is None or qos < 1 or self.message is not None:
            return None
        now = time.monotonic()
        with self._lock:
            last = self._last_reply.get(reply_topic)
            if last is None:
                return None
            self._gaps.append(now - last)
            if len(self._gaps) < WINDOW or not clustered_at_delayed_ack(self._gaps):
                return None
            own = statistics.median(self._own) if self._own else 1.0
            if own >= FAST_OWN_S:
                return None
            gap = statistics.median(self._gaps)
            self.message = (f"MQTT clients wait ~{gap * 1e3:.0f} ms for replies that edged computes in "
                            f"{own * 1e3:.2f} ms: the broker holds each reply behind its PUBACK for the "
                            f"client's QoS 1 request until the client's delayed TCP ACK (Nagle's algorithm). "
                            f"Fix: {FIX}")
            return self.message
