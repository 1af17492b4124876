"""What the MQTT transport owes the broker: requests in work and replies paho has not handed over yet.

One bound (``max_pending_replies``) covers both, so a broker that stops reading, or a flood of
requests, never grows the daemon's memory: requests beyond it are answered "overloaded" while there
is still room to say so, and replies beyond a further reserve are dropped and counted.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import paho.mqtt.client as mqtt


class Backlog:
    """Requests being decoded or computed, plus replies the broker has not taken yet."""

    def __init__(self) -> None:
        # Replies handed to paho that the broker has not taken yet (QoS 0: not yet written; QoS 1: no PUBACK),
        # one queue per QoS: each completes in order, but QoS 0 refusals overtake QoS 1 answers.
        self.unsent: tuple[collections.deque[mqtt.MQTTMessageInfo], ...] = (collections.deque(), collections.deque())
        self.unsent_lock = threading.Lock()
        self.inflight = 0  # requests submitted to the service, not yet answered
        self._inflight_cv = threading.Condition()
        self.pending_decodes = 0  # large requests waiting for (or in) the decode pool
        self.pending_bytes = 0
        self._decode_lock = threading.Lock()

    def count(self) -> int:
        waiting = 0
        with self.unsent_lock:
            for unsent in self.unsent:
                while unsent and unsent[0].is_published():
                    unsent.popleft()
                waiting += len(unsent)
        return waiting + self.inflight + self.pending_decodes

    def handed(self, qos: int, info: mqtt.MQTTMessageInfo) -> None:
        """A reply paho took: owed until the broker has it."""
        with self.unsent_lock:
            self.unsent[qos].append(info)

    def reconnected(self) -> None:
        with self.unsent_lock:
            for q in self.unsent:
                q.clear()  # paho resends its QoS 1 ones; QoS 0 ones were lost with the connection

    def started(self) -> None:
        with self._inflight_cv:
            self.inflight += 1

    def finished(self) -> None:
        with self._inflight_cv:
            self.inflight -= 1
            self._inflight_cv.notify_all()

    def wait_idle(self, end: float) -> None:
        """Wait (until the monotonic ``end`` at most) for the requests in work to be answered."""
        with self._inflight_cv:
            while self.inflight and time.monotonic() < end:
                self._inflight_cv.wait(end - time.monotonic())

    def admit_decode(self, size: int, max_count: int, max_bytes: int) -> bool:
        """Take a large request into the decode pool's bound, or refuse it (False)."""
        with self._decode_lock:
            if self.pending_decodes < max_count and self.pending_bytes + size <= max_bytes:
                self.pending_decodes += 1
                self.pending_bytes += size
                return True
            return False

    def decoded(self, size: int) -> None:
        with self._decode_lock:
            self.pending_decodes -= 1
            self.pending_bytes -= size
