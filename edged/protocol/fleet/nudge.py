"""Optional MQTT nudge: tell devices to poll now instead of at their next interval.

A nudge carries no authority: devices only poll sooner and still verify everything, so a
forged nudge costs one request. Publishing happens on paho's own network thread.
"""

from __future__ import annotations

import json
import logging
import threading
from typing import Any
from urllib.parse import urlsplit

from edged.errors import MissingDependencyError

log = logging.getLogger(__name__)


def fleet_topic(prefix: str) -> str:
    return f"{prefix}/fleet/sync-nudge"


def device_topic(prefix: str, device_id: str) -> str:
    return f"{prefix}/{device_id}/sync-nudge"


class Nudger:
    def __init__(self, url: str, prefix: str) -> None:
        """Refuses at start when paho is missing: the registry's extra leaves MQTT out, a nudge is opt-in."""
        try:
            import paho.mqtt.client  # noqa: F401
        except ImportError:
            raise MissingDependencyError("nudge_mqtt_url is set but paho-mqtt is not installed: "
                                         "pip install 'edged[registry,mqtt]', or remove nudge_mqtt_url") from None
        self.url, self.prefix = url, prefix
        self._client: Any = None
        self._lock = threading.Lock()

    def _connect(self) -> Any:
        import paho.mqtt.client as mqtt
        from paho.mqtt.enums import CallbackAPIVersion

        parts = urlsplit(self.url)
        client = mqtt.Client(CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv311)
        if parts.scheme == "mqtts":
            client.tls_set()
        if parts.username:
            client.username_pw_set(parts.username, parts.password)
        client.connect_async(parts.hostname or "127.0.0.1", parts.port or (8883 if parts.scheme == "mqtts" else 1883))
        client.loop_start()
        return client

    def nudge(self, payload: dict[str, Any], device_id: str | None = None) -> None:
        with self._lock:
            if self._client is None:
                self._client = self._connect()
            topic = device_topic(self.prefix, device_id) if device_id else fleet_topic(self.prefix)
            self._client.publish(topic, json.dumps(payload), qos=1)

    def close(self) -> None:
        with self._lock:
            if self._client is not None:
                self._client.loop_stop()
                self._client.disconnect()
                self._client = None
