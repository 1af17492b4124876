"""What the daemon needs from a transport: start listening, stop cleanly."""

from __future__ import annotations

from typing import Protocol


class Transport(Protocol):
    name: str

    async def start(self) -> None:
        """Begin serving; raise EdgedError when the transport cannot start at all."""

    async def stop(self) -> None:
        """Stop accepting work, finish or fail in-flight requests, release resources."""
