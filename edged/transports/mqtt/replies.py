"""Replies of the MQTT transport: each request's one answer or error, published within bounds.

A reply goes only where the reply policy allows (never another device's or the daemon's own
topics): a refused topic is said on the daemon's error topic instead, with the request's
correlation. Replies are published from whichever thread has them (paho's for a request run inline,
a scheduler thread otherwise; paho allows both) and never wait: when the broker stops taking them
they are dropped and counted rather than queued without bound.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from functools import partial
from typing import Any

import paho.mqtt.client as mqtt

from edged.errors import EdgedError, ErrorCode, InternalError
from edged.protocol import media
from edged.protocol import mqtt as codec
from edged.protocol.mqtt import Form
from edged.protocol.mqtt_properties import publish_properties
from edged.protocol.mqtt_topics import ReplyPolicy
from edged.protocol.types import InferResponse
from edged.protocol.v2 import DecodedRequest, dumps, encode_response
from edged.protocol.v2_plans import encode_answer
from edged.transports.mqtt.backlog import Backlog
from edged.transports.mqtt.counts import Counts
from edged.transports.mqtt.direct import publish_now
from edged.transports.mqtt.session import MqttSession
from edged.transports.mqtt.stall import StallDetector
from edged.transports.redact import Scrubber

log = logging.getLogger("edged.transports.mqtt.transport")

# Room for 'overloaded' refusals (small, QoS 0) beyond max_pending_replies: paho reads a burst of requests
# before it writes their refusals. Only a broker that stops reading fills it; then replies are dropped.
REFUSAL_RESERVE = 1024


@dataclass
class Reply:
    """Where and how one request's single response goes."""

    topic: str
    correlation: bytes | None
    request_id: str | None
    form: Form
    qos: int
    deadline: float | None
    received: float = 0.0  # monotonic: when the request arrived
    media: str | None = None  # a raw image/sound request: answered with plain JSON (edged.protocol.media)


class ReplyPublisher:
    """Publishes replies: answers, error replies, refusals of reply topics; counts what it drops."""

    def __init__(
        self,
        session: MqttSession,
        policy: ReplyPolicy,
        *,
        backlog: Backlog,
        counts: Counts,
        stall: StallDetector,
        scrub: Scrubber,
    ) -> None:
        self.session, self.policy, self.topics = session, policy, session.topics
        self.options = session.options
        self.backlog, self.counts, self.stall, self.scrub = backlog, counts, stall, scrub

    def answer(self, decoded: DecodedRequest, reply: Reply, resp: InferResponse) -> None:
        """Encode and publish the one reply: from the thread that computed it (paho's, for a request run
        inline, so paho writes it with no wake-up) or from a completion callback."""
        try:
            if reply.media is not None:
                header = media.answer(resp.model, resp.version, resp.outputs, media=reply.media)
                form, payload, hlen = codec.frame(reply.form, header, [], properties=self.options.v5)
            else:
                head, chunks = encode_answer(resp, decoded, partial(encode_response, resp, decoded))
                form, payload, hlen = codec.frame_encoded(reply.form, head, chunks, properties=self.options.v5)
            if self.send(reply, payload, form, hlen):
                self.stall.replied(reply.topic, time.monotonic() - reply.received)
            self.counts.count("replies")
        except EdgedError as e:
            self.error(reply, e, "")
        except Exception:
            log.exception("MQTT reply failed")
            self.error(reply, InternalError("internal error while encoding the response"), "")

    def error(self, reply: Reply | None, err: EdgedError, topic: str) -> None:
        """The error reply of a request (dropped and counted when it has nowhere to go)."""
        self.counts.count(f"error_{err.code.value}")
        if reply is None:
            self.drop(topic, f"{err.code.value}: {err}")
            return
        try:
            header = codec.error_header(err, reply.request_id)
            header["error"] = self.scrub.text(header["error"])
            form, payload, hlen = codec.frame(reply.form, header, [], properties=self.options.v5)
            self.send(reply, payload, form, hlen, error=err.code.value)
        except Exception:
            log.exception("MQTT error reply failed")

    def send(self, reply: Reply, payload: bytes, form: Form, hlen: int | None, error: str | None = None) -> bool:
        """Hand one reply to paho; False (counted) when it was dropped."""
        client = self.session.client
        if client is None:
            return False
        if self.backlog.count() >= self.options.max_pending_replies + REFUSAL_RESERVE:
            # Even the refusals are not leaving (a stuck broker): drop, count, never grow without bound.
            self.dropped(reply, "the broker is not taking replies fast enough")
            return False
        if self.policy.refusal(reply.topic) is not None and self.refused("", reply):
            return False  # the last gate: nothing is published on a client's word outside its namespace
        props = None
        if self.options.v5:
            users = []
            if form is Form.BINARY_PROPERTY and hlen is not None:
                users.append((codec.HEADER_LENGTH_PROPERTY, str(hlen)))
            if error is not None:
                users.append((codec.ERROR_CODE_PROPERTY, error))
            props = publish_properties(
                correlation=reply.correlation,
                content_type=codec.CONTENT_TYPE_JSON if form is Form.JSON else codec.CONTENT_TYPE_BINARY,
                expiry_s=None if reply.deadline is None else max(1, math.ceil(reply.deadline - time.monotonic())),
                user=users,
            )
        done = publish_now(client, reply.topic, payload, props) if reply.qos == 0 else None
        if done is True:
            return True
        if done is not None:  # partly written, the rest queued in paho
            self.backlog.handed(0, done)
            return True
        info = client.publish(reply.topic, payload, qos=reply.qos, properties=props)
        if info.rc != mqtt.MQTT_ERR_SUCCESS:
            self.dropped(reply, mqtt.error_string(info.rc))
            return False
        self.backlog.handed(reply.qos, info)
        return True

    def refused(self, request_topic: str, reply: Reply) -> bool:
        """A reply topic outside the reply namespace: counted, logged (rate-limited), and said on the
        daemon's own error topic instead (with the request's correlation), never published there."""
        why = self.policy.refusal(reply.topic)
        if why is None:
            return False
        self.counts.count("replies_refused")
        self.counts.warn(
            "reply-refused",
            f"a request on {request_topic!r} asked for its reply on "
            f"{reply.topic[:128]!r}: refused, {why}; {self.counts.counters['replies_refused']} so far",
        )
        client = self.session.client
        if client is None or self.backlog.count() >= self.options.max_pending_replies + REFUSAL_RESERVE:
            return True
        body: dict[str, Any] = {
            "error": f"response topic refused: {why}",
            "code": ErrorCode.PERMISSION_DENIED.value,
            "request_topic": request_topic[:256],
            "response_topic": reply.topic[:256],
        }
        if reply.request_id is not None:
            body["id"] = reply.request_id[:256]
        props = None
        if self.options.v5:
            props = publish_properties(
                correlation=reply.correlation,
                content_type=codec.CONTENT_TYPE_JSON,
                user=[(codec.ERROR_CODE_PROPERTY, ErrorCode.PERMISSION_DENIED.value)],
            )
        try:
            info = client.publish(self.topics.errors, dumps(body), qos=0, properties=props)
        except ValueError:
            return True
        if info.rc == mqtt.MQTT_ERR_SUCCESS:
            self.backlog.handed(0, info)
        return True

    def dropped(self, reply: Reply, why: str) -> None:
        self.counts.count("replies_dropped")
        self.counts.warn(
            "reply-dropped",
            f"a reply to {reply.topic!r} was dropped ({why}); {self.counts.counters['replies_dropped']} so far",
        )

    def drop(self, topic: str, why: str) -> None:
        """A request that gets no reply at all (it says nowhere to send one)."""
        self.counts.count("dropped")
        self.counts.warn("drop-" + why.split(":", maxsplit=1)[0][:24], f"request on {topic!r} dropped: {why}")
