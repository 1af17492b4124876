"""Inference requests over MQTT: admitted within bounds, decoded, deduplicated, submitted, answered once.

Requests arrive on ``{prefix}/{device}/infer/{model}[/{version}]``. The reply goes to the MQTT 5
Response Topic with the request's Correlation Data, or for MQTT 3.1.1 to ``reply_to`` with the
``id`` from the JSON header. paho's network thread only parses the envelope, admits the request
(backlog, payload size, the memory budget) and hands it to the inference service; large JSON bodies
go to a small decode pool first. A request alone with an idle model whose runs are short is computed
on paho's thread and answered from there (``process(inline=True)``), like HTTP's on its event loop.
"""

from __future__ import annotations

import logging
import select
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any

import paho.mqtt.client as mqtt

from edged.core.service import InferenceService
from edged.errors import (
    DeadlineExceededError,
    EdgedError,
    ErrorCode,
    InternalError,
    InvalidInputError,
    ModelNotReadyError,
    OverloadedError,
    ResourceExhaustedError,
)
from edged.membudget import Reservation, owned_bytes
from edged.protocol import media
from edged.protocol import mqtt as codec
from edged.protocol.mqtt import Form
from edged.protocol.types import InferRequest, InferResponse
from edged.protocol.v2 import DecodedRequest, decode_request, loads
from edged.protocol.v2_plans import RequestPlans
from edged.transports.mqtt.backlog import Backlog
from edged.transports.mqtt.counts import Counts
from edged.transports.mqtt.dedup import RecentKeys
from edged.transports.mqtt.incoming import message_deadline, user_property
from edged.transports.mqtt.replies import Reply, ReplyPublisher
from edged.transports.mqtt.session import MqttSession
from edged.transports.mqtt.stall import StallDetector
from edged.transports.v2_ops import LOOP_INLINE_MAX_NS, encode_is_heavy

log = logging.getLogger("edged.transports.mqtt.transport")

INLINE_HEADER_BYTES = 64 * 1024  # larger JSON is decoded off paho's thread
MAX_PENDING_DECODES = 32
PENDING_DECODE_PAYLOADS = 4  # bytes waiting for the decode pool stay under 4 x max_payload_mb
PAYLOAD_COPIES = 2  # a request's payload, and what is decoded from it (JSON data becomes new arrays)
# Refusals a retry of the same request (same correlation) may get past: it is not remembered as seen.
_RETRYABLE = frozenset({ErrorCode.OVERLOADED, ErrorCode.UNAVAILABLE})


@dataclass
class Incoming:
    topic: str
    payload: bytes | bytearray
    qos: int
    response_topic: str | None
    correlation: bytes | None
    header_length: str | None
    deadline: float | None
    request_qos: int = 0
    received: float = 0.0  # monotonic
    parts: tuple[Form, memoryview, memoryview] | None = None  # the payload split, once known
    media: str | None = None  # the payload is a raw image/sound of this type, not a v2 request
    hold: Reservation | None = None  # its request memory, until the service takes it over with the request
    reply: Reply | None = None  # where its answer (or error) goes, once known


class RequestIntake:
    """Takes each request from paho's thread to the service, and its completion to the one reply."""

    def __init__(
        self,
        session: MqttSession,
        service: InferenceService,
        replies: ReplyPublisher,
        *,
        backlog: Backlog,
        counts: Counts,
        stall: StallDetector,
        max_payload_mb: float,
    ) -> None:
        self.session, self.service, self.replies = session, service, replies
        self.topics = session.topics
        self.options = session.options
        self.backlog, self.counts, self.stall = backlog, counts, stall
        self.max_payload_mb = max_payload_mb  # as configured, for the refusal's message
        self._recent = RecentKeys()
        self.plans = RequestPlans()  # binary requests that repeat their header
        self._readable: tuple[Any, select.poll] | None = None  # paho's socket and a poller on it (paho's thread)
        self._pool: ThreadPoolExecutor | None = None

    def start(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="edged-mqtt-decode")

    def drain(self, end: float) -> None:
        """Finish the decodes under way and wait (until the monotonic ``end``) for answers in work."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self.backlog.wait_idle(end)

    def _reply_qos(self, request_qos: int) -> int:
        policy = self.options.reply_qos
        return min(request_qos, 1) if policy == "request" else policy

    def on_request(self, msg: mqtt.MQTTMessage, topic: str) -> None:
        props = msg.properties if self.options.v5 else None
        inc = Incoming(
            topic=topic,
            payload=msg.payload,
            qos=self._reply_qos(msg.qos),
            response_topic=getattr(props, "ResponseTopic", None) if props else None,
            correlation=getattr(props, "CorrelationData", None) if props else None,
            header_length=user_property(props, codec.HEADER_LENGTH_PROPERTY),
            deadline=message_deadline(props),
            request_qos=msg.qos,
            received=time.monotonic(),
        )
        declared = (
            getattr(props, "ContentType", None) or user_property(props, media.CONTENT_TYPE_PROPERTY) if props else None
        )
        inc.media = media.media_type(msg.payload, declared)
        self.counts.count("requests")
        if self.session.stopping:
            self._process(inc, reject=ModelNotReadyError("the daemon is shutting down"))
            return
        if self.backlog.count() >= self.options.max_pending_replies:
            # Refuse while there is still room to say so: the refusal is a small reply, the answer may not be.
            self.counts.count("overloaded")
            self.counts.warn(
                "overloaded",
                f"{self.backlog.count()} requests and replies pending "
                f"(max_pending_replies {self.options.max_pending_replies}): answering 'overloaded'",
            )
            self._process(inc, reject=OverloadedError("too many requests are waiting for their replies; retry later"))
            return
        size = len(inc.payload)
        if size > self.options.max_payload_bytes:
            self.counts.count("oversized")
            self._process(
                inc,
                reject=ResourceExhaustedError(
                    f"payload of {size} bytes exceeds the limit of {self.max_payload_mb:g} MB ([mqtt] max_payload_mb)"
                ),
            )
            return
        try:  # the payload and what is decoded from it (views, or JSON data as arrays), before decoding
            inc.hold = self.service.budget.reserve(PAYLOAD_COPIES * size, "a %d-byte MQTT request", size)
        except EdgedError as e:
            if e.code is ErrorCode.OVERLOADED:
                self.counts.count("overloaded")
            self._process(inc, reject=e)
            return
        if inc.media is not None or self._json_bytes(inc) <= INLINE_HEADER_BYTES:
            self._process(inc, inline=True)
            _release(inc)
            return
        # Parsing a large JSON body takes milliseconds: do it off paho's thread, within a bound.
        admitted = self.backlog.admit_decode(
            size, MAX_PENDING_DECODES, PENDING_DECODE_PAYLOADS * self.options.max_payload_bytes
        )
        if not admitted or self._pool is None:
            _release(inc)
            self._process(inc, reject=OverloadedError("too many large requests are waiting to be decoded"))
            return
        try:
            self._pool.submit(self._decode_job, inc)
        except RuntimeError:  # pool shut down
            self.backlog.decoded(size)
            _release(inc)
            self._process(inc, reject=ModelNotReadyError("the daemon is shutting down"))

    def _decode_job(self, inc: Incoming) -> None:
        try:
            self._process(inc)
        except Exception:
            log.exception("MQTT request decoding failed")
        finally:
            _release(inc)
            self.backlog.decoded(len(inc.payload))

    @staticmethod
    def _json_bytes(inc: Incoming) -> int:
        """How many bytes of JSON the request carries (cheap: no parsing)."""
        try:
            inc.parts = codec.split(inc.payload, codec.header_length_property(inc.header_length))
            return len(inc.parts[1])
        except InvalidInputError:
            return 0  # malformed framing: answered inline with an error

    def _process(self, inc: Incoming, reject: EdgedError | None = None, *, inline: bool = False) -> None:
        """Decode, deduplicate and submit one request; every failure becomes an error reply.

        ``inline``: on paho's thread, a request alone (its model idle, its runs short, nothing else
        waiting to be read) is computed and answered right here, as the event loop does for HTTP:
        no hand-off to a scheduler thread and back to paho's."""
        try:
            started = self._begin(inc, reject, inline)
        except EdgedError as e:
            if reject is None and e.code in _RETRYABLE and inc.reply is not None:
                self._forget(inc.topic, inc.reply)  # refused: its retry (same correlation) deserves an answer
            self.replies.error(inc.reply, e, inc.topic)
            return
        except Exception:
            log.exception("MQTT request on %r failed", inc.topic)
            self.replies.error(inc.reply, InternalError("internal error while handling the request"), inc.topic)
            return
        if started is None:
            return
        decoded, reply, done = started
        if isinstance(done, InferResponse):
            if encode_is_heavy(done, decoded) and self._answer_elsewhere(decoded, reply, done):
                return
            self.replies.answer(decoded, reply, done)
            return
        self.backlog.started()
        done.add_done_callback(partial(self._finish, decoded, reply))

    def _begin(
        self, inc: Incoming, reject: EdgedError | None, inline: bool
    ) -> tuple[DecodedRequest, Reply, InferResponse | Future[InferResponse]] | None:
        """The checks, in order, then the submission; None: the request was dropped, refused, a
        duplicate, or handed on as a media request. Raises what its error reply must say (to
        ``inc.reply``, once known)."""
        if inc.response_topic is not None and not self._property_reply(inc, inc.response_topic,
                                                                       remember=reject is None):
            return None
        if reject is not None:
            self._raise_reject(inc, reject)
            return None
        model, version = self.topics.parse_infer(inc.topic)
        if inc.media is not None:
            if inc.reply is None:
                self.replies.drop(inc.topic, "a raw image/sound request needs an MQTT 5 response topic")
                return None
            self._submit_media(inc, inc.reply, model, version)
            return None
        form, head, tail = inc.parts or codec.split(inc.payload, codec.header_length_property(inc.header_length))
        # A binary header seen before needs no parsing (protocol/v2_plans.py); planned headers
        # carry neither 'reply_to' nor 'id'.
        key = None if form is Form.JSON else self.plans.key(model, version, head, len(tail))
        plan = self.plans.get(key)
        header = None if plan is not None else codec.parse_split(form, head, tail).header
        reply_to, rid = (None, None) if header is None else codec.reply_address(header)
        if inc.reply is not None:
            inc.reply.form = form
        elif not self._header_reply(inc, reply_to, rid, form):
            return None
        reply = inc.reply
        assert reply is not None
        reply.request_id = rid
        if header is None:
            assert plan is not None
            decoded = plan.decode(tail)
        else:
            decoded = self._decode_header(header, form, tail, key, model, version)
        if form is Form.JSON and inc.hold is not None:
            # JSON data became new arrays (up to 4x the text: "0," is an 8-byte INT64), beyond the one
            # payload's worth reserved for them (binary data stays a view of the payload).
            extra = owned_bytes(decoded.request.inputs.values()) - (PAYLOAD_COPIES - 1) * len(inc.payload)
            inc.hold.grow(extra, "the request's decoded JSON tensors")
        self._set_deadline(inc, decoded)
        decoded.request.memory, inc.hold = inc.hold, None  # the service releases it when the request ends
        reply.received = inc.received
        stall = self.stall.request(reply.topic, inc.request_qos)
        if stall is not None:
            log.warning("%s", stall)
        done = (
            self.service.infer_or_submit(decoded.request, LOOP_INLINE_MAX_NS)
            if inline and not self._more_to_read()
            else self.service.submit(decoded.request)
        )
        return decoded, reply, done

    def _property_reply(self, inc: Incoming, topic: str, *, remember: bool) -> bool:
        """The reply address from MQTT 5 properties, in ``inc.reply``; False: dropped (not a topic
        name), refused, or (when ``remember``) a duplicate."""
        if not codec.valid_publish_topic(topic):
            self.replies.drop(inc.topic, "its response topic is not a valid topic name")
            return False
        form = (
            Form.BINARY_PROPERTY
            if inc.header_length is not None
            else (Form.BINARY_PREFIX if inc.payload[:1] == b"\0" else Form.JSON)
        )
        if inc.media is not None:
            form = Form.JSON
        reply = inc.reply = Reply(topic, inc.correlation, None, form, inc.qos, inc.deadline, media=inc.media)
        if self.replies.refused(inc.topic, reply):
            return False
        # A refused request is not remembered: its retry (same correlation) deserves an answer. A repeat of
        # one in work (or answered) is still a repeat: answering it 'overloaded' would be a second reply.
        return not (self._duplicate(inc.topic, reply) if remember else self._repeat(inc.topic, reply))

    def _raise_reject(self, inc: Incoming, reject: EdgedError) -> None:
        """Raise ``reject`` for its error reply, found in a small header when properties gave none;
        returns when there is nowhere to send it (dropped) or the address is refused."""
        reply = inc.reply
        if reply is None:
            reply = inc.reply = self._reply_from_small_header(inc)
            if reply is None:
                self.replies.drop(inc.topic, f"{reject.code.value}: {reject}")
                return
            if self.replies.refused(inc.topic, reply) or self._repeat(inc.topic, reply):
                return
        if reject.code is ErrorCode.OVERLOADED:
            # Refusals must leave faster than requests arrive: QoS 0 does not wait in paho's
            # in-flight window behind the QoS 1 replies that caused the overload.
            reply.qos = 0
        raise reject

    def _header_reply(self, inc: Incoming, reply_to: str | None, rid: str | None, form: Form) -> bool:
        """The reply address from the JSON header's 'reply_to', in ``inc.reply``; False: there is none,
        it is refused, or the request is a duplicate."""
        if reply_to is None:
            self.replies.drop(inc.topic, "it has no response topic (MQTT 5) or 'reply_to' (JSON header)")
            return False
        reply = inc.reply = Reply(reply_to, None, rid, form, inc.qos, inc.deadline)
        if self.replies.refused(inc.topic, reply):
            return False
        return not self._duplicate(inc.topic, reply)

    def _decode_header(self, header: dict[str, Any], form: Form, tail: memoryview, key: Any, model: str,
                       version: int | None) -> DecodedRequest:
        """A parsed header's request; a binary one's plan is learnt for the next like it."""
        if form is not Form.JSON:
            params = header.setdefault("parameters", {})
            if isinstance(params, dict):
                params.setdefault("binary_data_output", True)
        decoded = decode_request(header, tail, model=model, version=version)
        if key is not None:
            self.plans.learn(key, header, decoded)
        return decoded

    @staticmethod
    def _set_deadline(inc: Incoming, decoded: DecodedRequest) -> None:
        """The request's deadline: the message's expiry or its own timeout, whichever comes first."""
        timeout_us = decoded.request.parameters.get("timeout_us")
        deadline = inc.deadline
        if timeout_us:
            limit = time.monotonic() + timeout_us / 1e6
            deadline = limit if deadline is None else min(deadline, limit)
        if deadline is not None and time.monotonic() > deadline:
            raise DeadlineExceededError("the request expired before it could be computed")
        decoded.request.deadline = deadline

    def _more_to_read(self) -> bool:
        """Whether more bytes wait on the broker's connection (other requests, most likely): then this
        request is queued, so requests that arrive together are batched, not run one by one here."""
        client = self.session.client
        sock = client.socket() if client is not None else None
        if sock is None:
            return True
        try:
            pending = getattr(sock, "pending", None)  # TLS (and websockets): bytes already decrypted
            if pending is not None and pending():
                return True
            watched = self._readable
            if watched is None or watched[0] is not sock:
                poller = select.poll()
                poller.register(sock, select.POLLIN)
                self._readable = watched = (sock, poller)
            return bool(watched[1].poll(0))
        except Exception:  # an unusual socket wrapper: queue the request rather than fail it
            return True

    def _submit_media(self, inc: Incoming, reply: Reply, model: str, version: int | None) -> None:
        """A raw image/sound payload: the one BYTES input of the model or pipeline, answered as plain JSON."""
        try:
            mv = self.service.model(model, version)
            name = media.media_input(model, [(s.name, s.datatype) for s in mv.inputs])
            if inc.deadline is not None and time.monotonic() > inc.deadline:
                raise DeadlineExceededError("the request expired before it could be computed")
            request = InferRequest(
                model=model,
                version=version,
                inputs={name: media.media_tensor(inc.payload)},
                deadline=inc.deadline,
                memory=inc.hold,
            )
            inc.hold = None
            reply.received = inc.received
            future = self.service.submit(request)
        except EdgedError as e:
            if e.code in _RETRYABLE:
                self._forget(inc.topic, reply)
            self.replies.error(reply, e, inc.topic)
            return
        self.backlog.started()
        future.add_done_callback(partial(self._finish, DecodedRequest(request), reply))

    def _reply_from_small_header(self, inc: Incoming) -> Reply | None:
        """For a rejected 3.1.1 request: the reply address, if reading it is cheap (a small header)."""
        try:
            form, head, _ = codec.split(inc.payload, codec.header_length_property(inc.header_length))
            if len(head) > INLINE_HEADER_BYTES:
                return None
            header = loads(head)
            if not isinstance(header, dict):
                return None
            reply_to, rid = codec.reply_address(header)
        except EdgedError:
            return None
        return None if reply_to is None else Reply(reply_to, None, rid, form, inc.qos, inc.deadline)

    def _finish(self, decoded: DecodedRequest, reply: Reply, future: Future[InferResponse]) -> None:
        """Completion callback (a scheduler thread): encode and publish the one reply."""
        try:
            try:
                resp = future.result()
            except EdgedError as e:
                self.replies.error(reply, e, "")
                return
            except Exception:
                log.exception("MQTT request failed")
                self.replies.error(reply, InternalError("internal error while computing the response"), "")
                return
            self.replies.answer(decoded, reply, resp)
        finally:
            self.backlog.finished()

    @staticmethod
    def _key(topic: str, reply: Reply) -> tuple[str, str, bytes | str] | None:
        """What identifies a request to the duplicate filter; None: it cannot be told apart (no
        correlation data or id), so it is never taken for a repeat."""
        corr = reply.correlation if reply.correlation is not None else reply.request_id
        return None if corr is None else (topic, reply.topic, corr)

    def _duplicate(self, topic: str, reply: Reply) -> bool:
        """Whether the request was seen before; records it if not."""
        key = self._key(topic, reply)
        if key is None or not self._recent.seen(key):
            return False
        self.counts.count("duplicates")
        return True

    def _repeat(self, topic: str, reply: Reply) -> bool:
        """Whether the request was seen before, without recording it (a request refused at admission)."""
        key = self._key(topic, reply)
        if key is None or not self._recent.known(key):
            return False
        self.counts.count("duplicates")
        return True

    def _forget(self, topic: str, reply: Reply) -> None:
        key = self._key(topic, reply)
        if key is not None:
            self._recent.forget(key)

    def _answer_elsewhere(self, decoded: DecodedRequest, reply: Reply, resp: InferResponse) -> bool:
        """A big answer computed on paho's thread is encoded and published from the decode pool, so paho
        reads on meanwhile (a 4 MB JSON answer took 26-39 ms); False: the pool is gone, answer here."""
        pool = self._pool
        if pool is None:
            return False
        self.backlog.started()
        try:
            pool.submit(self._answer_job, decoded, reply, resp)
        except RuntimeError:  # shut down
            self.backlog.finished()
            return False
        return True

    def _answer_job(self, decoded: DecodedRequest, reply: Reply, resp: InferResponse) -> None:
        try:
            self.replies.answer(decoded, reply, resp)
        finally:
            self.backlog.finished()


def _release(inc: Incoming) -> None:
    """A request's memory the service did not take over (refused, dropped or answered at once)."""
    hold, inc.hold = inc.hold, None
    if hold is not None:
        hold.release()
