"""MQTT transport: v2 inference requests over a broker, stream bindings, retained availability.

This class only composes the parts, each a module with one job: the broker session
(:mod:`.session`: connect, reconnect, subscriptions), requests and their replies (:mod:`.intake`,
:mod:`.replies`, bounded together by :mod:`.backlog`), stream bindings (:mod:`.streams`) and the
retained status (:mod:`.status_publisher`). paho's network thread runs the session's callbacks;
none of them blocks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

import paho.mqtt.client as mqtt

from edged.config import Config, StreamBinding
from edged.core.service import InferenceService
from edged.protocol.fleet.telemetry import MqttWindow
from edged.protocol.mqtt import Topics
from edged.protocol.mqtt_topics import ReplyPolicy
from edged.transports.mqtt.backlog import Backlog
from edged.transports.mqtt.bindings import BindingStats, validate_bindings
from edged.transports.mqtt.connection import MqttOptions
from edged.transports.mqtt.counts import Counts
from edged.transports.mqtt.intake import RequestIntake
from edged.transports.mqtt.replies import ReplyPublisher
from edged.transports.mqtt.session import MqttSession
from edged.transports.mqtt.stall import StallDetector
from edged.transports.mqtt.status_publisher import StatusPublisher
from edged.transports.mqtt.streams import StreamBindings
from edged.transports.redact import Scrubber

if TYPE_CHECKING:
    from edged.telemetry.prometheus import MetricsRenderer

log = logging.getLogger("edged.transports.mqtt.transport")

STOP_GRACE_S = 2.0


class MqttTransport:
    name = "mqtt"

    def __init__(
        self,
        cfg: Config,
        service: InferenceService,
        profile_name: str,
        *,
        options: MqttOptions | None = None,
        metrics: MetricsRenderer | None = None,
    ) -> None:
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
        self.replies = ReplyPolicy(
            self.prefix, self.device, cfg.mqtt.reply_topics, also_reserved=[b.topic for b in self.bindings]
        )
        self.scrub = Scrubber.for_config(cfg)  # model reasons and errors name files under these
        self.counts = Counts()
        self.counters = self.counts.counters
        self.pending = Backlog()
        self._stall = StallDetector()
        self.session = MqttSession(
            self.options,
            self.topics,
            self.bindings,
            self.counts,
            device=self.device,
            on_message=self._on_message,
            on_up=self.pending.reconnected,
            on_status=lambda: self.publish_status(force=True),
        )
        self.link = self.session.link
        self.ready = self.session.ready  # connected and subscribed to every request filter
        self.status = StatusPublisher(self.session, service, self.scrub, device=self.device, profile_name=profile_name)
        self.answers = ReplyPublisher(
            self.session, self.replies, backlog=self.pending, counts=self.counts, stall=self._stall, scrub=self.scrub
        )
        self.requests = RequestIntake(
            self.session,
            service,
            self.answers,
            backlog=self.pending,
            counts=self.counts,
            stall=self._stall,
            max_payload_mb=cfg.mqtt.max_payload_mb,
        )
        self.streams = StreamBindings(
            self.bindings,
            self.session,
            service,
            self.counts,
            self.scrub,
            device=self.device,
            prefix=self.prefix,
            max_payload_mb=cfg.mqtt.max_payload_mb,
        )

    # ---- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        """Start connecting in the background; a missing broker never stops the daemon."""
        self.requests.start()
        self.streams.start()
        self.session.start()
        if self.metrics is not None:
            self.metrics.collector.mqtt = self.stats
        self.status.start()

    async def stop(self) -> None:
        await asyncio.to_thread(self._stop_blocking)

    def _stop_blocking(self) -> None:
        """Stop taking work, let in-flight replies go out, say offline (retained), disconnect."""
        self.session.stopping = True
        if self.session.client is None:
            return
        self.session.unsubscribe()
        self.streams.close_buffers()
        end = time.monotonic() + STOP_GRACE_S
        self.requests.drain(end)
        self.streams.stop(end)
        self.status.stop()
        self.session.close()
        self.status.join()
        if self.metrics is not None and self.metrics.collector.mqtt == self.stats:
            self.metrics.collector.mqtt = None
        log.info("MQTT transport stopped (%s)", self.counts.summary())

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until connected and subscribed (tests, tools); False on timeout.

        Raises FAILED_PRECONDITION when the broker refused a request subscription: waiting longer
        would not help, the broker's ACL (or the topic prefix) has to change.
        """
        return self.session.wait_ready(timeout)

    # ---- paho's thread: route each message -------------------------------------------------
    def _on_message(self, msg: mqtt.MQTTMessage, topic: str) -> None:
        if topic.startswith(self.topics.infer_root):
            self.requests.on_request(msg, topic)
            return
        self.streams.dispatch(msg, topic)

    # ---- state, for telemetry, /metrics and tools ------------------------------------------
    @property
    def inflight(self) -> int:
        return self.pending.inflight

    def backlog(self) -> int:
        """Requests being decoded or computed plus replies the broker has not taken yet."""
        return self.pending.count()

    def stats(self) -> MqttWindow:
        """Counts since start, for /metrics, telemetry and ``edged status``."""
        c = self.counts.snapshot()
        errors = sum(v for k, v in c.items() if k.startswith("error_"))
        return MqttWindow(
            requests=c.get("requests", 0),
            replies=c.get("replies", 0),
            error_replies=errors,
            overloaded=c.get("overloaded", 0),
            replies_dropped=c.get("replies_dropped", 0),
            requests_dropped=c.get("dropped", 0),
            replies_refused=c.get("replies_refused", 0),
            backlog=self.backlog(),
            broker_stall=self._stall.message,
            streams=self.streams.windows(),
        )

    def binding_stats(self) -> list[BindingStats]:
        return self.streams.stats()

    # ---- for other components (telemetry) ---------------------------------------------------
    def publish(self, topic: str, payload: bytes, *, qos: int = 1, retain: bool = False) -> bool:
        """Publish on the daemon's connection (thread-safe, never blocks); False when not connected
        or paho's bounded queue is full, so the caller keeps its own buffer."""
        return self.session.publish(topic, payload, qos=qos, retain=retain)

    def publish_status(self, *, force: bool = False) -> None:
        """Publish the retained device and per-model status; without ``force`` only when they changed."""
        self.status.publish(force=force)
