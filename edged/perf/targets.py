"""One ``Target`` per transport: how to learn the model's inputs and how each load thread sends a request.

Every load thread gets its own connection (its own ``Caller``): that is how
independent local programs load a daemon, and it keeps the clients' locks out of
the measurement.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from edged.errors import EdgedError, ErrorCode
from edged.perf.inputs import ModelInfo
from edged.reach import MqttSettings

Caller = Callable[[Mapping[str, np.ndarray]], object]


@dataclass
class Connection:
    call: Caller
    close: Callable[[], None]


class Target(abc.ABC):
    transport: str
    address: str

    def __init__(self, model: str, version: int | None, timeout: float) -> None:
        self.model, self.version, self.timeout = model, version, timeout

    @abc.abstractmethod
    def model_info(self) -> ModelInfo:
        """The model's inputs as the daemon describes them (raises NOT_FOUND/UNAVAILABLE EdgedErrors)."""

    @abc.abstractmethod
    def connect(self) -> Connection:
        """A new connection for one load thread."""


class HttpTarget(Target):
    transport = "http"

    def __init__(self, url: str, model: str, version: int | None, timeout: float, *, binary: bool = True) -> None:
        super().__init__(model, version, timeout)
        self.address, self.binary = url, binary

    def model_info(self) -> ModelInfo:
        from edged.client.http import HttpClient

        with HttpClient(self.address, timeout=self.timeout) as c:
            meta = c.metadata(self.model, self.version)
            mbs = c.config(self.model, self.version).get("max_batch_size")
        return ModelInfo.from_metadata(meta, None if mbs is None else int(mbs))

    def connect(self) -> Connection:
        from edged.client.http import HttpClient

        c = HttpClient(self.address, timeout=self.timeout)
        model, version, binary = self.model, self.version, self.binary

        def call(inputs: Mapping[str, np.ndarray]) -> object:
            return c.infer(model, inputs, version, binary)

        return Connection(call, c.close)


class ShmTarget(Target):
    transport = "shm"

    def __init__(self, socket_path: str, model: str, version: int | None, timeout: float) -> None:
        super().__init__(model, version, timeout)
        self.address = socket_path

    def model_info(self) -> ModelInfo:
        from edged.client.shm import ShmClient

        with ShmClient(self.address) as c:
            return ModelInfo.from_metadata(c.metadata(self.model, self.version))

    def connect(self) -> Connection:
        from edged.client.shm import ShmClient

        c = ShmClient(self.address)
        model, version, timeout = self.model, self.version, self.timeout

        def call(inputs: Mapping[str, np.ndarray]) -> object:
            return c.infer(model, inputs, version, timeout=timeout)

        return Connection(call, c.close)


class GrpcTarget(Target):
    transport = "grpc"

    def __init__(self, address: str, model: str, version: int | None, timeout: float, *,
                 streaming: bool = False) -> None:
        super().__init__(model, version, timeout)
        self.address, self.streaming = address, streaming

    def model_info(self) -> ModelInfo:
        from edged.client.grpc import GrpcClient

        with GrpcClient(self.address, timeout=self.timeout) as c:
            meta = c.metadata(self.model, self.version)
        return ModelInfo.from_metadata(meta, meta["max_batch_size"])

    def connect(self) -> Connection:
        """One channel per load thread; with ``streaming`` one ModelStreamInfer stream on it, request by request."""
        from edged.client.grpc import GrpcClient

        c = GrpcClient(self.address, timeout=self.timeout)
        sender: Any = c.stream() if self.streaming else c
        model, version = self.model, self.version

        def call(inputs: Mapping[str, np.ndarray]) -> object:
            return sender.infer(model, inputs, version)

        def close() -> None:
            if sender is not c:
                sender.close()
            c.close()

        return Connection(call, close)


class MqttTarget(Target):
    transport = "mqtt"

    def __init__(self, settings: MqttSettings, model: str, version: int | None, timeout: float, *,
                 binary: bool = True, qos: int = 1) -> None:
        super().__init__(model, version, timeout)
        self.settings, self.binary, self.qos = settings, binary, qos
        self.address = f"{settings.url} device {settings.device_id}"
        self.reply_qos: int | None = None  # as the broker delivered the replies (the daemon's reply_qos)

    def _client(self) -> Any:
        return self.settings.client(binary=self.binary, connect_timeout=self.timeout, qos=self.qos)

    def model_info(self) -> ModelInfo:
        c = self._client()
        try:
            status = c.model_status(self.model, timeout=min(self.timeout, 10.0))
        finally:
            c.close()
        if status.get("state") != "ready":
            raise EdgedError(f"model {self.model!r} is {status.get('state')!r} on device "
                             f"{self.settings.device_id!r}: {status.get('reason') or 'no reason given'}",
                             code=ErrorCode.UNAVAILABLE)
        return ModelInfo.from_metadata(status)

    def connect(self) -> Connection:
        c = self._client()
        model, version, timeout = self.model, self.version, self.timeout

        def call(inputs: Mapping[str, np.ndarray]) -> object:
            out = c.infer(model, inputs, version, timeout=timeout)
            self.reply_qos = c.last_reply_qos
            return out

        return Connection(call, c.close)
