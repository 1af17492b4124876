"""The broker connection: settings from config, TLS checks, the paho client, backoff, state logging.

paho runs its own network thread and reconnects by itself; we only replace its
fixed doubling with a capped exponential backoff with jitter (so a fleet that
lost its broker does not reconnect in lockstep) and log the link state once per
change instead of once per retry.
"""

from __future__ import annotations

import logging
import ssl
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import urlsplit

from edged.config import Config
from edged.errors import ConfigError
from edged.protocol.mqtt_tcp import no_delay

if TYPE_CHECKING:
    import paho.mqtt.client as mqtt

log = logging.getLogger("edged.transports.mqtt.transport")


@dataclass(frozen=True)
class MqttOptions:
    """Everything the connection needs, resolved from ``[mqtt]`` and ``[device]``."""

    url: str
    host: str
    port: int
    transport: Literal["tcp", "websockets"]
    ws_path: str
    tls: bool
    ca_file: Path | None
    cert_file: Path | None
    key_file: Path | None
    insecure: bool
    username: str | None
    password: str | None
    v5: bool
    client_id: str
    keepalive_s: int
    qos: int
    reply_qos: int | Literal["request"]
    max_pending_replies: int
    clean_start: bool
    session_expiry_s: int
    reconnect_min_s: float
    reconnect_max_s: float
    max_payload_bytes: int

    @classmethod
    def from_config(cls, cfg: Config) -> MqttOptions:
        m = cfg.mqtt
        parts = urlsplit(m.url)
        scheme = parts.scheme
        tls = scheme in ("mqtts", "wss") or m.tls is not None
        default_port = {"mqtt": 1883, "mqtts": 8883, "ws": 80, "wss": 443}[scheme]
        try:
            port = parts.port or default_port
        except ValueError:
            raise ConfigError(f"mqtt.url: {m.url!r} has an invalid port", ["mqtt.url: invalid port"]) from None
        if not parts.hostname:
            raise ConfigError(f"mqtt.url: {m.url!r} has no host", ["mqtt.url: no host"])
        opts = cls(
            url=f"{scheme}://{parts.hostname}:{port}", host=parts.hostname, port=port,
            transport="websockets" if scheme in ("ws", "wss") else "tcp", ws_path=parts.path or "/mqtt",
            tls=tls,
            ca_file=m.tls.ca_file if m.tls else None, cert_file=m.tls.cert_file if m.tls else None,
            key_file=m.tls.key_file if m.tls else None, insecure=bool(m.tls and m.tls.insecure_skip_verify),
            username=m.username if m.username is not None else parts.username,
            password=m.password if m.password is not None else parts.password,
            v5=m.protocol == "5", client_id=m.client_id or f"edged-{cfg.device.id}",
            keepalive_s=m.keepalive_s, qos=m.qos, reply_qos=m.reply_qos,
            max_pending_replies=m.max_pending_replies, clean_start=m.clean_start,
            session_expiry_s=m.session_expiry_s, reconnect_min_s=m.reconnect_min_s,
            reconnect_max_s=max(m.reconnect_max_s, m.reconnect_min_s),
            max_payload_bytes=int(m.max_payload_mb * 1024 * 1024),
        )
        opts.check_files()
        return opts

    def check_files(self) -> None:
        """Refuse to start with TLS files that are missing: name every one."""
        problems = []
        for key, path in (("ca_file", self.ca_file), ("cert_file", self.cert_file), ("key_file", self.key_file)):
            if path is not None and not path.is_file():
                problems.append(f"mqtt.tls.{key}: {path} does not exist")
        if self.key_file is not None and self.cert_file is None:
            problems.append("mqtt.tls.key_file: set without cert_file")
        if problems:
            raise ConfigError("MQTT TLS configuration: " + "; ".join(problems), problems)


def make_client(opts: MqttOptions, *, will_topic: str, will_payload: bytes) -> mqtt.Client:
    """A configured, not yet connected paho client (VERSION2 callbacks)."""
    import paho.mqtt.client as mqtt
    from paho.mqtt.enums import CallbackAPIVersion

    protocol = mqtt.MQTTv5 if opts.v5 else mqtt.MQTTv311
    kwargs: dict[str, Any] = {}
    if not opts.v5:
        kwargs["clean_session"] = opts.clean_start
    client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=opts.client_id, protocol=protocol,
                         transport=opts.transport, reconnect_on_failure=True, **kwargs)
    # An exception escaping one of our callbacks must never end paho's network thread.
    client.suppress_exceptions = True
    # paho's own logger is left off: it reports every failed retry at ERROR level.
    # QoS 1 messages published while the broker is away wait in paho's queue; keep it bounded. The transport
    # bounds replies itself (max_pending_replies, see MqttTransport.backlog) so that a full queue never
    # refuses one; the rest is for status, telemetry and stream binding outputs.
    client.max_queued_messages_set(opts.max_pending_replies + 1024)
    client.will_set(will_topic, will_payload, qos=1, retain=True)
    client.on_socket_open = no_delay
    if opts.transport == "websockets":
        client.ws_set_options(path=opts.ws_path)
    if opts.username is not None:
        client.username_pw_set(opts.username, opts.password)
    if opts.tls:
        client.tls_set(
            ca_certs=str(opts.ca_file) if opts.ca_file else None,
            certfile=str(opts.cert_file) if opts.cert_file else None,
            keyfile=str(opts.key_file) if opts.key_file else None,
            cert_reqs=ssl.CERT_NONE if opts.insecure else ssl.CERT_REQUIRED,
            tls_version=ssl.PROTOCOL_TLS_CLIENT,
        )
        if opts.insecure:
            client.tls_insecure_set(True)
    return client


def connect_properties(opts: MqttOptions) -> Any:
    """CONNECT properties for MQTT 5 (the session expiry of a persistent session), else None."""
    if not opts.v5:
        return None
    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.properties import Properties

    props = Properties(PacketTypes.CONNECT)  # type: ignore[no-untyped-call]
    if opts.session_expiry_s > 0:
        props.SessionExpiryInterval = opts.session_expiry_s
    return props


class LinkState:
    """Whether the broker is reachable, logged once per change rather than once per retry."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._up: bool | None = None
        self._lock = threading.Lock()
        self.changes = 0
        self.connected = threading.Event()
        # Why the broker refused the request subscriptions (ACL, bad filter), None when it granted them.
        self.subscription_error: str | None = None
        self._logged_refusal: str | None = None

    @property
    def up(self) -> bool:
        return self._up is True

    def set_up(self) -> None:
        with self._lock:
            changed = self._up is not True
            self._up = True
            if changed:
                self.changes += 1
        self.connected.set()
        if changed:
            log.info("MQTT broker %s connected", self.url)

    def set_subscriptions(self, error: str | None) -> None:
        """Record the outcome of subscribing; a refusal is logged once, not on every reconnect."""
        self.subscription_error = error
        if error is None:
            if self._logged_refusal is not None:
                log.info("MQTT broker %s now grants the subscriptions", self.url)
            self._logged_refusal = None
        elif error != self._logged_refusal:
            self._logged_refusal = error
            log.error("MQTT broker %s: %s; no requests will arrive until this is fixed", self.url, error)

    def set_down(self, reason: str, *, retrying: bool = True) -> None:
        self.connected.clear()
        with self._lock:
            changed = self._up is not False
            self._up = False
            if changed:
                self.changes += 1
        if changed and not retrying:
            log.info("MQTT broker %s disconnected (%s)", self.url, reason)
        elif changed:
            log.warning("MQTT broker %s not connected (%s); retrying in the background", self.url, reason)
        else:
            log.debug("MQTT broker %s still not connected: %s", self.url, reason)
