"""One inference through a running daemon, for `edged infer --transport shm|http|mqtt`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from edged.config import Config
from edged.errors import EdgedError
from edged.repository.manifest import TensorSpec


def specs_from_metadata(meta: Mapping[str, Any]) -> tuple[list[TensorSpec], int]:
    """Input specs and max batch size from v2 metadata (a leading -1 is the batch dimension)."""
    specs, batched = [], False
    for t in meta.get("inputs") or []:
        shape = list(t["shape"])
        mbs = int(meta.get("max_batch_size", -1))
        if (mbs > 0 or (mbs < 0 and shape and shape[0] == -1)) and shape:
            shape, batched = shape[1:], True
        specs.append(TensorSpec(name=t["name"], datatype=t["datatype"], shape=shape))
    return specs, (1 if batched else 0)


def _http_address(listen: str) -> str:
    host, _, port = listen.rpartition(":")
    if listen.startswith(("/", "unix:")) or not host:
        return listen
    return f"127.0.0.1:{port}" if host in ("0.0.0.0", "::", "[::]") else listen


class RemoteModel:
    """Metadata and inference over one transport; each client is imported only when used."""

    def __init__(self, cfg: Config, transport: str) -> None:
        self.transport = transport
        self._client: Any
        if transport == "http":
            from edged.client.http import HttpClient
            self._client = HttpClient(_http_address(cfg.http.listen))
        elif transport == "shm":
            from edged.client.shm import ShmClient
            self._client = ShmClient(cfg.shm_socket)
        elif transport == "mqtt":
            from edged.client.mqtt import MqttClient
            tls = cfg.mqtt.tls
            self._client = MqttClient(
                cfg.mqtt.url, cfg.device.id, cfg.mqtt.topic_prefix, protocol=cfg.mqtt.protocol,
                username=cfg.mqtt.username, password=cfg.mqtt.password,
                ca_file=tls.ca_file if tls else None, cert_file=tls.cert_file if tls else None,
                key_file=tls.key_file if tls else None)
        else:
            raise EdgedError(f"unknown transport {transport!r}")

    def metadata(self, model: str, version: int | None) -> dict[str, Any]:
        if self.transport == "mqtt":
            return dict(self._client.model_status(model))
        return dict(self._client.metadata(model, version))

    def infer(self, model: str, inputs: Mapping[str, np.ndarray], version: int | None) -> dict[str, np.ndarray]:
        return dict(self._client.infer(model, inputs, version=version))

    def close(self) -> None:
        self._client.close()
