"""One inference through a running daemon, for `edged infer --transport shm|http|grpc|mqtt`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from edged.config import Config
from edged.errors import EdgedError
from edged.reach import MqttSettings, grpc_address_of, http_address_of, shm_address_of
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


class RemoteModel:
    """Metadata and inference over one transport; each client is imported only when used."""

    def __init__(self, cfg: Config, transport: str) -> None:
        self.transport = transport
        self._client: Any
        if transport == "http":
            from edged.client.http import HttpClient
            self._client = HttpClient(http_address_of(cfg))
        elif transport == "shm":
            from edged.client.shm import ShmClient
            self._client = ShmClient(shm_address_of(cfg))
        elif transport == "grpc":
            from edged.client.grpc import GrpcClient
            self._client = GrpcClient(grpc_address_of(cfg))
        elif transport == "mqtt":
            self._client = MqttSettings.from_config(cfg).client()
        else:
            raise EdgedError(f"unknown transport {transport!r}")

    def metadata(self, model: str, version: int | None) -> dict[str, Any]:
        if self.transport == "mqtt":
            return dict(self._client.model_status(model))
        meta = dict(self._client.metadata(model, version))
        if self.transport == "http" and "max_batch_size" not in meta:
            # v2 metadata cannot tell a batch dimension from a dynamic first one; the model config can.
            meta["max_batch_size"] = int(self._client.config(model, version).get("max_batch_size", 0))
        return meta

    def infer(self, model: str, inputs: Mapping[str, np.ndarray], version: int | None) -> dict[str, np.ndarray]:
        return dict(self._client.infer(model, inputs, version=version))

    def close(self) -> None:
        self._client.close()
