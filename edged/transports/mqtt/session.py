"""The MQTT transport's broker session: connecting, reconnecting with backoff, and the subscriptions.

paho runs the connection on its own network thread; its callbacks land here and never block.
The session subscribes to the request filters first, then the stream bindings' topics, on every
(re)connect, and tells whether the broker granted them: a refused request subscription is an error
to report (the broker's ACL or the topic prefix must change), not a reason to wait.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, cast

import paho.mqtt.client as mqtt
from paho.mqtt.properties import Properties
from paho.mqtt.reasoncodes import ReasonCode

from edged.backoff import Backoff
from edged.config import StreamBinding
from edged.errors import EdgedError, ErrorCode
from edged.protocol.mqtt import Topics
from edged.protocol.mqtt_tcp import quick_ack
from edged.transports.mqtt.connection import LinkState, MqttOptions, connect_properties, make_client
from edged.transports.mqtt.counts import Counts
from edged.transports.mqtt.status import device_offline

log = logging.getLogger("edged.transports.mqtt.transport")

OnMessage = Callable[[mqtt.MQTTMessage, str], None]


class MqttSession:
    """paho's client and the state of its link; ``client`` is None until :meth:`start`."""

    def __init__(  # noqa: PLR0913  the transport's shared parts plus keyword-only callbacks
        self,
        options: MqttOptions,
        topics: Topics,
        bindings: list[StreamBinding],
        counts: Counts,
        *,
        device: str,
        on_message: OnMessage,
        on_up: Callable[[], None],
        on_status: Callable[[], None],
    ) -> None:
        """``on_message(msg, topic)`` gets every message (paho's thread); ``on_up`` runs on each
        connect, ``on_status`` when the retained status must be said again (connected, or refused)."""
        self.options, self.topics, self.bindings = options, topics, bindings
        self.device = device
        self.link = LinkState(options.url)
        self.ready = threading.Event()  # connected and subscribed to every request filter
        self.settled = threading.Event()  # the broker answered the subscriptions
        self.backoff = Backoff(options.reconnect_min_s, options.reconnect_max_s)
        self.client: mqtt.Client | None = None
        self.stopping = False
        self._counts = counts
        self._on_message, self._on_up, self._on_status = on_message, on_up, on_status
        self._sub_mid: int | None = None
        self._sub_topics: list[str] = []

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        """Start connecting in the background; a missing broker never stops the daemon."""
        opts = self.options
        client = make_client(
            opts, will_topic=self.topics.status, will_payload=device_offline(self.device, "connection lost")
        )
        client.on_connect = self._on_connect
        client.on_connect_fail = self._on_connect_fail
        client.on_disconnect = self._on_disconnect
        client.on_subscribe = self._on_subscribe
        client.on_message = self._on_any_message
        client.on_publish = self._on_publish
        self.client = client
        kwargs: dict[str, Any] = {}
        if opts.v5:
            kwargs = {"clean_start": opts.clean_start, "properties": connect_properties(opts)}
        log.info(
            "MQTT transport: connecting to %s as %r (MQTT %s); requests on %sinfer/<model>[/<version>], "
            "%d stream binding(s)",
            opts.url,
            opts.client_id,
            "5" if opts.v5 else "3.1.1",
            self.topics.base + "/",
            len(self.bindings),
        )
        client.connect_async(opts.host, opts.port, keepalive=opts.keepalive_s, **kwargs)
        client.loop_start()

    def unsubscribe(self) -> None:
        """Leave the subscriptions on stop, unless a persistent session keeps them so that the broker
        queues requests for the next start."""
        client = self.client
        if client is None or not (self.link.up and self.options.clean_start):
            return
        try:
            client.unsubscribe(self.topics.infer_filters + [b.topic for b in self.bindings])
        except Exception:
            log.debug("unsubscribe failed", exc_info=True)

    def close(self) -> None:
        """Say offline (retained) while still connected, then disconnect and stop paho's thread."""
        client = self.client
        if client is None:
            return
        if self.link.up:
            try:
                info = client.publish(self.topics.status, device_offline(self.device, "stopped"), qos=1, retain=True)
                info.wait_for_publish(1.0)
            except Exception:
                log.debug("could not publish offline status", exc_info=True)
        client.disconnect()
        client.loop_stop()

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until connected and subscribed (tests, tools); False on timeout.

        Raises FAILED_PRECONDITION when the broker refused a request subscription: waiting longer
        would not help, the broker's ACL (or the topic prefix) has to change.
        """
        if not self.settled.wait(timeout):
            return False
        if self.ready.is_set():
            return True
        error = self.link.subscription_error
        if error is not None:
            raise EdgedError(error, code=ErrorCode.FAILED_PRECONDITION)
        return False

    def publish(self, topic: str, payload: bytes, *, qos: int = 1, retain: bool = False) -> bool:
        """Publish on the connection (thread-safe, never blocks); False when not connected or paho's
        bounded queue is full, so the caller keeps its own buffer."""
        client = self.client
        if client is None or not self.link.up:
            return False
        try:
            return client.publish(topic, payload, qos=qos, retain=retain).rc == mqtt.MQTT_ERR_SUCCESS
        except ValueError:  # an invalid topic
            return False

    # ---- paho's callbacks (its network thread: never block) --------------------------------
    def _on_connect(
        self, client: mqtt.Client, userdata: Any, flags: Any, reason: ReasonCode, properties: Properties | None
    ) -> None:
        try:
            if reason.is_failure:
                self.link.set_down(f"broker refused the connection: {reason}")
                self._set_retry_delay(client)
                return
            self.backoff.reset()
            self.link.set_up()
            self._on_up()
            subs = [(f, self.options.qos) for f in self.topics.infer_filters]
            subs += [(b.topic, b.qos) for b in self.bindings]
            self._sub_topics = [f for f, _ in subs]
            _, self._sub_mid = client.subscribe(subs)
            self._on_status()
        except Exception:
            log.exception("MQTT on_connect handler failed")

    def _on_subscribe(
        self, client: mqtt.Client, userdata: Any, mid: int, reasons: list[ReasonCode], properties: Properties | None
    ) -> None:
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
                    self._counts.warn(
                        f"binding-sub-{topic}", f"the broker refused the stream binding's subscription {topic!r} ({r})"
                    )
            if infer_refused:
                self.ready.clear()
                self.link.set_subscriptions(
                    "the broker refused the request subscription(s) " + ", ".join(infer_refused)
                )
                self._on_status()  # the retained device status carries the error
            else:
                self.link.set_subscriptions(None)
                self.ready.set()
            self.settled.set()
        except Exception:
            log.exception("MQTT on_subscribe handler failed")

    def _on_connect_fail(self, client: mqtt.Client, userdata: Any) -> None:
        try:
            self.ready.clear()
            self.settled.clear()
            self.link.set_down("cannot reach the broker")
            self._set_retry_delay(client)
        except Exception:
            log.exception("MQTT on_connect_fail handler failed")

    def _on_disconnect(
        self, client: mqtt.Client, userdata: Any, flags: Any, reason: ReasonCode, properties: Properties | None
    ) -> None:
        try:
            self.ready.clear()
            self.settled.clear()
            if self.stopping:
                self.link.set_down("stopped", retrying=False)
                return
            from_broker = bool(getattr(flags, "is_disconnect_packet_from_server", False))
            self.link.set_down(f"the broker closed the session: {reason}" if from_broker else "connection lost")
            self._set_retry_delay(client)
        except Exception:
            log.exception("MQTT on_disconnect handler failed")

    def _set_retry_delay(self, client: mqtt.Client) -> None:
        # paho waits min_delay before its next attempt once the delay is reset; we choose each wait.
        delay = self.backoff.next_delay()
        client.reconnect_delay_set(cast(int, delay), cast(int, delay))

    def _on_publish(
        self, client: mqtt.Client, userdata: Any, mid: int, reason: ReasonCode, properties: Properties | None
    ) -> None:
        quick_ack(client)  # the broker's PUBACK: do not let its next write wait for our delayed ACK

    def _on_any_message(self, client: mqtt.Client, userdata: Any, msg: mqtt.MQTTMessage) -> None:
        quick_ack(client)
        try:
            self._on_message(msg, msg.topic)
        except Exception:
            log.exception("MQTT message handler failed; the connection keeps serving")
