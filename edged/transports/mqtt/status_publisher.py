"""Publishing the retained device and per-model status (documents built in :mod:`.status`).

Said on every (re)connect and when the broker refuses a request subscription (the device status
carries the error), and again whenever models are loaded, reloaded or unloaded: a thread of its own
polls for changes, so nothing on paho's thread waits for the service.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from edged.core.service import InferenceService
from edged.errors import EdgedError
from edged.protocol.v2 import dumps
from edged.protocol.v2_models import metadata_response
from edged.transports.mqtt.session import MqttSession
from edged.transports.mqtt.status import device_online, model_statuses
from edged.transports.redact import Scrubber

log = logging.getLogger("edged.transports.mqtt.transport")

STATUS_POLL_S = 2.0


class StatusPublisher:
    """The retained statuses last published, and the thread that republishes them on change."""

    def __init__(
        self, session: MqttSession, service: InferenceService, scrub: Scrubber, *, device: str, profile_name: str
    ) -> None:
        self.session, self.service, self.scrub = session, service, scrub
        self.device, self.profile_name = device, profile_name
        self._status_lock = threading.Lock()
        self._published_models: dict[str, bytes] = {}
        self._watch_stop = threading.Event()
        self._watch: threading.Thread | None = None

    def start(self) -> None:
        self._watch = threading.Thread(target=self._watch_models, name="edged-mqtt-status", daemon=True)
        self._watch.start()

    def stop(self) -> None:
        """Stop watching (the thread ends at its next poll; :meth:`join` waits for it)."""
        self._watch_stop.set()

    def join(self) -> None:
        if self._watch is not None:
            self._watch.join(1.0)

    def publish(self, *, force: bool = False) -> None:
        """Publish the retained device and per-model status; without ``force`` only when they changed."""
        client = self.session.client
        if client is None or not self.session.link.up:
            return
        statuses = self.service.statuses()
        io: dict[str, dict[str, Any]] = {}
        for name in {str(st["name"]) for st in statuses}:
            try:
                io[name] = metadata_response(self.service.describe(name))
            except EdgedError:
                pass  # unloaded meanwhile
        docs = {name: self.scrub.data(dumps(doc)) for name, doc in model_statuses(statuses, io).items()}
        topics = self.session.topics
        qos = self.session.options.qos
        with self._status_lock:
            if not force and docs == self._published_models:
                return
            client.publish(
                topics.status,
                device_online(self.device, self.profile_name, statuses, error=self.session.link.subscription_error),
                qos=qos,
                retain=True,
            )
            for name, doc in docs.items():
                if force or self._published_models.get(name) != doc:
                    client.publish(topics.model_status(name), doc, qos=qos, retain=True)
            for gone in set(self._published_models) - set(docs):
                client.publish(topics.model_status(gone), b"", qos=qos, retain=True)  # clears it
            self._published_models = docs

    def _watch_models(self) -> None:
        """Republish statuses when models are loaded, reloaded or unloaded while connected."""
        while not self._watch_stop.wait(STATUS_POLL_S):
            try:
                self.publish()
            except Exception:
                log.exception("MQTT status publish failed")
