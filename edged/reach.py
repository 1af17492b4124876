"""Where a running daemon is, from its configuration: one mapping for every client-side command.

``edged infer --transport ...`` and ``edged perf`` both reach the daemon the way its own
config says it listens; keeping the mapping here means a new config key (TLS, a wildcard
listen address) is honoured by both at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from edged.client.mqtt import MqttClient
    from edged.config import Config

_WILDCARDS = ("0.0.0.0", "::", "[::]")


def http_address(listen: str) -> str:
    """A listen address as a client dials it: a wildcard host becomes loopback; Unix sockets pass."""
    host, _, port = listen.rpartition(":")
    if listen.startswith(("/", "unix:")) or not host:
        return listen
    return f"127.0.0.1:{port}" if host in _WILDCARDS else listen


def http_address_of(cfg: Config) -> str:
    return http_address(cfg.http.listen)


def grpc_address_of(cfg: Config) -> str:
    from edged.errors import ConfigError

    if cfg.grpc is None or not cfg.grpc.enabled:
        raise ConfigError("the daemon's configuration has no [grpc] listener (add a [grpc] section)")
    return http_address(cfg.grpc.listen)


def shm_address_of(cfg: Config) -> str:
    return str(cfg.shm_socket)


@dataclass(frozen=True)
class MqttSettings:
    """How a client reaches the daemon over MQTT: broker, the daemon's topics, credentials, TLS files."""

    url: str
    device_id: str
    topic_prefix: str = "edged"
    protocol: Literal["5", "3.1.1"] = "5"
    username: str | None = None
    password: str | None = None
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None

    @classmethod
    def from_config(cls, cfg: Config, *, url: str | None = None, device_id: str | None = None,
                    topic_prefix: str | None = None) -> MqttSettings:
        """The daemon's ``[mqtt]`` and ``[device]`` settings; the keyword arguments override them."""
        m = cfg.mqtt
        tls = m.tls
        return cls(url=url or m.url, device_id=device_id or cfg.device.id,
                   topic_prefix=topic_prefix or m.topic_prefix, protocol=m.protocol, username=m.username,
                   password=m.password, ca_file=str(tls.ca_file) if tls and tls.ca_file else None,
                   cert_file=str(tls.cert_file) if tls and tls.cert_file else None,
                   key_file=str(tls.key_file) if tls and tls.key_file else None)

    def client(self, *, binary: bool = True, connect_timeout: float = 10.0, qos: int = 1) -> MqttClient:
        from edged.client.mqtt import MqttClient

        return MqttClient(self.url, self.device_id, self.topic_prefix, protocol=self.protocol, binary=binary,
                          username=self.username, password=self.password, ca_file=self.ca_file,
                          cert_file=self.cert_file, key_file=self.key_file, connect_timeout=connect_timeout,
                          qos=qos)
