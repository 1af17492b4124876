"""Listen for MQTT nudges from the registry and poll early. A nudge carries no authority, only timing."""

from __future__ import annotations

import logging
import ssl
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from edged.config import Config
from edged.protocol.fleet.nudge import device_topic, fleet_topic

log = logging.getLogger(__name__)


class NudgeListener:
    def __init__(self, cfg: Config, on_nudge: Callable[[], None]) -> None:
        self.cfg = cfg
        self.on_nudge = on_nudge
        self._client: Any = None
        prefix = cfg.mqtt.topic_prefix
        self.topics = [fleet_topic(prefix), device_topic(prefix, cfg.device.id)]

    def start(self) -> None:
        import paho.mqtt.client as mqtt
        from paho.mqtt.enums import CallbackAPIVersion

        m = self.cfg.mqtt
        parts = urlsplit(m.url)
        client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"{self.cfg.device.id}-sync",
                             protocol=mqtt.MQTTv311)
        if m.username:
            client.username_pw_set(m.username, m.password)
        if parts.scheme in ("mqtts", "wss") or m.tls is not None:
            tls = m.tls
            client.tls_set(ca_certs=str(tls.ca_file) if tls and tls.ca_file else None,
                           certfile=str(tls.cert_file) if tls and tls.cert_file else None,
                           keyfile=str(tls.key_file) if tls and tls.key_file else None,
                           cert_reqs=ssl.CERT_NONE if tls and tls.insecure_skip_verify else ssl.CERT_REQUIRED)

        def on_connect(c: Any, _u: Any, _f: Any, rc: Any, _p: Any = None) -> None:
            if not rc.is_failure:
                for t in self.topics:
                    c.subscribe(t, qos=1)

        def on_message(_c: Any, _u: Any, _msg: Any) -> None:
            self.on_nudge()  # only schedules a poll on the event loop: never blocks paho's thread

        client.on_connect = on_connect
        client.on_message = on_message
        client.connect_async(parts.hostname or "127.0.0.1",
                             parts.port or (8883 if parts.scheme == "mqtts" else 1883), keepalive=m.keepalive_s)
        client.loop_start()
        self._client = client

    def stop(self) -> None:
        if self._client is not None:
            self._client.disconnect()
            self._client.loop_stop()
            self._client = None
