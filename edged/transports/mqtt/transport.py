"""MQTT transport: v2 inference requests over a broker, stream bindings, retained availability.

Requests arrive on ``{prefix}/{device}/infer/{model}[/{version}]``. The reply
goes to the MQTT 5 Response Topic with the request's Correlation Data, or for
MQTT 3.1.1 to ``reply_to`` with the ``id`` from the JSON header. paho's network
thread only parses the envelope and hands the request to the inference service
(large JSON bodies go to a small decode pool first); replies are published from
the service's completion callbacks, which paho allows from any thread. A request
alone with an idle model whose runs are short is computed on paho's thread and
answered from there (``_process``), like HTTP's on its event loop.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import select
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, cast

import paho.mqtt.client as mqtt
from paho.mqtt.properties import Properties
from paho.mqtt.reasoncodes import ReasonCode

from edged.backoff import Backoff
from edged.config import Config, StreamBinding
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
from edged.membudget import Reservation
from edged.protocol import media
from edged.protocol import mqtt as codec
from edged.protocol.fleet.telemetry import MqttWindow, StreamWindow
from edged.protocol.mqtt import Form, Topics
from edged.protocol.mqtt_properties import publish_properties
from edged.protocol.mqtt_tcp import quick_ack
from edged.protocol.mqtt_topics import ReplyPolicy
from edged.protocol.types import InferRequest, InferResponse
from edged.protocol.v2 import DecodedRequest, decode_request, dumps, encode_response, loads
from edged.protocol.v2_plans import RequestPlans, encode_answer
from edged.transports.mqtt.bindings import (
    BindingStats,
    BindingWorker,
    Item,
    raw_tensor,
    validate_bindings,
)
from edged.transports.mqtt.connection import LinkState, MqttOptions, connect_properties, make_client
from edged.transports.mqtt.dedup import RecentKeys
from edged.transports.mqtt.stall import StallDetector
from edged.transports.mqtt.status import device_offline, device_online, model_statuses
from edged.transports.redact import Scrubber
from edged.transports.v2_ops import LOOP_INLINE_MAX_NS

if TYPE_CHECKING:
    from edged.telemetry.prometheus import MetricsRenderer

log = logging.getLogger("edged.transports.mqtt.transport")

INLINE_HEADER_BYTES = 64 * 1024  # larger JSON is decoded off paho's thread
MAX_PENDING_DECODES = 32
PENDING_DECODE_PAYLOADS = 4  # bytes waiting for the decode pool stay under 4 x max_payload_mb
STOP_GRACE_S = 2.0
# Room for 'overloaded' refusals (small, QoS 0) beyond max_pending_replies: paho reads a burst of requests
# before it writes their refusals. Only a broker that stops reading fills it; then replies are dropped.
REFUSAL_RESERVE = 1024
PAYLOAD_COPIES = 2  # a request's payload, and what is decoded from it (JSON data becomes new arrays)
STATUS_POLL_S = 2.0
# An MQTT 5 user property a camera sets on a frame (its capture time, any text up to 64 characters):
# the binding's output carries it as "frame_timestamp".
FRAME_TIMESTAMP_PROPERTY = "Frame-Timestamp"


@dataclass
class _Reply:
    """Where and how one request's single response goes."""

    topic: str
    correlation: bytes | None
    request_id: str | None
    form: Form
    qos: int
    deadline: float | None
    received: float = 0.0  # monotonic: when the request arrived
    media: str | None = None  # a raw image/sound request: answered with plain JSON (edged.protocol.media)


@dataclass
class _Incoming:
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


class MqttTransport:
    name = "mqtt"

    def __init__(self, cfg: Config, service: InferenceService, profile_name: str, *,
                 options: MqttOptions | None = None, metrics: MetricsRenderer | None = None) -> None:
        """``options`` overrides what is read from ``cfg`` (tools and tests); errors are ConfigError.
        ``metrics``, the daemon's ``/metrics`` renderer, shows this transport's counts while it runs."""
        self.cfg = cfg
        self.metrics = metrics
        self.service = service
        self.profile_name = profile_name
        self.options = options or MqttOptions.from_config(cfg)
        self.options.check_files()
        self.bindings: list[StreamBinding] = validate_bindings(cfg.mqtt.bindings)
        self.device = cfg.device.id
        self.prefix = cfg.mqtt.topic_prefix
        self.topics = Topics(self.prefix, self.device)
        # Where a client may have its reply published (never another device's or the daemon's own topics).
        self.replies = ReplyPolicy(self.prefix, self.device, cfg.mqtt.reply_topics,
                                   also_reserved=[b.topic for b in self.bindings])
        self.link = LinkState(self.options.url)
        self.scrub = Scrubber.for_config(cfg)  # model reasons and errors name files under these
        self.ready = threading.Event()  # connected and subscribed to every request filter
        self._settled = threading.Event()  # the broker answered the subscriptions (granted or refused)
        self.counters: collections.Counter[str] = collections.Counter()
        self._counter_lock = threading.Lock()
        self._recent = RecentKeys()
        self._plans = RequestPlans()  # binary requests that repeat their header
        self._readable: tuple[Any, select.poll] | None = None  # paho's socket and a poller on it (paho's thread)
        self._backoff = Backoff(self.options.reconnect_min_s, self.options.reconnect_max_s)
        self._client: mqtt.Client | None = None
        self._inflight = 0
        self._inflight_cv = threading.Condition()
        self._pool: ThreadPoolExecutor | None = None
        self._pending_decodes = 0
        self._pending_bytes = 0
        # Replies handed to paho that the broker has not taken yet (QoS 0: not yet written; QoS 1: no PUBACK),
        # one queue per QoS: each completes in order, but QoS 0 refusals overtake QoS 1 answers.
        self._unsent: tuple[collections.deque[mqtt.MQTTMessageInfo], ...] = (collections.deque(),
                                                                             collections.deque())
        self._unsent_lock = threading.Lock()
        self._workers = [
            BindingWorker(i, b, render=self._render_output, process=self._process_binding,
                          error_payload=self._binding_error, publish=self._publish_plain)
            for i, b in enumerate(self.bindings)
        ]
        self._stopping = False
        self._sub_mid: int | None = None
        self._sub_topics: list[str] = []
        self._status_lock = threading.Lock()
        self._published_models: dict[str, bytes] = {}
        self._watch_stop = threading.Event()
        self._watch: threading.Thread | None = None
        self._warned: dict[str, float] = {}
        self._stall = StallDetector()

    # ---- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        """Start connecting in the background; a missing broker never stops the daemon."""
        opts = self.options
        client = make_client(opts, will_topic=self.topics.status,
                             will_payload=device_offline(self.device, "connection lost"))
        client.on_connect = self._on_connect
        client.on_connect_fail = self._on_connect_fail
        client.on_disconnect = self._on_disconnect
        client.on_subscribe = self._on_subscribe
        client.on_message = self._on_message
        client.on_publish = self._on_publish
        self._client = client
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="edged-mqtt-decode")
        for w in self._workers:
            w.start()
        kwargs: dict[str, Any] = {}
        if opts.v5:
            kwargs = {"clean_start": opts.clean_start, "properties": connect_properties(opts)}
        log.info("MQTT transport: connecting to %s as %r (MQTT %s); requests on %sinfer/<model>[/<version>], "
                 "%d stream binding(s)", opts.url, opts.client_id, "5" if opts.v5 else "3.1.1",
                 self.topics.base + "/", len(self.bindings))
        client.connect_async(opts.host, opts.port, keepalive=opts.keepalive_s, **kwargs)
        client.loop_start()
        if self.metrics is not None:
            self.metrics.collector.mqtt = self.stats
        self._watch = threading.Thread(target=self._watch_models, name="edged-mqtt-status", daemon=True)
        self._watch.start()

    async def stop(self) -> None:
        await asyncio.to_thread(self._stop_blocking)

    def _stop_blocking(self) -> None:
        """Stop taking work, let in-flight replies go out, say offline (retained), disconnect."""
        self._stopping = True
        client = self._client
        if client is None:
            return
        # A persistent session keeps its subscriptions so the broker queues requests for the next start.
        if self.link.up and self.options.clean_start:
            try:
                client.unsubscribe(self.topics.infer_filters + [b.topic for b in self.bindings])
            except Exception:
                log.debug("unsubscribe failed", exc_info=True)
        for w in self._workers:
            w.buffer.close()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        end = time.monotonic() + STOP_GRACE_S
        with self._inflight_cv:
            while self._inflight and time.monotonic() < end:
                self._inflight_cv.wait(end - time.monotonic())
        for w in self._workers:
            w.stop(max(0.1, end - time.monotonic()))
        self._watch_stop.set()
        if self.link.up:
            try:
                info = client.publish(self.topics.status, device_offline(self.device, "stopped"), qos=1, retain=True)
                info.wait_for_publish(1.0)
            except Exception:
                log.debug("could not publish offline status", exc_info=True)
        client.disconnect()
        client.loop_stop()
        if self._watch is not None:
            self._watch.join(1.0)
        if self.metrics is not None and self.metrics.collector.mqtt == self.stats:
            self.metrics.collector.mqtt = None
        log.info("MQTT transport stopped (%s)", self._summary())

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until connected and subscribed (tests, tools); False on timeout.

        Raises FAILED_PRECONDITION when the broker refused a request subscription: waiting longer
        would not help, the broker's ACL (or the topic prefix) has to change.
        """
        if not self._settled.wait(timeout):
            return False
        if self.ready.is_set():
            return True
        error = self.link.subscription_error
        if error is not None:
            raise EdgedError(error, code=ErrorCode.FAILED_PRECONDITION)
        return False

    @property
    def inflight(self) -> int:
        return self._inflight

    def stats(self) -> MqttWindow:
        """Counts since start, for /metrics, telemetry and ``edged status``."""
        with self._counter_lock:
            c = dict(self.counters)
        errors = sum(v for k, v in c.items() if k.startswith("error_"))
        return MqttWindow(requests=c.get("requests", 0), replies=c.get("replies", 0), error_replies=errors,
                          overloaded=c.get("overloaded", 0), replies_dropped=c.get("replies_dropped", 0),
                          requests_dropped=c.get("dropped", 0), replies_refused=c.get("replies_refused", 0),
                          backlog=self.backlog(),
                          broker_stall=self._stall.message, streams=[self._stream(w) for w in self._workers])

    @staticmethod
    def _stream(w: BindingWorker) -> StreamWindow:
        fps, p50, p99 = w.rate()
        st = w.stats
        return StreamWindow(topic=w.binding.topic[:256], model=w.binding.model, received=st.received,
                            processed=st.processed, dropped=st.dropped, errors=st.errors, fps=round(fps, 3),
                            latency_ms_p50=round(p50, 3), latency_ms_p99=round(p99, 3))

    def binding_stats(self) -> list[BindingStats]:
        return [w.stats for w in self._workers]

    def _summary(self) -> str:
        return ", ".join(f"{k} {v}" for k, v in sorted(self.counters.items())) or "no traffic"

    # ---- connection callbacks (paho's thread: never block) ---------------------------------
    def _on_connect(self, client: mqtt.Client, userdata: Any, flags: Any, reason: ReasonCode,
                    properties: Properties | None) -> None:
        try:
            if reason.is_failure:
                self.link.set_down(f"broker refused the connection: {reason}")
                self._set_retry_delay(client)
                return
            self._backoff.reset()
            self.link.set_up()
            with self._unsent_lock:
                for q in self._unsent:
                    q.clear()  # paho resends its QoS 1 ones; QoS 0 ones were lost with the connection
            subs = [(f, self.options.qos) for f in self.topics.infer_filters]
            subs += [(b.topic, b.qos) for b in self.bindings]
            self._sub_topics = [f for f, _ in subs]
            _, self._sub_mid = client.subscribe(subs)
            self.publish_status(force=True)
        except Exception:
            log.exception("MQTT on_connect handler failed")

    def _on_subscribe(self, client: mqtt.Client, userdata: Any, mid: int, reasons: list[ReasonCode],
                      properties: Properties | None) -> None:
        try:
            if mid != self._sub_mid:
                return
            n_infer = len(self.topics.infer_filters)  # subscribed first, then the bindings' topics
            infer_refused = []
            for i, (topic, r) in enumerate(zip(self._sub_topics, reasons, strict=False)):
                if not r.is_failure:
                    continue
                if i < n_infer:
                    infer_refused.append(f"{topic!r} ({r})")
                else:
                    self._warn(f"binding-sub-{topic}", f"the broker refused the stream binding's subscription "
                               f"{topic!r} ({r})")
            if infer_refused:
                self.ready.clear()
                self.link.set_subscriptions("the broker refused the request subscription(s) "
                                            + ", ".join(infer_refused))
                self.publish_status(force=True)  # the retained device status carries the error
            else:
                self.link.set_subscriptions(None)
                self.ready.set()
            self._settled.set()
        except Exception:
            log.exception("MQTT on_subscribe handler failed")

    def _on_connect_fail(self, client: mqtt.Client, userdata: Any) -> None:
        try:
            self.ready.clear()
            self._settled.clear()
            self.link.set_down("cannot reach the broker")
            self._set_retry_delay(client)
        except Exception:
            log.exception("MQTT on_connect_fail handler failed")

    def _on_disconnect(self, client: mqtt.Client, userdata: Any, flags: Any, reason: ReasonCode,
                       properties: Properties | None) -> None:
        try:
            self.ready.clear()
            self._settled.clear()
            if self._stopping:
                self.link.set_down("stopped", retrying=False)
                return
            from_broker = bool(getattr(flags, "is_disconnect_packet_from_server", False))
            self.link.set_down(f"the broker closed the session: {reason}" if from_broker else "connection lost")
            self._set_retry_delay(client)
        except Exception:
            log.exception("MQTT on_disconnect handler failed")

    def _set_retry_delay(self, client: mqtt.Client) -> None:
        # paho waits min_delay before its next attempt once the delay is reset; we choose each wait.
        delay = self._backoff.next_delay()
        client.reconnect_delay_set(cast(int, delay), cast(int, delay))

    # ---- messages -------------------------------------------------------------------------
    def _on_publish(self, client: mqtt.Client, userdata: Any, mid: int, reason: ReasonCode,
                    properties: Properties | None) -> None:
        quick_ack(client)  # the broker's PUBACK: do not let its next write wait for our delayed ACK

    def _on_message(self, client: mqtt.Client, userdata: Any, msg: mqtt.MQTTMessage) -> None:
        quick_ack(client)
        try:
            topic = msg.topic
            if topic.startswith(self.topics.infer_root):
                self._on_request(msg, topic)
                return
            for w in self._workers:
                if w.matches(topic):
                    self._offer(w, msg, topic)
        except Exception:
            log.exception("MQTT message handler failed; the connection keeps serving")

    def _offer(self, w: BindingWorker, msg: mqtt.MQTTMessage, topic: str) -> None:
        if self._stopping:
            return
        if len(msg.payload) > self.options.max_payload_bytes:
            self._count("binding_oversized")
            self._warn(f"binding-size-{w.index}", f"binding {w.index}: dropped a {len(msg.payload)}-byte "
                       f"message on {topic!r} (limit {self.cfg.mqtt.max_payload_mb} MB)")
            return
        props = msg.properties if self.options.v5 else None
        hlen = _user_property(props, codec.HEADER_LENGTH_PROPERTY)
        try:
            header_length = codec.header_length_property(hlen)
        except InvalidInputError:
            header_length = None
        w.offer(Item(topic, msg.payload, header_length, time.time(), _deadline(props),
                     frame_timestamp=(_user_property(props, FRAME_TIMESTAMP_PROPERTY) or "")[:64] or None,
                     content_type=getattr(props, "ContentType", None) if props else None,
                     arrived=time.monotonic()))

    def _reply_qos(self, request_qos: int) -> int:
        policy = self.options.reply_qos
        return min(request_qos, 1) if policy == "request" else policy

    def _on_request(self, msg: mqtt.MQTTMessage, topic: str) -> None:
        props = msg.properties if self.options.v5 else None
        inc = _Incoming(topic=topic, payload=msg.payload, qos=self._reply_qos(msg.qos),
                        response_topic=getattr(props, "ResponseTopic", None) if props else None,
                        correlation=getattr(props, "CorrelationData", None) if props else None,
                        header_length=_user_property(props, codec.HEADER_LENGTH_PROPERTY),
                        deadline=_deadline(props), request_qos=msg.qos, received=time.monotonic())
        declared = (getattr(props, "ContentType", None) or _user_property(props, media.CONTENT_TYPE_PROPERTY)
                    if props else None)
        inc.media = media.media_type(msg.payload, declared)
        self._count("requests")
        if self._stopping:
            self._process(inc, reject=ModelNotReadyError("the daemon is shutting down"))
            return
        if self.backlog() >= self.options.max_pending_replies:
            # Refuse while there is still room to say so: the refusal is a small reply, the answer may not be.
            self._count("overloaded")
            self._warn("overloaded", f"{self.backlog()} requests and replies pending (max_pending_replies "
                       f"{self.options.max_pending_replies}): answering 'overloaded'")
            self._process(inc, reject=OverloadedError(
                "too many requests are waiting for their replies; retry later"))
            return
        size = len(inc.payload)
        if size > self.options.max_payload_bytes:
            self._count("oversized")
            self._process(inc, reject=ResourceExhaustedError(
                f"payload of {size} bytes exceeds the limit of {self.cfg.mqtt.max_payload_mb:g} MB "
                "([mqtt] max_payload_mb)"))
            return
        try:  # the payload and what is decoded from it (views, or JSON data as arrays), before decoding
            inc.hold = self.service.budget.reserve(PAYLOAD_COPIES * size, f"a {size}-byte MQTT request")
        except EdgedError as e:
            if e.code is ErrorCode.OVERLOADED:
                self._count("overloaded")
            self._process(inc, reject=e)
            return
        if inc.media is not None or self._json_bytes(inc) <= INLINE_HEADER_BYTES:
            self._process(inc, inline=True)
            _release(inc)
            return
        # Parsing a large JSON body takes milliseconds: do it off paho's thread, within a bound.
        with self._counter_lock:
            admitted = (self._pending_decodes < MAX_PENDING_DECODES and self._pending_bytes + size
                        <= PENDING_DECODE_PAYLOADS * self.options.max_payload_bytes)
            if admitted:
                self._pending_decodes += 1
                self._pending_bytes += size
        if not admitted or self._pool is None:
            _release(inc)
            self._process(inc, reject=OverloadedError("too many large requests are waiting to be decoded"))
            return
        try:
            self._pool.submit(self._decode_job, inc)
        except RuntimeError:  # pool shut down
            self._decoded(size)
            _release(inc)
            self._process(inc, reject=ModelNotReadyError("the daemon is shutting down"))

    def _decode_job(self, inc: _Incoming) -> None:
        try:
            self._process(inc)
        except Exception:
            log.exception("MQTT request decoding failed")
        finally:
            _release(inc)
            self._decoded(len(inc.payload))

    def _decoded(self, size: int) -> None:
        with self._counter_lock:
            self._pending_decodes -= 1
            self._pending_bytes -= size

    @staticmethod
    def _json_bytes(inc: _Incoming) -> int:
        """How many bytes of JSON the request carries (cheap: no parsing)."""
        try:
            inc.parts = codec.split(inc.payload, codec.header_length_property(inc.header_length))
            return len(inc.parts[1])
        except InvalidInputError:
            return 0  # malformed framing: answered inline with an error

    def _process(self, inc: _Incoming, reject: EdgedError | None = None, *, inline: bool = False) -> None:
        """Decode, deduplicate and submit one request; every failure becomes an error reply.

        ``inline``: on paho's thread, a request alone (its model idle, its runs short, nothing else
        waiting to be read) is computed and answered right here, as the event loop does for HTTP:
        no hand-off to a scheduler thread and back to paho's."""
        reply: _Reply | None = None
        try:
            if inc.response_topic is not None:
                if not codec.valid_publish_topic(inc.response_topic):
                    self._drop(inc.topic, "its response topic is not a valid topic name")
                    return
                form = Form.BINARY_PROPERTY if inc.header_length is not None else (
                    Form.BINARY_PREFIX if inc.payload[:1] == b"\0" else Form.JSON)
                if inc.media is not None:
                    form = Form.JSON
                reply = _Reply(inc.response_topic, inc.correlation, None, form, inc.qos, inc.deadline,
                               media=inc.media)
                if self._refused_reply(inc.topic, reply):
                    return
                # A refused request is not remembered: its retry (same correlation) deserves an answer.
                if reject is None and self._duplicate(inc.topic, reply):
                    return
            if reject is not None:
                if reply is None:
                    reply = self._reply_from_small_header(inc)
                    if reply is None:
                        self._drop(inc.topic, f"{reject.code.value}: {reject}")
                        return
                    if self._refused_reply(inc.topic, reply):
                        return
                if reject.code is ErrorCode.OVERLOADED:
                    # Refusals must leave faster than requests arrive: QoS 0 does not wait in paho's
                    # in-flight window behind the QoS 1 replies that caused the overload.
                    reply.qos = 0
                raise reject
            model, version = self.topics.parse_infer(inc.topic)
            if inc.media is not None:
                if reply is None:
                    self._drop(inc.topic, "a raw image/sound request needs an MQTT 5 response topic")
                    return
                self._submit_media(inc, reply, model, version)
                return
            form, head, tail = inc.parts or codec.split(inc.payload, codec.header_length_property(inc.header_length))
            # A binary header seen before needs no parsing (protocol/v2_plans.py); planned headers
            # carry neither 'reply_to' nor 'id'.
            key = None if form is Form.JSON else self._plans.key(model, version, head, len(tail))
            plan = self._plans.get(key)
            header = None if plan is not None else codec.parse_split(form, head, tail).header
            reply_to, rid = (None, None) if header is None else codec.reply_address(header)
            if reply is not None:
                reply.form = form
            if reply is None:
                if reply_to is None:
                    self._drop(inc.topic, "it has no response topic (MQTT 5) or 'reply_to' (JSON header)")
                    return
                reply = _Reply(reply_to, None, rid, form, inc.qos, inc.deadline)
                if self._refused_reply(inc.topic, reply):
                    return
                if self._duplicate(inc.topic, reply):
                    return
            reply.request_id = rid
            if header is None:
                assert plan is not None
                decoded = plan.decode(tail)
            else:
                if form is not Form.JSON:
                    params = header.setdefault("parameters", {})
                    if isinstance(params, dict):
                        params.setdefault("binary_data_output", True)
                decoded = decode_request(header, tail, model=model, version=version)
                if key is not None:
                    self._plans.learn(key, header, decoded)
            timeout_us = decoded.request.parameters.get("timeout_us")
            deadline = inc.deadline
            if timeout_us:
                limit = time.monotonic() + timeout_us / 1e6
                deadline = limit if deadline is None else min(deadline, limit)
            if deadline is not None and time.monotonic() > deadline:
                raise DeadlineExceededError("the request expired before it could be computed")
            decoded.request.deadline = deadline
            decoded.request.memory, inc.hold = inc.hold, None  # the service releases it when the request ends
            reply.received = inc.received
            stall = self._stall.request(reply.topic, inc.request_qos)
            if stall is not None:
                log.warning("%s", stall)
            done = (self.service.infer_or_submit(decoded.request, LOOP_INLINE_MAX_NS)
                    if inline and not self._more_to_read() else self.service.submit(decoded.request))
        except EdgedError as e:
            self._reply_error(reply, e, inc.topic)
            return
        except Exception:
            log.exception("MQTT request on %r failed", inc.topic)
            self._reply_error(reply, InternalError("internal error while handling the request"), inc.topic)
            return
        if isinstance(done, InferResponse):
            self._answer(decoded, reply, done)
            return
        with self._inflight_cv:
            self._inflight += 1
        done.add_done_callback(partial(self._finish, decoded, reply))

    def _more_to_read(self) -> bool:
        """Whether more bytes wait on the broker's connection (other requests, most likely): then this
        request is queued, so requests that arrive together are batched, not run one by one here."""
        client = self._client
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

    def _submit_media(self, inc: _Incoming, reply: _Reply, model: str, version: int | None) -> None:
        """A raw image/sound payload: the one BYTES input of the model or pipeline, answered as plain JSON."""
        try:
            mv = self.service.model(model, version)
            name = media.media_input(model, [(s.name, s.datatype) for s in mv.inputs])
            if inc.deadline is not None and time.monotonic() > inc.deadline:
                raise DeadlineExceededError("the request expired before it could be computed")
            request = InferRequest(model=model, version=version, inputs={name: media.media_tensor(inc.payload)},
                                   deadline=inc.deadline, memory=inc.hold)
            inc.hold = None
            reply.received = inc.received
            future = self.service.submit(request)
        except EdgedError as e:
            self._reply_error(reply, e, inc.topic)
            return
        with self._inflight_cv:
            self._inflight += 1
        future.add_done_callback(partial(self._finish, DecodedRequest(request), reply))

    def _reply_from_small_header(self, inc: _Incoming) -> _Reply | None:
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
        return None if reply_to is None else _Reply(reply_to, None, rid, form, inc.qos, inc.deadline)

    def _finish(self, decoded: DecodedRequest, reply: _Reply, future: Future[InferResponse]) -> None:
        """Completion callback (a scheduler thread): encode and publish the one reply."""
        try:
            try:
                resp = future.result()
            except EdgedError as e:
                self._reply_error(reply, e, "")
                return
            except Exception:
                log.exception("MQTT request failed")
                self._reply_error(reply, InternalError("internal error while computing the response"), "")
                return
            self._answer(decoded, reply, resp)
        finally:
            with self._inflight_cv:
                self._inflight -= 1
                self._inflight_cv.notify_all()

    def _answer(self, decoded: DecodedRequest, reply: _Reply, resp: InferResponse) -> None:
        """Encode and publish the one reply: from the thread that computed it (paho's, for a request run
        inline, so paho writes it with no wake-up) or from a completion callback."""
        try:
            if reply.media is not None:
                header = media.answer(resp.model, resp.version, resp.outputs, media=reply.media)
                form, payload, hlen = codec.frame(reply.form, header, [], properties=self.options.v5)
            else:
                head, chunks = encode_answer(resp, decoded, partial(encode_response, resp, decoded))
                form, payload, hlen = codec.frame_encoded(reply.form, head, chunks, properties=self.options.v5)
            if self._send(reply, payload, form, hlen):
                self._stall.replied(reply.topic, time.monotonic() - reply.received)
            self._count("replies")
        except EdgedError as e:
            self._reply_error(reply, e, "")
        except Exception:
            log.exception("MQTT reply failed")
            self._reply_error(reply, InternalError("internal error while encoding the response"), "")

    def _duplicate(self, topic: str, reply: _Reply) -> bool:
        corr = reply.correlation if reply.correlation is not None else reply.request_id
        if corr is None:
            return False
        if self._recent.seen((topic, reply.topic, corr)):
            self._count("duplicates")
            return True
        return False

    def _reply_error(self, reply: _Reply | None, err: EdgedError, topic: str) -> None:
        self._count(f"error_{err.code.value}")
        if reply is None:
            self._drop(topic, f"{err.code.value}: {err}")
            return
        try:
            header = codec.error_header(err, reply.request_id)
            header["error"] = self.scrub.text(header["error"])
            form, payload, hlen = codec.frame(reply.form, header, [], properties=self.options.v5)
            self._send(reply, payload, form, hlen, error=err.code.value)
        except Exception:
            log.exception("MQTT error reply failed")

    def backlog(self) -> int:
        """Requests being decoded or computed plus replies the broker has not taken yet."""
        waiting = 0
        with self._unsent_lock:
            for unsent in self._unsent:
                while unsent and unsent[0].is_published():
                    unsent.popleft()
                waiting += len(unsent)
        return waiting + self._inflight + self._pending_decodes

    def _send(self, reply: _Reply, payload: bytes, form: Form, hlen: int | None, error: str | None = None) -> bool:
        """Hand one reply to paho; False (counted) when it was dropped."""
        client = self._client
        if client is None:
            return False
        if self.backlog() >= self.options.max_pending_replies + REFUSAL_RESERVE:
            # Even the refusals are not leaving (a stuck broker): drop, count, never grow without bound.
            self._reply_dropped(reply, "the broker is not taking replies fast enough")
            return False
        if self.replies.refusal(reply.topic) is not None and self._refused_reply("", reply):
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
                user=users)
        info = client.publish(reply.topic, payload, qos=reply.qos, properties=props)
        if info.rc != mqtt.MQTT_ERR_SUCCESS:
            self._reply_dropped(reply, mqtt.error_string(info.rc))
            return False
        with self._unsent_lock:
            self._unsent[reply.qos].append(info)
        return True

    def _refused_reply(self, request_topic: str, reply: _Reply) -> bool:
        """A reply topic outside the reply namespace: counted, logged (rate-limited), and said on the
        daemon's own error topic instead (with the request's correlation), never published there."""
        why = self.replies.refusal(reply.topic)
        if why is None:
            return False
        self._count("replies_refused")
        self._warn("reply-refused", f"a request on {request_topic!r} asked for its reply on {reply.topic[:128]!r}: "
                   f"refused, {why}; {self.counters['replies_refused']} so far")
        client = self._client
        if client is None or self.backlog() >= self.options.max_pending_replies + REFUSAL_RESERVE:
            return True
        body: dict[str, Any] = {"error": f"response topic refused: {why}", "code": ErrorCode.PERMISSION_DENIED.value,
                                "request_topic": request_topic[:256], "response_topic": reply.topic[:256]}
        if reply.request_id is not None:
            body["id"] = reply.request_id[:256]
        props = None
        if self.options.v5:
            props = publish_properties(correlation=reply.correlation, content_type=codec.CONTENT_TYPE_JSON,
                                       user=[(codec.ERROR_CODE_PROPERTY, ErrorCode.PERMISSION_DENIED.value)])
        try:
            info = client.publish(self.topics.errors, dumps(body), qos=0, properties=props)
        except ValueError:
            return True
        if info.rc == mqtt.MQTT_ERR_SUCCESS:
            with self._unsent_lock:
                self._unsent[0].append(info)
        return True

    def _reply_dropped(self, reply: _Reply, why: str) -> None:
        self._count("replies_dropped")
        self._warn("reply-dropped", f"a reply to {reply.topic!r} was dropped ({why}); "
                   f"{self.counters['replies_dropped']} so far")

    def _drop(self, topic: str, why: str) -> None:
        self._count("dropped")
        self._warn("drop-" + why.split(":", maxsplit=1)[0][:24], f"request on {topic!r} dropped: {why}")

    # ---- stream bindings ------------------------------------------------------------------
    def _render_output(self, b: StreamBinding, topic: str) -> str:
        return b.output_topic.format(topic=topic, device=self.device, model=b.model, prefix=self.prefix,
                                     version=b.version if b.version is not None else "latest")

    def _process_binding(self, b: StreamBinding, item: Item) -> tuple[bytes, int | None]:
        """Run one buffered message through the model (a binding's own thread)."""
        if b.input_format == "media":
            return self._process_media_binding(b, item), None
        if b.input_format == "raw":
            assert b.input_name is not None and b.datatype is not None and b.shape is not None
            arr = raw_tensor(item.payload, b.datatype, b.shape)
            decoded = DecodedRequest(InferRequest(model=b.model, version=b.version, inputs={b.input_name: arr}))
            form = Form.JSON
        else:
            fr = codec.parse(item.payload, item.header_length)
            decoded = decode_request(fr.header, fr.tail, model=b.model, version=b.version)
            form = fr.form
        decoded.request.deadline = item.deadline
        resp = self.service.infer_blocking(decoded.request)
        header, chunks = encode_response(resp, decoded)
        header["input_topic"] = item.topic
        header["timestamp"] = item.received_at
        if item.frame_timestamp is not None:
            header["frame_timestamp"] = item.frame_timestamp
        form, payload, hlen = codec.frame(form, header, chunks, properties=self.options.v5)
        return payload, hlen if form is Form.BINARY_PROPERTY else None

    def _process_media_binding(self, b: StreamBinding, item: Item) -> bytes:
        """A camera frame (or sound chunk): the model's one BYTES input, answered as plain JSON."""
        kind = media.declared_media_type(b.content_type) or media.media_type(item.payload, item.content_type)
        if kind is None:
            raise InvalidInputError("the message is not a JPEG, PNG, WebP or WAV (set the binding's content_type "
                                    "or the message's MQTT 5 content type)")
        mv = self.service.model(b.model, b.version)
        name = media.media_input(b.model, [(s.name, s.datatype) for s in mv.inputs])
        resp = self.service.infer_blocking(InferRequest(model=b.model, version=b.version, deadline=item.deadline,
                                                        inputs={name: media.media_tensor(item.payload)}))
        body = media.answer(resp.model, resp.version, resp.outputs, media=kind)
        body["input_topic"] = item.topic
        body["timestamp"] = item.received_at
        if item.frame_timestamp is not None:
            body["frame_timestamp"] = item.frame_timestamp
        return dumps(body)

    def _binding_error(self, b: StreamBinding, item: Item, err: EdgedError) -> bytes:
        body: dict[str, Any] = {"error": self.scrub.text(err.message), "code": err.code.value, "model_name": b.model,
                                "input_topic": item.topic, "timestamp": item.received_at}
        if item.frame_timestamp is not None:
            body["frame_timestamp"] = item.frame_timestamp
        return dumps(body)

    def _publish_plain(self, topic: str, payload: bytes, qos: int, hlen: int | None) -> None:
        client = self._client
        if client is None:
            return
        props = None
        if self.options.v5 and hlen is not None:
            props = publish_properties(user=[(codec.HEADER_LENGTH_PROPERTY, str(hlen))])
        info = client.publish(topic, payload, qos=qos, properties=props)
        if info.rc != mqtt.MQTT_ERR_SUCCESS:
            self._count("binding_outputs_lost")

    # ---- for other components (telemetry) ---------------------------------------------------
    def publish(self, topic: str, payload: bytes, *, qos: int = 1, retain: bool = False) -> bool:
        """Publish on the daemon's connection (thread-safe, never blocks); False when not connected
        or paho's bounded queue is full, so the caller keeps its own buffer."""
        client = self._client
        if client is None or not self.link.up:
            return False
        try:
            return client.publish(topic, payload, qos=qos, retain=retain).rc == mqtt.MQTT_ERR_SUCCESS
        except ValueError:  # an invalid topic
            return False

    # ---- availability ---------------------------------------------------------------------
    def publish_status(self, *, force: bool = False) -> None:
        """Publish the retained device and per-model status; without ``force`` only when they changed."""
        client = self._client
        if client is None or not self.link.up:
            return
        statuses = self.service.manager.statuses()
        io: dict[str, dict[str, Any]] = {}
        for name in {str(st["name"]) for st in statuses}:
            try:
                io[name] = self.service.metadata(name)
            except EdgedError:
                pass  # unloaded meanwhile
        docs = {name: self.scrub.data(dumps(doc)) for name, doc in model_statuses(statuses, io).items()}
        qos = self.options.qos
        with self._status_lock:
            if not force and docs == self._published_models:
                return
            client.publish(self.topics.status, device_online(self.device, self.profile_name, statuses,
                                                             error=self.link.subscription_error),
                           qos=qos, retain=True)
            for name, doc in docs.items():
                if force or self._published_models.get(name) != doc:
                    client.publish(self.topics.model_status(name), doc, qos=qos, retain=True)
            for gone in set(self._published_models) - set(docs):
                client.publish(self.topics.model_status(gone), b"", qos=qos, retain=True)  # clears it
            self._published_models = docs

    def _watch_models(self) -> None:
        """Republish statuses when models are loaded, reloaded or unloaded while connected."""
        while not self._watch_stop.wait(STATUS_POLL_S):
            try:
                self.publish_status()
            except Exception:
                log.exception("MQTT status publish failed")

    # ---- small helpers --------------------------------------------------------------------
    def _count(self, key: str) -> None:
        with self._counter_lock:
            self.counters[key] += 1

    def _warn(self, key: str, msg: str) -> None:
        # Misbehaving clients can send thousands of bad requests a second: one line per 30 s per kind.
        now = time.monotonic()
        if now - self._warned.get(key, -1e9) >= 30:
            self._warned[key] = now
            log.warning("MQTT: %s", msg)


def _release(inc: _Incoming) -> None:
    """A request's memory the service did not take over (refused, dropped or answered at once)."""
    hold, inc.hold = inc.hold, None
    if hold is not None:
        hold.release()


def _user_property(props: Properties | None, key: str) -> str | None:
    if props is None:
        return None
    for k, v in getattr(props, "UserProperty", None) or ():
        if k.lower() == key.lower():
            return cast(str, v)
    return None


def _deadline(props: Properties | None) -> float | None:
    """The monotonic time at which an MQTT 5 message expires (the broker sends the time left)."""
    expiry = getattr(props, "MessageExpiryInterval", None) if props is not None else None
    return None if expiry is None else time.monotonic() + float(expiry)

