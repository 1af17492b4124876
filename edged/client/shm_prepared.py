"""A request bound to shared buffers (:meth:`ShmClient.prepare`): the steady state of a frame loop.

A camera or microphone loop sends requests of one shape many times a second. Prepared once, a run
costs what the protocol itself must: the caller writes the frame into the shared input arrays, a
message encoded once (only its request id changes) crosses the socket, and the outputs are read
through views made once. Nothing is planned, encoded, allocated or copied per run unless asked.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType, TracebackType
from typing import Protocol

import numpy as np

from edged.client.shm_memory import ClientSegment, Slot


class _Client(Protocol):
    """What a prepared request needs of its client (:class:`edged.client.shm.ShmClient`)."""

    def _run_prepared(self, prep: PreparedInfer, copy: bool) -> dict[str, np.ndarray]: ...

    def _close_prepared(self, prep: PreparedInfer) -> None: ...


class PreparedBase:
    """What a prepared request holds, with either client."""

    def __init__(self, model: str, version: int | None, *, inputs: dict[str, np.ndarray],
                 segment: ClientSegment, outputs: list[str] | None, timeout: float | None) -> None:
        self.model, self.version = model, version
        #: The shared arrays each request is read from: write into them in place (``x[...] = frame``).
        self.inputs: Mapping[str, np.ndarray] = MappingProxyType(inputs)
        self.outputs, self.timeout = outputs, timeout
        self.segment = segment
        self.slot: Slot | None = None  # the output area; remade after an interrupted or cancelled run
        self.message = bytearray()  # the request, encoded once (its id and flags patched per run)
        self.closed = False


class PreparedInfer(PreparedBase):
    """Made by :meth:`ShmClient.prepare`. Runs one request at a time, under its client's lock."""

    def __init__(self, client: _Client, model: str, version: int | None, *, inputs: dict[str, np.ndarray],
                 segment: ClientSegment, outputs: list[str] | None, timeout: float | None) -> None:
        super().__init__(model, version, inputs=inputs, segment=segment, outputs=outputs, timeout=timeout)
        # output areas of interrupted runs: given back by the next run or close() (the daemon unmaps each
        # once its run is over)
        self.orphans: list[ClientSegment] = []
        self._client = client

    def run(self, *, copy: bool = False) -> dict[str, np.ndarray]:
        """One request on what ``inputs`` hold now.

        The outputs are views on shared memory that the next run overwrites (``copy=True``: copies).
        """
        return self._client._run_prepared(self, copy)

    def close(self) -> None:
        """Give the shared buffers back (the input arrays stay readable here)."""
        self._client._close_prepared(self)

    def __enter__(self) -> PreparedInfer:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


class _AsyncClient(Protocol):
    """What an asyncio prepared request needs of its client (:class:`edged.client.shm.AsyncShmClient`)."""

    async def _run_prepared(self, prep: AsyncPreparedInfer, copy: bool) -> dict[str, np.ndarray]: ...

    async def _close_prepared(self, prep: AsyncPreparedInfer) -> None: ...


class AsyncPreparedInfer(PreparedBase):
    """Made by :meth:`AsyncShmClient.prepare`: one per concurrent loop (each runs one request at a
    time; several prepared requests run side by side on one connection, batched by the daemon)."""

    def __init__(self, client: _AsyncClient, model: str, version: int | None, *, inputs: dict[str, np.ndarray],
                 segment: ClientSegment, outputs: list[str] | None, timeout: float | None) -> None:
        super().__init__(model, version, inputs=inputs, segment=segment, outputs=outputs, timeout=timeout)
        # areas of cancelled runs whose late completion has arrived: the next new area reuses one
        self.spares: list[Slot] = []
        self.running = False
        self._client = client

    async def run(self, *, copy: bool = False) -> dict[str, np.ndarray]:
        """One request on what ``inputs`` hold now.

        The outputs are views on shared memory that the next run overwrites (``copy=True``: copies).
        """
        return await self._client._run_prepared(self, copy)

    async def close(self) -> None:
        """Give the shared buffers back (the input arrays stay readable here)."""
        await self._client._close_prepared(self)

    async def __aenter__(self) -> AsyncPreparedInfer:
        return self

    async def __aexit__(self, et: type[BaseException] | None, ev: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()
